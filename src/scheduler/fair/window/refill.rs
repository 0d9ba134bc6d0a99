//! Reading a lane's jobs back from the store when its buffer runs dry.

use super::{FairWindow, InFlight, LaneId, PartLane, Reader, LANE_JOBS, READ_JOBS, REFILL_SCAN};
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
    /// up to the partition's cursor, as far as there is room.
    fn refill(
        &mut self,
        topic: &str,
        lane_id: &LaneId,
        p: i32,
        in_flight: &InFlight,
        read: &mut Reader<'_>,
    ) -> Result<(), StoreError> {
        let cursor = self.cursors.get(&p).copied().flatten();
        let Some(t) = self.topics.get_mut(topic) else {
            return Ok(());
        };
        let Some(pl) = t.lanes.get_mut(lane_id).and_then(|l| l.part_mut(p)) else {
            return Ok(());
        };
        let (Some(from), Some(cursor)) = (pl.missing_from, cursor) else {
            pl.missing_from = None;
            return Ok(());
        };
        let mut after = before(&from);
        let mut scanned = 0;
        loop {
            let got = read(p, after, cursor.run_at_ms, READ_JOBS)?;
            let n = got.len();
            for (k, job) in got {
                if k > cursor {
                    pl.missing_from = None;
                    return Ok(());
                }
                after = Some(k);
                scanned += 1;
                let j = &job.job;
                let ours = j.topic == topic
                    && j.priority.class() == lane_id.1
                    && j.tenant.as_deref().unwrap_or("") == &*lane_id.0;
                if !ours || in_flight.contains(&k) || pl.jobs.contains(&k) {
                    continue;
                }
                // At least one job, so a full buffer never stalls a lane.
                let room =
                    pl.jobs.is_empty() || (self.index.len() < self.capacity && pl.jobs.len() < LANE_JOBS);
                if !room {
                    pl.missing_from = Some(k);
                    return Ok(());
                }
                pl.jobs.insert(k, job);
                self.index.insert(k, (t.name.clone(), lane_id.clone()));
            }
            if n < READ_JOBS {
                pl.missing_from = None;
                return Ok(());
            }
            if scanned >= REFILL_SCAN {
                // Go on from here next time.
                pl.missing_from = after.map(|a| after_key(&a));
                return Ok(());
            }
        }
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
