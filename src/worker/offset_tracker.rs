//! Which offset a partition may commit: the one below which every job is
//! finished.
//!
//! Jobs of a partition finish out of order (different keys run in
//! parallel), so the committed offset is the lowest offset still
//! unfinished, or one past the highest read when all are finished. A crash
//! then re-delivers exactly the unfinished jobs (and some finished ones
//! above the first unfinished one: those are the documented duplicates).

use std::collections::BTreeSet;

use crate::hash::HashMap;

/// Per-partition offset bookkeeping.
#[derive(Default)]
pub struct OffsetTracker {
    parts: HashMap<(usize, i32), PartitionOffsets>,
}

struct PartitionOffsets {
    /// Offsets read and not finished.
    open: BTreeSet<i64>,
    /// One past the highest offset read.
    next: i64,
    /// The commit point last reported, to report only advances.
    reported: i64,
}

impl PartitionOffsets {
    fn commit_point(&self) -> i64 {
        self.open.first().copied().unwrap_or(self.next)
    }
}

impl OffsetTracker {
    #[cfg(test)]
    /// An empty tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// A record at `offset` of `partition` was read and is not finished yet.
    pub fn read(&mut self, partition: (usize, i32), offset: i64) {
        let p = self.parts.entry(partition).or_insert_with(|| PartitionOffsets {
            open: BTreeSet::new(),
            next: offset,
            // Nothing below the first offset read is ours to commit.
            reported: offset,
        });
        p.open.insert(offset);
        p.next = p.next.max(offset + 1);
    }

    /// The record at `offset` is finished (done, retried, dead-lettered).
    /// Returns the new commit point if it advanced.
    pub fn finish(&mut self, partition: (usize, i32), offset: i64) -> Option<i64> {
        let p = self.parts.get_mut(&partition)?;
        p.open.remove(&offset);
        let c = p.commit_point();
        (c > p.reported).then(|| {
            p.reported = c;
            c
        })
    }

    /// The offset `partition` may commit now (`None` if nothing was read).
    pub fn commit_point(&self, partition: (usize, i32)) -> Option<i64> {
        self.parts.get(&partition).map(PartitionOffsets::commit_point)
    }

    /// Whether the record at `offset` of `partition` was read and is not
    /// finished.
    pub fn is_open(&self, partition: (usize, i32), offset: i64) -> bool {
        self.parts
            .get(&partition)
            .is_some_and(|p| p.open.contains(&offset))
    }

    /// `partition`'s commit point, the offset after the last record read,
    /// and the records between them not finished (ascending).
    pub fn progress(&self, partition: (usize, i32)) -> Option<(i64, i64, Vec<i64>)> {
        let p = self.parts.get(&partition)?;
        Some((p.commit_point(), p.next, p.open.iter().copied().collect()))
    }

    /// Forget `partition` (revoked).
    pub fn remove(&mut self, partition: (usize, i32)) {
        self.parts.remove(&partition);
    }

    /// Records read and not finished, over all partitions.
    pub fn open(&self) -> usize {
        self.parts.values().map(|p| p.open.len()).sum()
    }

    /// Records read at or above each partition's commit point, summed: what
    /// a crash now would deliver again at most.
    pub fn uncommitted(&self) -> u64 {
        self.parts
            .values()
            .map(|p| (p.next - p.commit_point()).max(0) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: (usize, i32) = (0, 0);

    #[test]
    fn commits_only_below_the_first_unfinished() {
        let mut t = OffsetTracker::new();
        for o in 10..15 {
            t.read(P, o);
        }
        assert_eq!(t.finish(P, 12), None, "10 and 11 are still open");
        assert_eq!(t.uncommitted(), 5, "10 to 14 would run again");
        assert_eq!(t.finish(P, 11), None);
        assert_eq!(t.finish(P, 10), Some(13));
        assert_eq!(t.finish(P, 14), None, "13 still open");
        assert_eq!(t.finish(P, 13), Some(15));
        assert_eq!(t.commit_point(P), Some(15));
        assert_eq!((t.open(), t.uncommitted()), (0, 0));
    }

    #[test]
    fn partitions_are_independent() {
        let mut t = OffsetTracker::new();
        t.read((0, 0), 0);
        t.read((0, 1), 0);
        assert_eq!(t.finish((0, 1), 0), Some(1));
        assert_eq!(t.commit_point((0, 0)), Some(0));
        t.remove((0, 0));
        assert_eq!(t.commit_point((0, 0)), None);
        assert_eq!(t.finish((0, 0), 0), None);
    }
}
