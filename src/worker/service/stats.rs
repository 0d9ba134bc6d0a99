//! The worker's counters, and the snapshot a handle reads.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Shared;

/// Counters of what the worker did.
#[derive(Default)]
pub(super) struct WorkerCounters {
    pub(super) started: AtomicU64,
    pub(super) succeeded: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    /// Jobs written again, same attempt, due later (rate limited, paced).
    pub(super) deferred: AtomicU64,
    pub(super) panicked: AtomicU64,
    pub(super) handed_to_scheduler: AtomicU64,
    /// First attempts skipped because a job of their key was busy.
    pub(super) skipped: AtomicU64,
    /// Jobs parked behind a held key (written to the scheduler).
    pub(super) parked: AtomicU64,
    /// Keys not held because `max_held_keys` were.
    pub(super) hold_overflow: AtomicU64,
    /// Keys released by an operator.
    pub(super) released: AtomicU64,
    /// Held-topic records read back that did not decode.
    pub(super) holds_unreadable: AtomicU64,
    /// Start − run-at of each handler run.
    pub(super) start_delay: crate::admin::Histogram,
    /// How long each handler run took.
    pub(super) duration: crate::admin::Histogram,
    /// Per work topic (as `Topics::names`): runs started and how they settled.
    pub(super) by_topic: Vec<TopicCounts>,
    /// Partition assignments and revocations served.
    pub(super) assigned: AtomicU64,
    pub(super) revoked: AtomicU64,
    /// Exactly-once mode: transactions committed and aborted.
    pub(super) transactions: AtomicU64,
    pub(super) transactions_aborted: AtomicU64,
    /// Exactly-once mode: jobs whose writes Kafka refused for good,
    /// dead-lettered instead.
    pub(super) refused: AtomicU64,
}

/// One work topic's counters.
#[derive(Default)]
pub(super) struct TopicCounts {
    pub(super) started: AtomicU64,
    pub(super) succeeded: AtomicU64,
    pub(super) retried: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) deferred: AtomicU64,
    /// Runs that ended without settling (their partition was let go).
    pub(super) unsettled: AtomicU64,
}

/// A snapshot of the worker's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WorkerStats {
    /// Handler runs started.
    pub started: u64,
    /// Jobs done.
    pub succeeded: u64,
    /// Jobs sent back through the scheduler for another attempt.
    pub retried: u64,
    /// Records and jobs dead-lettered.
    pub dead_lettered: u64,
    /// Handler runs that panicked (each counted as a failed attempt).
    pub panicked: u64,
    /// Jobs read before their run-at and handed to the scheduler.
    pub handed_to_scheduler: u64,
    /// Jobs not run because a job of their key was running or waiting when
    /// they were read (`kairos-if-busy: skip`).
    pub skipped: u64,
    /// Jobs written again with the same attempt, due later (rate limited,
    /// or paced further ahead than the worker waits in memory).
    pub deferred: u64,
    /// Jobs parked behind a held key.
    pub parked: u64,
    /// Held-topic records read back on assignment that did not decode (each
    /// logged as an error with its key: that key's order is not known).
    pub holds_unreadable: u64,
    /// Keys held now.
    pub held_keys: usize,
    /// Partitions owned now.
    pub owned: usize,
    /// Jobs buffered or running now.
    pub open: usize,
    /// No job starts now: partitions are owned and the group coordinator
    /// has not taken a commit of this worker for half its session timeout
    /// (the partitions may have moved without it knowing).
    pub out_of_touch: bool,
    /// Exactly-once mode: transactions committed (each a commit round:
    /// the writes of the jobs it finished and the offsets past them).
    pub transactions: u64,
    /// Exactly-once mode: transactions aborted (their jobs' writes go into
    /// the next one).
    pub transactions_aborted: u64,
    /// Exactly-once mode: jobs whose writes Kafka refused for good (too
    /// large for their topic, not authorised, ...), dead-lettered instead
    /// (also counted in `dead_lettered`).
    pub refused: u64,
}

/// Reads a running worker's counters.
#[derive(Clone)]
pub struct WorkerHandle {
    pub(super) shared: Arc<Shared>,
}

impl WorkerHandle {
    /// The worker's counters now.
    pub fn stats(&self) -> WorkerStats {
        stats(&self.shared)
    }
}

pub(super) fn stats(shared: &Shared) -> WorkerStats {
    let s = &shared.stats;
    let st = shared.jobs.lock();
    WorkerStats {
        started: s.started.load(Ordering::Relaxed),
        succeeded: s.succeeded.load(Ordering::Relaxed),
        retried: s.retried.load(Ordering::Relaxed),
        dead_lettered: s.dead_lettered.load(Ordering::Relaxed),
        panicked: s.panicked.load(Ordering::Relaxed),
        handed_to_scheduler: s.handed_to_scheduler.load(Ordering::Relaxed),
        skipped: s.skipped.load(Ordering::Relaxed),
        deferred: s.deferred.load(Ordering::Relaxed),
        parked: s.parked.load(Ordering::Relaxed),
        holds_unreadable: s.holds_unreadable.load(Ordering::Relaxed),
        held_keys: st.holds.len(),
        owned: st.owned.len(),
        open: st.tracker.open(),
        out_of_touch: !st.owned.is_empty() && shared.out_of_touch(&st),
        transactions: s.transactions.load(Ordering::Relaxed),
        transactions_aborted: s.transactions_aborted.load(Ordering::Relaxed),
        refused: s.refused.load(Ordering::Relaxed),
    }
}
