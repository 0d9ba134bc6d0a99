//! The fair window: which due jobs of fair topics are waiting, per tenant,
//! in bounded memory.
//!
//! Jobs of fair topics stay in the store until they are released; they
//! never enter the timer wheel's window (a flood would fill it). For each
//! owned partition a *cursor* says how far its due jobs have been looked at:
//! every fair job at or before it has been handed to its *lane* (one per
//! topic, tenant and priority class, split by partition). A lane buffers at
//! most [`LANE_JOBS`] jobs in key order, and all lanes together at most the
//! window's capacity; a job that does not fit leaves its lane *missing from*
//! its key: the lane is read again from the store from there when it runs
//! dry. So memory follows the tenants with jobs waiting (one small entry
//! each) plus the bounded buffers, whatever the number of waiting jobs.
//!
//! Releasing asks each fair topic's [`TenantOrder`] which tenant goes next
//! and takes that lane's earliest job; within a lane jobs leave in key
//! order, so a key's jobs of one class keep their order.
//!
//! The window does not read the store itself: the caller passes a reader
//! (the store's `scan_due`), called under the caller's lock with bounded
//! reads.

use std::sync::Arc;

use crate::hash::{HashMap, HashSet};
use crate::job::JobId;
use crate::scheduler::fair::{TenantOrder, Weights};
use crate::scheduler::store::{DueKey, StoreError};
use crate::scheduler::stored::StoredJob;

/// Most jobs one lane buffers per partition.
pub const LANE_JOBS: usize = 64;

/// Most jobs one store read returns.
const READ_JOBS: usize = 1024;

/// Most jobs a lane refill reads before it gives up for this round (a lane
/// whose next job sits behind a long run of other tenants' jobs).
const REFILL_SCAN: usize = 16 * READ_JOBS;

/// Reads the store: `partition`'s near jobs after a key, due at or before a
/// time, at most a number of them, in key order.
pub type Reader<'a> =
    dyn FnMut(i32, Option<DueKey>, i64, usize) -> Result<Vec<(DueKey, StoredJob)>, StoreError> + 'a;

/// Jobs released, in order.
pub type Released = Vec<(DueKey, StoredJob)>;

/// Jobs of fair topics being fired (taken, not finished), by where they are
/// stored: a job put again under the same id meanwhile (a worker's retry)
/// is another entry, not in flight.
pub type InFlight = HashSet<DueKey>;

/// Which lane a job belongs to: (tenant, class).
type LaneId = (Arc<str>, usize);

#[derive(Debug)]
struct Topic {
    name: Arc<str>,
    order: TenantOrder,
    lanes: HashMap<LaneId, Lane>,
}

/// What [`FairWindow::discover`] found.
#[derive(Debug, Default)]
pub struct Discovered {
    /// Per partition, the latest run-at of due jobs not looked at because
    /// the partition is not read up to it.
    pub held: HashMap<i32, i64>,
    /// Some partition has more due jobs than one round reads.
    pub more: bool,
}

/// The due jobs of fair topics waiting to be released (see the module doc).
#[derive(Debug)]
pub struct FairWindow {
    topics: HashMap<String, Topic>,
    /// Owned partitions and how far their due jobs have been looked at.
    cursors: HashMap<i32, Option<DueKey>>,
    /// Where each buffered job is: its topic and lane.
    index: HashMap<DueKey, (Arc<str>, LaneId)>,
    /// Most jobs buffered.
    capacity: usize,
}

impl FairWindow {
    /// A window over `topics`, releasing by `weights` with recent service
    /// halving every `half_life_ms`, buffering at most `capacity` jobs.
    pub fn new(topics: &[String], weights: Weights, half_life_ms: i64, capacity: usize, now_ms: i64) -> Self {
        FairWindow {
            topics: topics
                .iter()
                .map(|t| {
                    let order = TenantOrder::new(weights.clone(), half_life_ms, now_ms);
                    let topic = Topic {
                        name: Arc::from(t.as_str()),
                        order,
                        lanes: HashMap::default(),
                    };
                    (t.clone(), topic)
                })
                .collect(),
            cursors: HashMap::default(),
            index: HashMap::default(),
            capacity: capacity.max(1),
        }
    }

    /// Whether `topic` is dispatched fairly.
    pub fn is_fair(&self, topic: &str) -> bool {
        self.topics.contains_key(topic)
    }

    /// The fair topics.
    pub fn topics(&self) -> impl Iterator<Item = &str> {
        self.topics.keys().map(String::as_str)
    }

    /// Start tracking `partition` (its due jobs are looked at from the start).
    pub fn add_partition(&mut self, partition: i32) {
        self.remove_partition(partition);
        self.cursors.insert(partition, None);
    }

    /// Stop tracking `partition`: its buffered jobs are dropped.
    pub fn remove_partition(&mut self, partition: i32) {
        self.cursors.remove(&partition);
        self.index.retain(|k, _| k.partition != partition);
        for topic in self.topics.values_mut() {
            topic.lanes.retain(|(tenant, class), lane| {
                lane.remove_part(partition);
                let waiting = lane.is_waiting();
                if !waiting {
                    topic.order.set_waiting(tenant, *class, false);
                }
                waiting
            });
        }
    }

    /// Jobs buffered in memory.
    pub fn buffered(&self) -> usize {
        self.index.len()
    }

    /// Whether a job of `topic` waits to be released.
    pub fn is_waiting(&self, topic: &str) -> bool {
        self.topics.get(topic).is_some_and(|t| !t.lanes.is_empty())
    }

    /// Forget, in every topic's order, the tenants with nothing waiting
    /// whose recent service has decayed away by `now_ms` (see
    /// [`TenantOrder::sweep`]). Returns the tenants known after it, over all
    /// topics.
    pub fn sweep(&mut self, now_ms: i64) -> usize {
        self.topics.values_mut().map(|t| t.order.sweep(now_ms)).sum()
    }

    /// Tenants known per topic (jobs waiting, or served recently): the
    /// memory the tenant order holds.
    pub fn tenants_known(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = self
            .topics
            .iter()
            .map(|(name, t)| (name.clone(), t.order.len()))
            .collect();
        out.sort();
        out
    }

    /// Tenants with jobs waiting, per topic.
    pub fn tenants_waiting(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = self
            .topics
            .iter()
            .map(|(name, t)| {
                let tenants: HashSet<&Arc<str>> = t.lanes.keys().map(|(tenant, _)| tenant).collect();
                (name.clone(), tenants.len())
            })
            .collect();
        out.sort();
        out
    }

    /// A fair job was stored at `k` (the store's change, followed). One at
    /// or before its partition's cursor joins its lane now; a later one is
    /// found when the cursor gets there.
    pub fn added(&mut self, k: DueKey, job: &StoredJob, in_flight: &InFlight) {
        let covered = match self.cursors.get(&k.partition) {
            Some(Some(c)) => k <= *c,
            _ => false,
        };
        if covered && !in_flight.contains(&k) {
            self.deliver(k, job.clone());
        }
    }

    /// The job at `k` is gone from the store (fired, cancelled, replaced).
    pub fn removed(&mut self, k: &DueKey) {
        let Some((topic, lane_id)) = self.index.remove(k) else {
            return;
        };
        let Some(t) = self.topics.get_mut(&*topic) else {
            return;
        };
        if let Some(lane) = t.lanes.get_mut(&lane_id) {
            if let Some(pl) = lane.part_mut(k.partition) {
                pl.jobs.remove(k);
            }
            settle(t, &lane_id);
        }
    }

    /// A released job could not be fired: it waits again.
    pub fn put_back(&mut self, k: DueKey, job: StoredJob) {
        if self.cursors.contains_key(&k.partition) {
            self.deliver(k, job);
        }
    }

    /// Look at each owned partition's due jobs past its cursor, up to
    /// `now_ms` but not past how far the partition has been read (`until`:
    /// a later job is held, so that a cancel written before its run-at
    /// wins), at most one read per partition; fair ones join their lanes.
    pub fn discover(
        &mut self,
        now_ms: i64,
        until: &HashMap<i32, i64>,
        in_flight: &InFlight,
        read: &mut Reader<'_>,
    ) -> Result<Discovered, StoreError> {
        let mut out = Discovered::default();
        let mut parts: Vec<(i32, Option<DueKey>)> = self.cursors.iter().map(|(p, c)| (*p, *c)).collect();
        parts.sort_unstable_by_key(|(p, _)| *p);
        for (p, cursor) in parts {
            let read_to = until.get(&p).map_or(i64::MIN, |u| (*u).min(now_ms));
            if cursor.is_some_and(|c| c.run_at_ms >= now_ms) {
                // Every job due by now has been looked at; later ones come
                // through `added`.
                continue;
            }
            let got = read(p, cursor, now_ms, READ_JOBS)?;
            let full = got.len() >= READ_JOBS;
            let mut last = cursor;
            let mut stopped = false;
            for (k, job) in got {
                if k.run_at_ms > read_to {
                    let h = out.held.entry(p).or_insert(k.run_at_ms);
                    *h = (*h).max(k.run_at_ms);
                    stopped = true;
                    break;
                }
                last = Some(k);
                if self.is_fair(&job.job.topic) && !in_flight.contains(&k) {
                    self.deliver(k, job);
                }
            }
            let next = if full || stopped {
                out.more |= full && !stopped;
                last
            } else if read_to == i64::MIN {
                last
            } else {
                let all_read = DueKey {
                    run_at_ms: read_to,
                    partition: p,
                    seq: u64::MAX,
                };
                Some(last.map_or(all_read, |l| l.max(all_read)))
            };
            self.cursors.insert(p, next);
        }
        #[cfg(debug_assertions)]
        self.check();
        Ok(out)
    }

    /// Release up to `max` due jobs of `topic` in fair order at `now_ms`
    /// (charging each tenant one unit of service per job); a lane whose
    /// next job is being changed (`changing`) waits for the next round.
    pub fn release(
        &mut self,
        topic: &str,
        max: usize,
        now_ms: i64,
        in_flight: &InFlight,
        changing: &dyn Fn(i32, &JobId) -> bool,
        read: &mut Reader<'_>,
    ) -> Result<Vec<(DueKey, StoredJob)>, StoreError> {
        let mut out = Vec::new();
        let mut paused: Vec<LaneId> = Vec::new();
        while out.len() < max {
            let Some(pick) = self.topics.get(topic).and_then(|t| t.order.pick()) else {
                break;
            };
            let lane_id: LaneId = (pick.tenant.clone(), pick.class);
            let next = self.next_of(topic, &lane_id, in_flight, read)?;
            let t = self.topics.get_mut(topic).expect("picked from this topic");
            let taken = next.and_then(|k| {
                let pl = t.lanes.get_mut(&lane_id)?.part_mut(k.partition)?;
                let id = pl.jobs.get(&k)?.job.stored_id();
                if changing(k.partition, &id) {
                    return None;
                }
                pl.jobs.remove(&k).map(|j| (k, j))
            });
            match taken {
                Some((k, job)) => {
                    self.index.remove(&k);
                    t.order.charge(&pick, now_ms, 1.0);
                    settle(t, &lane_id);
                    out.push((k, job));
                }
                None => {
                    // Nothing to take from it this round.
                    t.order.set_waiting(&lane_id.0, lane_id.1, false);
                    paused.push(lane_id);
                }
            }
        }
        if let Some(t) = self.topics.get_mut(topic) {
            for lane_id in paused {
                if t.lanes.get(&lane_id).is_some_and(Lane::is_waiting) {
                    t.order.set_waiting(&lane_id.0, lane_id.1, true);
                } else {
                    t.lanes.remove(&lane_id);
                }
            }
        }
        #[cfg(debug_assertions)]
        self.check();
        Ok(out)
    }

    /// Debug builds: the lanes, the order and the index agree. A lane the
    /// order does not know is waiting is never released again.
    #[cfg(debug_assertions)]
    fn check(&self) {
        let mut buffered = 0;
        for (name, t) in &self.topics {
            for ((tenant, class), lane) in &t.lanes {
                assert!(
                    lane.is_waiting(),
                    "fair topic {name}: the lane of tenant {tenant:?}, class {class} is kept with nothing waiting"
                );
                assert!(
                    t.order.is_waiting(tenant, *class),
                    "fair topic {name}: tenant {tenant:?}, class {class} has jobs waiting that its order does not know of"
                );
                buffered += lane.buffered();
                for p in lane.partitions() {
                    let pl = lane.part(p).expect("listed");
                    assert!(
                        pl.missing_from.is_none_or(|m| !pl.jobs.contains(&m)),
                        "fair topic {name}: tenant {tenant:?}, class {class}, partition {p}: a buffered job is also missing"
                    );
                }
            }
        }
        assert_eq!(
            buffered,
            self.index.len(),
            "fair jobs buffered and their index disagree"
        );
    }

    /// Hand a due fair job to its lane: buffered when the lane is complete
    /// and there is room, else the lane is missing from it.
    fn deliver(&mut self, k: DueKey, job: StoredJob) {
        let room = self.index.len() < self.capacity;
        let Some(t) = self.topics.get_mut(job.job.topic.as_str()) else {
            return;
        };
        let tenant = job.job.tenant.as_deref().unwrap_or("");
        let tenant: Arc<str> = t.order.name(tenant).cloned().unwrap_or_else(|| Arc::from(tenant));
        let class = job.job.priority.class();
        let lane_id = (tenant, class);
        let lane = t.lanes.entry(lane_id.clone()).or_default();
        let pl = lane.part_or_default(k.partition);
        if pl.jobs.contains(&k) {
            // Handed over again (found by a read and followed from the
            // store both): nothing is missing. Marking it missing would
            // let it be released and then read back while in flight.
            return;
        }
        let fits = room && pl.jobs.len() < LANE_JOBS && pl.missing_from.is_none_or(|m| k < m);
        if fits {
            if pl.jobs.insert(k, job) {
                self.index.insert(k, (t.name.clone(), lane_id.clone()));
            }
        } else {
            pl.missing_from = Some(pl.missing_from.map_or(k, |m| m.min(k)));
        }
        t.order.set_waiting(&lane_id.0, class, true);
    }
}

/// After a lane changed: drop it and tell the order when nothing waits.
fn settle(t: &mut Topic, lane_id: &LaneId) {
    let waiting = t.lanes.get(lane_id).is_some_and(Lane::is_waiting);
    if !waiting {
        t.lanes.remove(lane_id);
        t.order.set_waiting(&lane_id.0, lane_id.1, false);
    }
}

mod early;
mod lane;
mod refill;

use lane::{Lane, PartLane};

#[cfg(test)]
mod tests;
