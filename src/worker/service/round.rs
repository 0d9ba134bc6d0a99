//! What one commit writes: commit points, and in exactly-once mode the
//! writes that go in the same transaction.

use super::Tp;

use crate::wire::OwnedRecord;

/// A commit point to store or commit: partition, offset, and the claim the
/// commit carries (holdable partitions only).
pub(super) type CommitPoint = (Tp, i64, Option<u64>);

/// What one commit writes: the commit points that moved and, in
/// exactly-once mode, the staged writes of the jobs it commits, in offset
/// order per partition, with the held-topic records of partitions whose
/// keys can be held.
#[derive(Default)]
pub(super) struct Round {
    pub(super) points: Vec<CommitPoint>,
    pub(super) records: Vec<(Tp, i64, Vec<OwnedRecord>)>,
    /// Held-topic records (holds changed, progress), each with the number
    /// of the work partition it belongs to.
    pub(super) pinned: Vec<(i32, OwnedRecord)>,
    /// The held keys whose holds `pinned` writes: changed again, for the
    /// next round, if this one does not commit.
    pub(super) dirty: Vec<(Tp, Vec<u8>)>,
}

impl Round {
    /// Records to write.
    pub(super) fn record_count(&self) -> usize {
        self.records.iter().map(|(.., r)| r.len()).sum::<usize>() + self.pinned.len()
    }

    /// Nothing to commit.
    pub(super) fn is_empty(&self) -> bool {
        self.points.is_empty()
    }
}
