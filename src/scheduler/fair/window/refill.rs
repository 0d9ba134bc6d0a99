//! Reading a lane's jobs back from the store when its buffer runs dry.

use std::sync::Arc;

use super::{FairWindow, InFlight, LaneId, PartLane, Reader, LANE_JOBS, READ_JOBS, REFILL_SCAN};
use crate::hash::HashMap;
use crate::scheduler::store::{DueKey, StoreError};

impl FairWindow {
    /// The earliest job of a lane over its partitions, reading the store
    /// for a partition whose next job is not buffered.
    pub(super) fn next_of(
        &mut self,
        topic: &str,
        lane_id: &LaneId,
        in_flight: &InFlight,
        read: &mut Reader<'_>,
    ) -> Result<Option<DueKey>, StoreError> {
        let parts: Vec<i32> = match self.topics.get(topic).and_then(|t| t.lanes.get(lane_id)) {
            Some(lane) => lane.partitions(),
            None => return Ok(None),
        };
        let mut best: Option<DueKey> = None;
        for p in parts {
            let known = self.part_lane(topic, lane_id, p).and_then(|pl| {
                pl.next().copied().map(Some).or(if pl.missing_from.is_some() {
                    None
                } else {
                    Some(None)
                })
            });
            let next = match known {
                Some(next) => next,
                None => {
                    self.refill(topic, lane_id, p, in_flight, read)?;
                    self.part_lane(topic, lane_id, p)
                        .and_then(|pl| pl.next().copied())
                }
            };
            if let Some(k) = next {
                best = Some(best.map_or(k, |b| b.min(k)));
            }
        }
        Ok(best)
    }

    fn part_lane(&self, topic: &str, lane_id: &LaneId, p: i32) -> Option<&PartLane> {
        self.topics.get(topic)?.lanes.get(lane_id)?.part(p)
    }

    /// Read a lane's jobs of partition `p` from where it is missing from,
    /// up to the partition's cursor, as far as there is room. The same read
    /// also refills every other lane of the partition missing from there
    /// or later (its jobs from its own missing point on are all in the
    /// read): tenants' jobs interleaved in run-at order are read about once
    /// each, not once per lane that runs dry (with a hundred tenants, a
    /// hundred times over).
    fn refill(
        &mut self,
        topic: &str,
        lane_id: &LaneId,
        p: i32,
        in_flight: &InFlight,
        read: &mut Reader<'_>,
    ) -> Result<(), StoreError> {
        let cursor = self.cursors.get(&p).copied().flatten();
        let Some(pl) = self
            .topics
            .get_mut(topic)
            .and_then(|t| t.lanes.get_mut(lane_id))
            .and_then(|l| l.part_mut(p))
        else {
            return Ok(());
        };
        let (Some(from), Some(cursor)) = (pl.missing_from, cursor) else {
            pl.missing_from = None;
            return Ok(());
        };
        let FairWindow {
            topics,
            index,
            capacity,
            ..
        } = self;
        let asked: (Arc<str>, LaneId) = (Arc::from(topic), lane_id.clone());
        // Lanes this read refilled (the one asked for from the start), and
        // whether each ran out of room: a lane stops at its first job that
        // did not fit, which it is missing from.
        let mut touched: HashMap<(Arc<str>, LaneId), bool> = HashMap::default();
        touched.insert(asked.clone(), false);
        let mut after = before(&from);
        let mut scanned = 0;
        let reached_end = loop {
            let got = read(p, after, cursor.run_at_ms, READ_JOBS)?;
            let n = got.len();
            let mut past_cursor = false;
            let mut asked_full = false;
            for (k, job) in got {
                if k > cursor {
                    past_cursor = true;
                    break;
                }
                after = Some(k);
                scanned += 1;
                if in_flight.contains(&k) {
                    continue;
                }
                let j = &job.job;
                let Some(t) = topics.get_mut(j.topic.as_str()) else {
                    continue;
                };
                // A tenant with a lane is known to its order (no lane
                // otherwise): its name is looked up, not allocated.
                let Some(name) = t.order.name(j.tenant.as_deref().unwrap_or("")) else {
                    continue;
                };
                let id: LaneId = (name.clone(), j.priority.class());
                let Some(pl) = t.lanes.get_mut(&id).and_then(|l| l.part_mut(p)) else {
                    continue;
                };
                // Its lane's jobs before `k` are all buffered or in flight
                // only if it is missing from `from` or later (so the read
                // went past all of them) and up to `k`.
                let missing = pl.missing_from.is_some_and(|m| m >= from && m <= k);
                if !missing || pl.jobs.contains(&k) {
                    continue;
                }
                let whose = (t.name.clone(), id);
                let stopped = touched.entry(whose.clone()).or_insert(false);
                if *stopped {
                    continue;
                }
                // The lane asked for always gets its next job, even with
                // every buffer full: so a lane whose buffered jobs all come
                // after a job it is missing (one handed to it late, when
                // there was no room) is never stalled by a full window.
                let first = whose == asked && pl.jobs.first_key().is_none_or(|b| k < *b);
                if !first && (index.len() >= *capacity || pl.jobs.len() >= LANE_JOBS) {
                    *stopped = true;
                    pl.missing_from = Some(k);
                    if whose == asked {
                        asked_full = true;
                        break;
                    }
                    continue;
                }
                pl.missing_from = Some(after_key(&k));
                pl.jobs.insert(k, job);
                index.insert(k, whose);
            }
            if asked_full {
                break false;
            }
            if past_cursor || n < READ_JOBS {
                break true;
            }
            if scanned >= REFILL_SCAN {
                break false;
            }
        };
        // Every lane refilled and not stopped has all its jobs read so far:
        // none missing if the read got to the cursor, else from here on.
        for ((t, id), stopped) in touched {
            if stopped {
                continue;
            }
            let pl = topics
                .get_mut(&*t)
                .and_then(|t| t.lanes.get_mut(&id))
                .and_then(|l| l.part_mut(p));
            if let Some(pl) = pl {
                if reached_end {
                    pl.missing_from = None;
                } else if let Some(a) = after {
                    pl.missing_from = Some(after_key(&a));
                }
            }
        }
        Ok(())
    }
}

/// The key just before `k` in its partition (`None` before the first).
fn before(k: &DueKey) -> Option<DueKey> {
    if k.seq > 0 {
        Some(DueKey { seq: k.seq - 1, ..*k })
    } else if k.run_at_ms > i64::MIN {
        Some(DueKey {
            run_at_ms: k.run_at_ms - 1,
            seq: u64::MAX,
            ..*k
        })
    } else {
        None
    }
}

/// The key just after `k` in its partition.
fn after_key(k: &DueKey) -> DueKey {
    if k.seq < u64::MAX {
        DueKey { seq: k.seq + 1, ..*k }
    } else {
        DueKey {
            run_at_ms: k.run_at_ms.saturating_add(1),
            seq: 0,
            ..*k
        }
    }
}
