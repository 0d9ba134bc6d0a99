//! A lane's memory: its partitions and, per partition, its buffered jobs,
//! each sized to what it holds.
//!
//! With many tenants waiting most lanes buffer a job or two, so the
//! containers are small vectors grown one slot at a time at first (a
//! B-tree node holds eleven jobs however few it has: about 3 KB a lane).

use std::collections::VecDeque;

use crate::scheduler::store::DueKey;
use crate::scheduler::stored::StoredJob;

/// Up to this length a buffer grows by one slot at a time.
const EXACT_UP_TO: usize = 4;

/// A lane's jobs in one partition, in key order.
#[derive(Debug, Default)]
pub(super) struct Buffer(VecDeque<(DueKey, StoredJob)>);

impl Buffer {
    pub(super) fn len(&self) -> usize {
        self.0.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The earliest key buffered.
    pub(super) fn first_key(&self) -> Option<&DueKey> {
        self.0.front().map(|(k, _)| k)
    }

    fn find(&self, k: &DueKey) -> Result<usize, usize> {
        self.0.binary_search_by(|(x, _)| x.cmp(k))
    }

    pub(super) fn contains(&self, k: &DueKey) -> bool {
        self.find(k).is_ok()
    }

    pub(super) fn get(&self, k: &DueKey) -> Option<&StoredJob> {
        self.find(k).ok().map(|i| &self.0[i].1)
    }

    /// Buffer `job` at `k`; whether it was new (a job already there stays).
    pub(super) fn insert(&mut self, k: DueKey, job: StoredJob) -> bool {
        // Jobs mostly come in key order: the end first.
        let at = match self.0.back() {
            Some((last, _)) if *last < k => self.0.len(),
            None => 0,
            _ => match self.find(&k) {
                Ok(_) => return false,
                Err(i) => i,
            },
        };
        let len = self.0.len();
        if len == self.0.capacity() {
            self.0.reserve_exact(if len < EXACT_UP_TO { 1 } else { len });
        }
        self.0.insert(at, (k, job));
        true
    }

    /// Take the job at `k` out.
    pub(super) fn remove(&mut self, k: &DueKey) -> Option<StoredJob> {
        let i = self.find(k).ok()?;
        let (_, job) = self.0.remove(i)?;
        let (len, cap) = (self.0.len(), self.0.capacity());
        if cap > EXACT_UP_TO && len * 4 <= cap {
            self.0.shrink_to(len * 2);
        }
        Some(job)
    }
}

/// One lane's jobs in one partition.
#[derive(Debug, Default)]
pub(super) struct PartLane {
    pub(super) jobs: Buffer,
    /// Fair jobs of this lane at or after this key may be in the store and
    /// not here (`None`: every one up to the cursor is here or in flight).
    pub(super) missing_from: Option<DueKey>,
}

impl PartLane {
    pub(super) fn is_waiting(&self) -> bool {
        !self.jobs.is_empty() || self.missing_from.is_some()
    }

    /// The lane's next job, if it is known without reading the store (not
    /// when a job at or before it may be missing).
    pub(super) fn next(&self) -> Option<&DueKey> {
        let k = self.jobs.first_key()?;
        match &self.missing_from {
            Some(m) if m <= k => None,
            _ => Some(k),
        }
    }
}

/// One tenant's jobs of one class on one topic, per partition (a few,
/// looked up by scanning).
#[derive(Debug, Default)]
pub(super) struct Lane {
    parts: Vec<(i32, PartLane)>,
}

impl Lane {
    pub(super) fn is_waiting(&self) -> bool {
        self.parts.iter().any(|(_, pl)| pl.is_waiting())
    }

    /// Jobs buffered over its partitions.
    #[cfg(debug_assertions)]
    pub(super) fn buffered(&self) -> usize {
        self.parts.iter().map(|(_, pl)| pl.jobs.len()).sum()
    }

    /// The partitions the lane has jobs of.
    pub(super) fn partitions(&self) -> Vec<i32> {
        self.parts.iter().map(|(p, _)| *p).collect()
    }

    pub(super) fn part(&self, p: i32) -> Option<&PartLane> {
        self.parts.iter().find(|(q, _)| *q == p).map(|(_, pl)| pl)
    }

    pub(super) fn part_mut(&mut self, p: i32) -> Option<&mut PartLane> {
        self.parts.iter_mut().find(|(q, _)| *q == p).map(|(_, pl)| pl)
    }

    /// Partition `p`'s jobs, added when the lane has none of it yet.
    pub(super) fn part_or_default(&mut self, p: i32) -> &mut PartLane {
        let i = match self.parts.iter().position(|(q, _)| *q == p) {
            Some(i) => i,
            None => {
                self.parts.reserve_exact(1);
                self.parts.push((p, PartLane::default()));
                self.parts.len() - 1
            }
        };
        &mut self.parts[i].1
    }

    /// Forget partition `p`'s jobs.
    pub(super) fn remove_part(&mut self, p: i32) {
        self.parts.retain(|(q, _)| *q != p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Job;

    fn key(run_at_ms: i64, seq: u64) -> DueKey {
        DueKey {
            run_at_ms,
            partition: 0,
            seq,
        }
    }

    fn job(seq: u64) -> StoredJob {
        StoredJob {
            job: Job::new("t", "k", Vec::new()),
            seq,
        }
    }

    #[test]
    fn a_buffer_keeps_key_order_whatever_the_order_of_insertion() {
        let mut b = Buffer::default();
        for (run_at, seq) in [(5, 1), (1, 2), (9, 3), (5, 0), (1, 2)] {
            b.insert(key(run_at, seq), job(seq));
        }
        assert_eq!(b.len(), 4, "the second (1, 2) is not a new job");
        let mut order = Vec::new();
        while let Some(k) = b.first_key().copied() {
            assert!(b.contains(&k));
            assert_eq!(b.get(&k).map(|j| j.seq), Some(k.seq));
            b.remove(&k).expect("buffered");
            order.push((k.run_at_ms, k.seq));
        }
        assert_eq!(order, [(1, 2), (5, 0), (5, 1), (9, 3)]);
        assert!(b.remove(&key(1, 2)).is_none());
    }

    #[test]
    fn a_sparse_buffer_holds_one_slot_and_a_drained_one_gives_memory_back() {
        let mut b = Buffer::default();
        b.insert(key(1, 0), job(0));
        assert_eq!(b.0.capacity(), 1);
        for i in 1..64 {
            b.insert(key(1, i), job(i));
        }
        let full = b.0.capacity();
        assert!(full >= 64);
        for i in 0..60 {
            b.remove(&key(1, i)).expect("buffered");
        }
        assert!(b.0.capacity() < full / 4, "capacity {} of {full}", b.0.capacity());
    }

    #[test]
    fn a_lane_finds_adds_and_drops_its_partitions() {
        let mut l = Lane::default();
        assert!(!l.is_waiting());
        l.part_or_default(2).missing_from = Some(key(1, 0));
        l.part_or_default(0).jobs.insert(key(3, 0), job(0));
        assert_eq!(l.partitions(), [2, 0]);
        assert!(l.part(2).is_some_and(|pl| pl.next().is_none()));
        assert_eq!(l.part(0).and_then(PartLane::next), Some(&key(3, 0)));
        l.remove_part(2);
        assert!(l.part_mut(2).is_none());
        assert!(l.is_waiting());
        l.part_mut(0).expect("there").jobs.remove(&key(3, 0));
        assert!(!l.is_waiting());
    }
}
