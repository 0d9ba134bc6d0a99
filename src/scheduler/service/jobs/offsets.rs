//! The schedule offsets' side of [`SchedulerJobs`]: how far each
//! partition may be committed while direct jobs (held by nothing but their
//! schedule records) are in flight. Each transition takes the `direct`
//! lock alone.

use tracing::debug;

use super::super::batch::PartitionBatch;
use super::super::direct::DirectOffsets;
use super::SchedulerJobs;

use crate::hash::HashMap;
use crate::scheduler::store::{Change, DueKey};
use crate::scheduler::stored::StoredJob;

impl SchedulerJobs {
    /// Set each partition's first offset not handled once its batch is
    /// persisted: direct jobs in flight (those of the batch too) hold it back.
    pub(in crate::scheduler::service) fn frontier(&self, parts: &mut HashMap<i32, PartitionBatch>) {
        let held = &*self.direct();
        for (p, pb) in parts.iter_mut() {
            if !pb.changes.is_empty() {
                // A partition with no entry yet (just assigned) still has this
                // batch's direct jobs to hold the frontier back.
                let holding = pb.direct.iter().map(|s| s.seq as i64);
                let first =
                    DirectOffsets::first_unhandled_of(held.get(p), pb.last_offset, holding, &pb.released());
                debug!(
                    partition = *p,
                    schedule_next = first,
                    last_offset = pb.last_offset,
                    "schedule frontier"
                );
                pb.schedule_next = Some(first);
            }
        }
    }

    /// The batch is persisted (and its `fallback` jobs): its offsets may be
    /// committed, up to the direct jobs still in flight.
    pub(in crate::scheduler::service) fn settle(
        &self,
        parts: &HashMap<i32, PartitionBatch>,
        fallback: &HashMap<i32, PartitionBatch>,
    ) {
        let direct = &mut *self.direct();
        for (p, pb) in parts {
            let d = direct.entry(*p).or_default();
            for c in fallback.get(p).map(|f| &f.changes[..]).unwrap_or(&[]) {
                if let Change::Put(s) = c {
                    d.release(s.seq as i64);
                }
            }
            for offset in pb.released() {
                d.release(offset);
            }
            d.ingested(pb.last_offset);
        }
    }

    /// Take the direct jobs out of `done` (fired or dead-lettered): nothing
    /// is stored for them, and their schedule offsets may now be committed.
    /// Returns how many there were.
    pub(in crate::scheduler::service) fn release_direct(
        &self,
        done: &mut Vec<&(DueKey, StoredJob)>,
        direct: &HashMap<DueKey, i64>,
    ) -> u64 {
        if direct.is_empty() {
            return 0;
        }
        let offsets = &mut *self.direct();
        let before = done.len();
        done.retain(|(k, _)| {
            if !direct.contains_key(k) {
                return true;
            }
            if let Some(d) = offsets.get_mut(&k.partition) {
                d.release(k.seq as i64);
            }
            false
        });
        (before - done.len()) as u64
    }

    /// Exactly once: per partition of the direct jobs `round` (one fire
    /// round's), the first offset not handled once they are fired. Those
    /// below it fire in one transaction with a record of it, so a new owner
    /// never reads them again; those above it wait for the direct jobs
    /// below them (a later round).
    pub(in crate::scheduler::service) fn frontier_if_fired<'a>(
        &self,
        round: impl IntoIterator<Item = &'a DueKey>,
    ) -> HashMap<i32, i64> {
        let mut by_part: HashMap<i32, Vec<i64>> = HashMap::default();
        for k in round {
            by_part.entry(k.partition).or_default().push(k.seq as i64);
        }
        let direct = &*self.direct();
        by_part
            .into_iter()
            .filter_map(|(p, mut offsets)| {
                offsets.sort_unstable();
                Some((p, direct.get(&p)?.first_unhandled_releasing(&offsets)))
            })
            .collect()
    }

    /// The first schedule offset of `p` not handled, with the direct jobs
    /// fired so far (`None`: nothing ingested from `p` here).
    pub(in crate::scheduler::service) fn frontier_after_fires(&self, p: i32) -> Option<i64> {
        let next = self.direct().get(&p)?.safe() + 1;
        debug!(
            partition = p,
            schedule_next = next,
            "schedule frontier after fires"
        );
        Some(next)
    }

    /// `parts` are let go: their direct offsets are forgotten (the next
    /// owner reads the records of direct jobs not fired again).
    pub(in crate::scheduler::service) fn let_go(&self, parts: &[i32]) {
        let direct = &mut *self.direct();
        for p in parts {
            direct.remove(p);
        }
    }

    /// Per partition, the last offset that may be committed, where it moved
    /// since the last call.
    pub(in crate::scheduler::service) fn offsets_to_store(&self) -> Vec<(i32, i64)> {
        let direct = &mut *self.direct();
        direct
            .iter_mut()
            .filter_map(|(p, d)| d.offset_to_store().map(|o| (*p, o)))
            .collect()
    }

    /// Direct jobs whose offsets are still held.
    pub(in crate::scheduler::service) fn direct_in_flight(&self) -> usize {
        self.direct().values().map(DirectOffsets::in_flight).sum()
    }
}
