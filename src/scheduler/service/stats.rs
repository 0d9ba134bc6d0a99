//! The scheduler's counters, and the snapshot of them it reports
//! ([`SchedulerStats`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::Shared;
use crate::hash::HashMap;

/// Counters, for status lines and tests.
#[derive(Default)]
pub(super) struct SchedulerCounters {
    pub(super) ingested: AtomicU64,
    pub(super) fired: AtomicU64,
    pub(super) fired_direct: AtomicU64,
    pub(super) cancelled: AtomicU64,
    pub(super) too_late: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
    pub(super) replayed: AtomicU64,
    /// Fire time (acknowledged) − run-at of each job fired.
    pub(super) fire_lateness: crate::admin::Histogram,
    /// How long each assignment's changelog catch-up took.
    pub(super) catch_up: crate::admin::Histogram,
    /// Partition assignments and revocations served.
    pub(super) assigned: AtomicU64,
    pub(super) revoked: AtomicU64,
    /// Per owned schedule partition, records not yet read (end − position),
    /// measured every few seconds by the ingest thread.
    pub(super) schedule_lag: Mutex<HashMap<i32, i64>>,
}

/// A snapshot of what the scheduler holds and has done.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SchedulerStats {
    /// Schedule partitions owned.
    pub owned: Vec<i32>,
    /// Jobs pending in owned partitions.
    pub pending: u64,
    /// Jobs held in memory (the window).
    pub in_memory: usize,
    /// Schedule records ingested since start.
    pub ingested: u64,
    /// Jobs fired since start.
    pub fired: u64,
    /// Of those, jobs already due on arrival, fired straight from memory.
    pub fired_direct: u64,
    /// Cancels applied since start.
    pub cancelled: u64,
    /// Cancels and reschedules that met their job being fired
    /// (too late: the job fires as it was) since start.
    pub too_late: u64,
    /// Records read again that had been handled before (their offsets were
    /// not committed when the previous owner stopped), skipped, since start.
    pub skipped: u64,
    /// Records dead-lettered since start.
    pub dead_lettered: u64,
    /// Changelog records read to rebuild partitions since start (a restart
    /// on its own store reads only what changed while it was away).
    pub replayed: u64,
    /// Occurrences of recurring schedules enqueued since start.
    pub occurrences: u64,
    /// Of those, occurrences enqueued after they were missed (their
    /// schedule's misfire policy let them run).
    pub occurrences_late: u64,
    /// Occurrences missed and dropped (misfire policy, catch-up window)
    /// since start.
    pub occurrences_dropped: u64,
    /// Recurring schedule definitions read that changed a schedule (new,
    /// changed, deleted or refused) since start.
    pub schedule_updates: u64,
    /// Backfill requests carried out since start.
    pub backfills: u64,
    /// Recurring schedules held (defined, in owned partitions).
    pub schedules: u64,
    /// Occurrences enqueued by backfills since start.
    pub occurrences_backfilled: u64,
}

/// What `shared` holds and has done now.
pub(super) fn stats(shared: &Shared) -> SchedulerStats {
    let (owned, in_memory) = shared.jobs.owned_and_in_memory();
    let pending = owned
        .iter()
        .map(|p| shared.store.checkpoint(*p).map(|c| c.pending).unwrap_or(0))
        .sum();
    SchedulerStats {
        owned,
        pending,
        in_memory,
        ingested: shared.stats.ingested.load(Ordering::Relaxed),
        fired: shared.stats.fired.load(Ordering::Relaxed),
        fired_direct: shared.stats.fired_direct.load(Ordering::Relaxed),
        cancelled: shared.stats.cancelled.load(Ordering::Relaxed),
        too_late: shared.stats.too_late.load(Ordering::Relaxed),
        skipped: shared.stats.skipped.load(Ordering::Relaxed),
        dead_lettered: shared.stats.dead_lettered.load(Ordering::Relaxed),
        replayed: shared.stats.replayed.load(Ordering::Relaxed),
        occurrences: shared.schedules.occurrences.load(Ordering::Relaxed),
        occurrences_late: shared.schedules.late.load(Ordering::Relaxed),
        occurrences_dropped: shared.schedules.dropped.load(Ordering::Relaxed),
        schedule_updates: shared.schedules.updates.load(Ordering::Relaxed),
        backfills: shared.schedules.backfills.load(Ordering::Relaxed),
        schedules: shared.schedules.held.load(Ordering::Relaxed),
        occurrences_backfilled: shared.schedules.backfilled.load(Ordering::Relaxed),
    }
}

/// What fair release waits on, per fair topic: the workers' backlog against
/// its target, the jobs released, and the tenants and jobs the fair window
/// holds. One snapshot for the status line, the metrics and the no-release
/// warning.
#[derive(Debug, Default)]
pub(super) struct FairStatus {
    /// Jobs released and not yet committed by the worker group (`None`: the
    /// group's progress was never read).
    pub(super) backlog: Vec<(String, i64)>,
    /// The backlog aimed at.
    pub(super) target: Vec<(String, i64)>,
    /// Jobs released in fair order since start.
    pub(super) released: Vec<(String, u64)>,
    /// Tenants with due jobs waiting.
    pub(super) tenants_waiting: Vec<(String, usize)>,
    /// Tenants held in memory (waiting, or served recently).
    pub(super) tenants_known: Vec<(String, usize)>,
    /// Fair jobs buffered in memory, over all fair topics.
    pub(super) buffered: usize,
}

impl FairStatus {
    /// `topic`'s entry of one of the per-topic lists.
    pub(super) fn of<T: Copy>(list: &[(String, T)], topic: &str) -> Option<T> {
        list.iter().find(|(t, _)| t == topic).map(|(_, v)| *v)
    }
}

/// The fair topics' status now (empty when there are none).
pub(super) fn fair_status(shared: &Shared) -> FairStatus {
    let fair = &shared.cfg.fair;
    if fair.topics.is_empty() {
        return FairStatus::default();
    }
    let (buffered, tenants_waiting, tenants_known) = shared.jobs.fair_counts().unwrap_or_default();
    FairStatus {
        backlog: shared.fair.backlog().current(),
        target: shared
            .fair
            .backlog()
            .targets(fair.backlog_target, fair.backlog_time),
        released: shared.fair.backlog().released_total(),
        tenants_waiting,
        tenants_known,
        buffered,
    }
}
