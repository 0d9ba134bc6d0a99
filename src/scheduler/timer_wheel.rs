//! The in-memory part of the timer wheel: an ordered window over the near
//! future, refilled from the store as time moves.
//!
//! Only jobs due within `span` of now, and at most `capacity` of them, are
//! held in memory, ordered by (run-at, partition, arrival). For each owned
//! partition a *horizon* records how far the window mirrors the store: every
//! pending job of that partition at or before its horizon is in the window.
//! New jobs at or before the horizon enter the window at once; later ones
//! stay on disk until a refill reaches them. Memory is therefore bounded by
//! `capacity`, whatever the number of pending jobs.
//!
//! The window never reads the store itself: a refill is planned here
//! ([`TimerWheel::begin_refill`]), read by the caller outside the window's
//! lock, and merged back ([`TimerWheel::finish_refill`]) together with the
//! changes followed meanwhile (`scheduler/refill.rs` does the three steps).
//!
//! *Direct* jobs (see `scheduler/service/direct.rs`) are due jobs that are not
//! in the store: they enter only where the window already mirrors the store
//! (so they fire in order with stored jobs), at most half the capacity of
//! them, and they are never dropped to make room. A direct job's place is
//! reserved when it is picked ([`TimerWheel::reserve_direct`]): until it
//! enters, its partition's horizon is not pulled back before it, so that it
//! can enter whatever jobs the window takes in meanwhile.
//!
//! The window also knows which jobs are being fired (taken, not yet
//! finished) and which an ingest batch is changing (a cancel, reschedule or
//! replace read but not yet applied): a change that meets a job being fired
//! comes too late, and a job being changed is not taken until the change is
//! applied. Both sets hold jobs in memory anyway; nothing for waiting jobs.

use std::collections::{BTreeMap, BTreeSet};

use crate::hash::{HashMap, HashSet};

use crate::job::JobId;
use crate::scheduler::store::{Applied, DueKey};
use crate::scheduler::stored::StoredJob;

/// How far a partition's window mirrors the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Horizon {
    /// Last (run-at, seq) covered, inclusive.
    run_at_ms: i64,
    seq: u64,
}

impl Horizon {
    fn covers(&self, k: &DueKey) -> bool {
        (k.run_at_ms, k.seq) <= (self.run_at_ms, self.seq)
    }

    fn before(k: &DueKey) -> Horizon {
        if k.seq > 0 {
            Horizon {
                run_at_ms: k.run_at_ms,
                seq: k.seq - 1,
            }
        } else {
            Horizon {
                run_at_ms: k.run_at_ms.saturating_sub(1),
                seq: u64::MAX,
            }
        }
    }

    fn as_key(&self, partition: i32) -> DueKey {
        DueKey {
            run_at_ms: self.run_at_ms,
            partition,
            seq: self.seq,
        }
    }
}

/// The window of near-future jobs.
pub struct TimerWheel {
    /// Jobs in memory, in firing order.
    entries: BTreeMap<DueKey, StoredJob>,
    /// Owned partitions and how far each is mirrored (`None`: nothing loaded yet).
    horizons: HashMap<i32, Option<Horizon>>,
    /// How far ahead of now the window reaches, in milliseconds.
    span_ms: i64,
    /// Most jobs held in memory.
    capacity: usize,
    /// Entries that are direct jobs (not in the store), with when (clock
    /// ms) each entered.
    direct: HashMap<DueKey, i64>,
    /// Places reserved for direct jobs picked and not yet added, per
    /// partition, and how many in all.
    reserved: HashMap<i32, BTreeSet<DueKey>>,
    reserved_len: usize,
    /// Partitions whose direct jobs are being persisted: none of their jobs
    /// is taken meanwhile, so firing order holds.
    persisting: HashSet<i32>,
    /// The same, by partition and job id.
    direct_ids: HashMap<(i32, JobId), DueKey>,
    /// Jobs taken for firing and not yet finished, with how many versions
    /// of each (a retry put again while its earlier run fires can be taken
    /// too, and put back: that must not end the earlier one's firing).
    firing: HashMap<(i32, JobId), u32>,
    /// Jobs being fired that a schedule record read since puts again (a
    /// worker's retry), with the latest such record's offset: a fire of a
    /// version stored from an earlier record must not tombstone the new put.
    put_again: HashMap<(i32, JobId), u64>,
    /// Jobs ingest batches are changing, with how many batches: not taken
    /// until every one of them is applied.
    changing: HashMap<(i32, JobId), u32>,
    /// The refill under way, if any.
    refilling: Option<Refilling>,
    /// Numbers refills, so a refill of a partition let go and taken again
    /// meanwhile is told apart.
    next_ticket: u64,
    /// Topics whose jobs never enter `entries` (fair topics: their jobs
    /// wait in the fair lanes); their jobs count as firing and changing here
    /// all the same.
    kept_out: HashSet<String>,
}

/// What [`TimerWheel::take_due`] found.
#[derive(Debug, Default)]
pub struct Due {
    /// Jobs to fire, earliest first.
    pub jobs: Vec<(DueKey, StoredJob)>,
    /// Per partition, the latest run-at of the due jobs left because the
    /// partition has not been read up to their run-at.
    pub held: HashMap<i32, i64>,
}

impl TimerWheel {
    /// An empty window reaching `span_ms` ahead, holding at most `capacity` jobs.
    pub fn new(span_ms: i64, capacity: usize) -> Self {
        TimerWheel {
            entries: BTreeMap::new(),
            horizons: HashMap::default(),
            span_ms: span_ms.max(1),
            capacity: capacity.max(1),
            direct: HashMap::default(),
            reserved: HashMap::default(),
            reserved_len: 0,
            persisting: HashSet::default(),
            direct_ids: HashMap::default(),
            firing: HashMap::default(),
            put_again: HashMap::default(),
            changing: HashMap::default(),
            refilling: None,
            next_ticket: 0,
            kept_out: HashSet::default(),
        }
    }

    /// Start tracking `partition` (its jobs load on the next refill).
    pub fn add_partition(&mut self, partition: i32) {
        self.forget_refill(partition);
        self.forget_reserved(partition);
        self.horizons.insert(partition, None);
    }

    /// Stop tracking `partition` and drop its jobs from memory.
    pub fn remove_partition(&mut self, partition: i32) {
        self.forget_refill(partition);
        self.forget_reserved(partition);
        self.persisting.remove(&partition);
        self.horizons.remove(&partition);
        self.entries.retain(|k, _| k.partition != partition);
        self.direct.retain(|k, _| k.partition != partition);
        self.direct_ids.retain(|(p, _), _| *p != partition);
        self.changing.retain(|(p, _), _| *p != partition);
    }

    /// Whether the window mirrors the store at `k`: its partition is owned
    /// and loaded up to `k`.
    fn mirrors(&self, k: &DueKey) -> bool {
        matches!(self.horizons.get(&k.partition), Some(Some(h)) if h.covers(k))
    }

    /// Whether job `id` of `partition` is being fired.
    pub fn is_firing(&self, partition: i32, id: &JobId) -> bool {
        !self.firing.is_empty() && self.firing.contains_key(&(partition, *id))
    }

    /// The schedule record at `offset` of `partition` puts job `id` again:
    /// if that job is being fired, the fires of versions stored from
    /// earlier records leave the changelog alone.
    pub fn put_again(&mut self, partition: i32, id: JobId, offset: u64) {
        if self.is_firing(partition, &id) {
            let at = self.put_again.entry((partition, id)).or_default();
            *at = (*at).max(offset);
        }
    }

    /// Whether job `id` of `partition`, being fired in the version stored
    /// from the schedule record at `seq`, was put again by a later record
    /// since it was taken.
    pub fn was_put_again(&self, partition: i32, id: &JobId, seq: u64) -> bool {
        !self.put_again.is_empty() && self.put_again.get(&(partition, *id)).is_some_and(|at| *at > seq)
    }

    /// An ingest batch is changing job `id` of `partition`: it is not taken
    /// until [`TimerWheel::changed`].
    pub fn changing(&mut self, partition: i32, id: JobId) {
        *self.changing.entry((partition, id)).or_default() += 1;
    }

    /// A batch's changes of `ids` are applied.
    pub fn changed(&mut self, ids: impl IntoIterator<Item = (i32, JobId)>) {
        for k in ids {
            if let Some(n) = self.changing.get_mut(&k) {
                *n -= 1;
                if *n == 0 {
                    self.changing.remove(&k);
                }
            }
        }
    }

    /// The fires of `jobs` are finished (acknowledged, dead-lettered, or
    /// their partition let go).
    pub fn fired(&mut self, jobs: &[(DueKey, StoredJob)]) {
        for (k, j) in jobs {
            let id = (k.partition, j.job.stored_id());
            if let Some(n) = self.firing.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    self.firing.remove(&id);
                    if !self.put_again.is_empty() {
                        self.put_again.remove(&id);
                    }
                }
            }
        }
    }

    /// Whether `partition` is tracked.
    pub fn owns(&self, partition: i32) -> bool {
        self.horizons.contains_key(&partition)
    }

    /// Partitions tracked.
    pub fn partitions(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self.horizons.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// How far ahead of now the window reaches, in milliseconds.
    pub fn span_ms(&self) -> i64 {
        self.span_ms
    }

    /// Jobs in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no job is in memory.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Follow changes the store applied, keeping the window a faithful
    /// mirror up to each horizon.
    pub fn follow(&mut self, applied: &[Applied]) {
        if let Some(r) = &mut self.refilling {
            let p = r.partition;
            r.log
                .extend(applied.iter().filter(|a| a.key().partition == p).cloned());
        }
        for a in applied {
            match a {
                Applied::Removed(k, _) => {
                    self.entries.remove(k);
                }
                Applied::Added(k, job) => {
                    if self.mirrors(k) && !self.keeps_out(&job.job.topic) {
                        self.entries.insert(*k, job.clone());
                    }
                }
            }
        }
        self.shrink();
    }

    /// Over capacity: drop the latest jobs and pull their partitions'
    /// horizons back before them, so they reload from disk later.
    fn shrink(&mut self) {
        while self.entries.len() > self.capacity {
            // The latest stored job; direct jobs stay (nothing else holds
            // them), and so do jobs at or before a reserved place.
            let Some(k) = self
                .entries
                .keys()
                .rev()
                .find(|k| !self.direct.contains_key(k) && !self.pinned(k))
                .copied()
            else {
                break;
            };
            self.entries.remove(&k);
            if let Some(h) = self.horizons.get_mut(&k.partition) {
                let back = Horizon::before(&k);
                *h = Some(match *h {
                    Some(cur) if (cur.run_at_ms, cur.seq) < (back.run_at_ms, back.seq) => cur,
                    _ => back,
                });
            }
        }
    }

    /// When the window next needs a refill: when half its span has passed
    /// since the earliest horizon was drawn (or now, if a partition has not
    /// loaded yet or was cut short by capacity).
    pub fn refill_due_ms(&self) -> Option<i64> {
        self.horizons
            .values()
            .map(|h| match h {
                None => i64::MIN,
                Some(h) => h.run_at_ms.saturating_sub(self.span_ms / 2),
            })
            .min()
    }

    /// Run-at of the earliest job in memory due after `now_ms`: when the
    /// dispatcher next has something new to fire (jobs already due but held
    /// wait for their partition to catch up instead).
    pub fn next_after_ms(&self, now_ms: i64) -> Option<i64> {
        let from = DueKey {
            run_at_ms: now_ms.saturating_add(1),
            partition: i32::MIN,
            seq: 0,
        };
        self.entries.range(from..).next().map(|(k, _)| k.run_at_ms)
    }

    /// Take up to `max` jobs due at `now_ms` (run-at ≤ now), earliest first,
    /// and count them as firing. Only jobs at or before their partition's
    /// horizon: a direct job left beyond it (when room was made by dropping
    /// stored jobs before it) waits until a refill has brought those back, so
    /// firing order holds. Only jobs whose partition has been read up to their
    /// run-at (`until`, per partition; the others are `held`), and none an
    /// ingest batch is changing.
    pub fn take_due(&mut self, now_ms: i64, max: usize, until: &HashMap<i32, i64>) -> Due {
        let mut keys = Vec::with_capacity(max.min(self.entries.len()));
        let mut held: HashMap<i32, i64> = HashMap::default();
        let mut skipped = false;
        let mut end = None;
        for (k, j) in self.entries.iter() {
            if k.run_at_ms > now_ms || keys.len() >= max {
                end = Some(*k);
                break;
            }
            if until.get(&k.partition).is_none_or(|u| k.run_at_ms > *u) {
                let h = held.entry(k.partition).or_insert(k.run_at_ms);
                *h = (*h).max(k.run_at_ms);
                skipped = true;
            } else if !self.mirrors(k)
                || self.is_changing(k.partition, &j.job.stored_id())
                || (!self.persisting.is_empty() && self.persisting.contains(&k.partition))
            {
                skipped = true;
            } else {
                keys.push(*k);
            }
        }
        let jobs: Vec<(DueKey, StoredJob)> = if skipped {
            keys.into_iter()
                .filter_map(|k| self.entries.remove(&k).map(|v| (k, v)))
                .collect()
        } else {
            // Every entry before `end` is taken: split the map there, cheaper
            // than removing the keys one by one.
            let rest = match end {
                Some(end) => self.entries.split_off(&end),
                None => BTreeMap::new(),
            };
            std::mem::replace(&mut self.entries, rest).into_iter().collect()
        };
        self.firing.reserve(jobs.len());
        for (k, j) in &jobs {
            *self.firing.entry((k.partition, j.job.stored_id())).or_default() += 1;
        }
        Due { jobs, held }
    }

    /// Put back jobs that could not be fired (their partition still owned;
    /// not of a topic kept out); those in `direct` are direct jobs again.
    /// Their firing is ended apart, with the rest of their round
    /// ([`TimerWheel::fired`]).
    pub fn put_back(&mut self, jobs: Vec<(DueKey, StoredJob)>, direct: &HashMap<DueKey, i64>) {
        for (k, j) in jobs {
            if self.owns(k.partition) && !self.keeps_out(&j.job.topic) {
                if let Some(since) = direct.get(&k) {
                    self.direct.insert(k, *since);
                    self.direct_ids.insert((k.partition, j.job.stored_id()), k);
                }
                self.entries.insert(k, j);
            }
        }
        self.shrink();
    }
}

mod direct;
mod kept_out;
mod refill;
pub use refill::RefillRead;
use refill::Refilling;

#[cfg(test)]
mod tests;
