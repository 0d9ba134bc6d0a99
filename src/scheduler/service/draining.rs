//! Letting partitions go: which partitions this instance may still write
//! store state for ([`Owned`]), and the steps of a revocation
//! ([`Draining`]), each bounded by `scheduler.revocation_deadline`.
//!
//! A revoked partition leaves the window and the catch-up gate first (no
//! new fire starts), then the revocation waits for the fires in flight from
//! it and for the batches read from it to be applied, and only then lets
//! the partition go: from then on no store write of this instance touches
//! it. A fire or a batch that outlives the deadline still writes its
//! changelog records (the next owner reads them), but not the store: its
//! checkpoint would otherwise move past changelog records the next owner
//! writes meanwhile, and a later catch-up of this store would skip them.

use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Instant;

use rdkafka::consumer::{BaseConsumer, ConsumerContext};
use tracing::{info, warn};

use super::Shared;

use crate::hash::HashSet;
use crate::sync::ReadWrite;

/// The partitions this instance owns, for store writers: a writer holds
/// [`Owned::read`] across its store write and leaves out partitions not
/// in it; a revocation waits for writes under way.
#[derive(Default)]
pub(super) struct Owned(RwLock<HashSet<i32>>);

impl Owned {
    /// `parts` were assigned (before their catch-up).
    pub(super) fn assign(&self, parts: &[i32]) {
        self.0.writing().extend(parts);
    }

    /// `parts` are let go; returns once no store write holds them.
    fn revoke(&self, parts: &[i32]) {
        let mut owned = self.0.writing();
        for p in parts {
            owned.remove(p);
        }
    }

    /// The owned partitions, held for the length of a store write.
    pub(super) fn read(&self) -> RwLockReadGuard<'_, HashSet<i32>> {
        self.0.reading()
    }
}

/// Partitions being revoked, and until when the revocation waits.
pub(super) struct Draining {
    shared: Arc<Shared>,
    parts: Vec<i32>,
    deadline: Instant,
}

impl Draining {
    /// Let `parts` go now, counted as a revocation: [`Draining::start`]
    /// then [`Draining::finish`] (a rebalance's revocation, or a consumer
    /// fenced out of its group).
    pub(super) fn revoke<C: ConsumerContext>(
        shared: &Arc<Shared>,
        parts: Vec<i32>,
        consumer: &BaseConsumer<C>,
    ) {
        shared
            .stats
            .revoked
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Draining::start(shared, parts).finish(consumer);
    }

    /// Stop firing from `parts`: they leave the window (their jobs in
    /// memory are dropped) and the catch-up gate.
    pub(super) fn start(shared: &Arc<Shared>, parts: Vec<i32>) -> Draining {
        shared.jobs.revoke(&parts);
        {
            let mut gate = shared.reads.caught_up();
            for p in &parts {
                gate.revoke(*p);
            }
        }
        Draining {
            deadline: Instant::now() + shared.cfg.scheduler.revocation_deadline,
            shared: shared.clone(),
            parts,
        }
    }

    /// Wait for the fires in flight from the partitions, then for the
    /// batches read to be applied (their offsets may then be committed);
    /// let the partitions go; store and commit their offsets. Whatever
    /// outlived the deadline is logged; its records are read again by the
    /// next owner.
    pub(super) fn finish<C: ConsumerContext>(self, consumer: &BaseConsumer<C>) {
        let (shared, parts) = (&self.shared, &self.parts);
        if !shared.jobs.wait_idle(parts, self.deadline) {
            warn!(partitions = ?parts, "fires still in flight at the revocation deadline; the next owner may fire their jobs again");
        }
        if !shared.reads.lanes.wait_idle(self.deadline) {
            warn!(partitions = ?parts, "batches read still being applied at the deadline; their records will be read again");
        }
        shared.reads.owned.revoke(parts);
        // Direct jobs fired meanwhile release their offsets; those never
        // fired are re-read by the next owner.
        shared.store_offsets(consumer);
        shared.jobs.let_go(parts);
        if let Some(t) = &shared.kafka.txn {
            t.revoked(parts);
        }
        shared.commit_stored(consumer, "on revocation");
        info!(partitions = ?parts, "schedule partitions released");
    }
}
