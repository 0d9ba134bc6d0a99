//! The window's direct jobs (see `scheduler/service/direct.rs`): due jobs
//! that are not in the store, entered where the window mirrors their
//! partition, at most half the capacity of them, never dropped to make
//! room; their places reserved from their pick until they enter; taken
//! out when a change names them or when they are handed to the store.

use std::collections::BTreeSet;

use super::TimerWheel;

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::store::DueKey;
use crate::scheduler::stored::StoredJob;

impl TimerWheel {
    /// Whether a direct job at `k` may enter: its partition is mirrored up
    /// to `k` and direct jobs (with the places reserved) fill less than half
    /// the capacity.
    pub fn may_add_direct(&self, k: &DueKey) -> bool {
        self.mirrors(k) && self.direct.len() + self.reserved_len < self.capacity / 2
    }

    /// Reserve the place of a direct job at `k`, if
    /// [`TimerWheel::may_add_direct`] allows it: until it is added
    /// ([`TimerWheel::add_direct`]) or let go ([`TimerWheel::unreserve`]),
    /// its partition stays mirrored up to `k` (only letting the partition go
    /// or taking it again drops the reservation).
    pub fn reserve_direct(&mut self, k: DueKey) -> bool {
        if !self.may_add_direct(&k) {
            return false;
        }
        if self.reserved.entry(k.partition).or_default().insert(k) {
            self.reserved_len += 1;
        }
        true
    }

    /// Let go of the place reserved at `k`; whether there was one.
    pub fn unreserve(&mut self, k: &DueKey) -> bool {
        let Some(set) = self.reserved.get_mut(&k.partition) else {
            return false;
        };
        let had = set.remove(k);
        if had {
            self.reserved_len -= 1;
        }
        if set.is_empty() {
            self.reserved.remove(&k.partition);
        }
        had
    }

    /// Direct jobs' places reserved and not yet taken.
    pub fn reserved_len(&self) -> usize {
        self.reserved_len
    }

    pub(super) fn forget_reserved(&mut self, partition: i32) {
        if let Some(set) = self.reserved.remove(&partition) {
            self.reserved_len -= set.len();
        }
    }

    /// Whether dropping `k` would pull its partition's horizon back before
    /// a reserved place.
    pub(super) fn pinned(&self, k: &DueKey) -> bool {
        !self.reserved.is_empty()
            && self
                .reserved
                .get(&k.partition)
                .and_then(BTreeSet::last)
                .is_some_and(|pin| pin >= k)
    }

    /// Add a direct job at `now_ms`: one whose place is reserved, or else
    /// one [`TimerWheel::may_add_direct`] allows; a job refused (its
    /// partition let go or taken again since the reservation) comes back.
    #[must_use = "a refused job must go the durable way"]
    pub fn add_direct(&mut self, k: DueKey, job: StoredJob, now_ms: i64) -> Option<StoredJob> {
        if !self.unreserve(&k) && !self.may_add_direct(&k) {
            return Some(job);
        }
        self.direct_ids.insert((k.partition, job.job.stored_id()), k);
        self.entries.insert(k, job);
        self.direct.insert(k, now_ms);
        self.shrink();
        None
    }

    /// The direct jobs of the `partitions` chosen in the window since before
    /// `before_ms` (not taken for firing), copied; their partitions are held
    /// (no job of theirs is taken) until [`TimerWheel::persisted`]: they are
    /// about to be persisted, so they stop holding their partition's commit.
    pub fn persist_direct_older(
        &mut self,
        before_ms: i64,
        partitions: impl Fn(i32) -> bool,
    ) -> Vec<(DueKey, StoredJob)> {
        let mut out: Vec<(DueKey, StoredJob)> = self
            .direct
            .iter()
            .filter(|(k, since)| **since < before_ms && partitions(k.partition))
            .filter_map(|(k, _)| self.entries.get(k).map(|j| (*k, j.clone())))
            .collect();
        out.sort_unstable_by_key(|(k, _)| *k);
        self.persisting.extend(out.iter().map(|(k, _)| k.partition));
        out
    }

    /// The jobs of [`TimerWheel::persist_direct_older`] are persisted:
    /// they are stored jobs now, and their partitions fire again.
    pub fn persisted(&mut self, jobs: &[(DueKey, StoredJob)]) {
        for (k, j) in jobs {
            self.direct.remove(k);
            self.direct_ids.remove(&(k.partition, j.job.stored_id()));
            self.persisting.remove(&k.partition);
        }
    }

    /// Take the direct job `id` of `partition` out of the window (a change
    /// replaces or cancels it), if it is there.
    pub fn take_direct_job(&mut self, partition: i32, id: &JobId) -> Option<(DueKey, StoredJob)> {
        if self.direct_ids.is_empty() {
            return None;
        }
        let k = self.direct_ids.remove(&(partition, *id))?;
        self.direct.remove(&k);
        self.entries.remove(&k).map(|j| (k, j))
    }

    /// Which of `due` (just taken) are direct jobs, with when each entered;
    /// they stop counting as direct entries until put back.
    pub fn take_direct(&mut self, due: &[(DueKey, StoredJob)]) -> HashMap<DueKey, i64> {
        if self.direct.is_empty() {
            return HashMap::default();
        }
        let mut taken = HashMap::with_capacity_and_hasher(due.len(), Default::default());
        for (k, j) in due {
            if let Some(since) = self.direct.remove(k) {
                self.direct_ids.remove(&(k.partition, j.job.stored_id()));
                taken.insert(*k, since);
            }
        }
        taken
    }

    /// Direct jobs in memory.
    pub fn direct_len(&self) -> usize {
        self.direct.len()
    }
}
