//! The running scheduler: ingest, dispatch and partition moves.
//!
//! - **Ingest** (`ingest`) reads on its own thread with a blocking
//!   consumer, so that the rebalance callbacks can do their work (drain
//!   firing, rebuild from the changelog) before a partition is released or
//!   consumed, and applies on a second one: for each batch of schedule
//!   records it writes the changelog, applies the changes to the store,
//!   flushes, and only then lets the offsets be committed.
//! - **Probes** (a thread): the end offsets of schedule partitions whose due
//!   jobs wait to have their partition read up to their run-at.
//! - **Dispatch** is a task that sleeps until the earliest job in the
//!   window is due (or a newly ingested job is due sooner, or the window
//!   needs a refill, or a partition has been read further), fires due jobs
//!   into their work topics, then tombstones and deletes them.
//! - **Revocation**: a revoked partition leaves the window first, then the
//!   callback waits for any fire in flight from it and for the batches read
//!   from it to be applied, commits, and lets go. **Assignment**: the store
//!   catches up with the partition's changelog from its checkpoint before
//!   the partition enters the window or a record of it is ingested.

mod ingest;

use crate::hash::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::clock::SharedClock;
use crate::config::Config;
use crate::kafka;
use crate::scheduler::caught_up::CaughtUp;
use crate::scheduler::changelog;
use crate::scheduler::direct::DirectOffsets;
use crate::scheduler::store::{Change, DueKey, PartitionWrite, Store, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::scheduler::timer_wheel::{Due, TimerWheel};
use crate::wire::{self, DeadLetter, OwnedRecord};

/// Why the scheduler stopped.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerError {
    /// The store failed; the scheduler stops rather than acknowledge a job
    /// it could not keep.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A Kafka client could not be created or subscribed.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// A partition could not be rebuilt from its changelog.
    #[error(transparent)]
    Rebuild(#[from] changelog::RebuildError),
    /// The instance's stable id could not be read or kept.
    #[error(transparent)]
    InstanceId(#[from] super::instance::InstanceIdError),
    /// The ingest thread ended abnormally.
    #[error("scheduler stopped: {0}")]
    Fatal(String),
}

/// Counters, for status lines and tests.
#[derive(Default)]
struct Stats {
    ingested: AtomicU64,
    fired: AtomicU64,
    fired_direct: AtomicU64,
    cancelled: AtomicU64,
    too_late: AtomicU64,
    skipped: AtomicU64,
    dead_lettered: AtomicU64,
    replayed: AtomicU64,
}

/// A snapshot of what the scheduler is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
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
}

/// State shared by ingest, dispatch and the rebalance callbacks.
struct Shared {
    /// Topics, limits and scheduler settings.
    cfg: Config,
    /// `group.instance.id` (static membership), or `None`.
    instance_id: Option<String>,
    /// Pending jobs on disk.
    store: Store,
    /// The near future in memory; also the set of owned partitions.
    wheel: Mutex<TimerWheel>,
    /// Wakes the dispatcher: a job due sooner, a new partition, shutdown.
    wake: Notify,
    /// Fire batches in flight per partition; revocation waits for them.
    firing: Mutex<HashMap<i32, usize>>,
    /// Signalled when `firing` shrinks.
    firing_done: Condvar,
    /// Per schedule partition: how far it may be committed, with the jobs
    /// fired straight from memory still in flight.
    direct: Mutex<HashMap<i32, DirectOffsets>>,
    /// Writes fired jobs, changelog records and dead letters.
    producer: FutureProducer,
    /// Decides what is due.
    clock: SharedClock,
    /// Cancelled on shutdown or on a fatal error.
    stop: CancellationToken,
    /// The first fatal error, reported by `run`.
    fatal: Mutex<Option<String>>,
    /// Connection settings for changelog readers.
    reader_config: ClientConfig,
    /// Whether a job's work topic exists (a job for a missing one is dead-lettered).
    topic_check: kafka::TopicCheck,
    /// How far each owned schedule partition has been read, in time: jobs
    /// fire only up to it.
    caught_up: Mutex<CaughtUp>,
    /// Asks the probe thread to look up partition ends.
    probe: SyncSender<()>,
    /// The probe thread's end of `probe`, taken by `run`.
    probe_inbox: Mutex<Option<Receiver<()>>>,
    /// Batches of schedule records read and not yet applied.
    applying: ingest::Applying,
    /// Fire due jobs without waiting for their partition to be read up to
    /// their run-at (benchmarks measure the rule's cost against this).
    fire_unread: std::sync::atomic::AtomicBool,
    stats: Stats,
}

impl Shared {
    fn fail(&self, what: String) {
        error!(error = %what, "scheduler stopping");
        self.fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(what);
        self.stop.cancel();
        self.wake.notify_one();
    }

    fn wheel(&self) -> std::sync::MutexGuard<'_, TimerWheel> {
        self.wheel.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn direct(&self) -> std::sync::MutexGuard<'_, HashMap<i32, DirectOffsets>> {
        self.direct.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn caught_up(&self) -> std::sync::MutexGuard<'_, CaughtUp> {
        self.caught_up.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hand the consumer every partition's committable offset that moved.
    fn store_offsets(&self, consumer: &BaseConsumer<Ctx>) {
        for (p, d) in self.direct().iter_mut() {
            if let Some(offset) = d.to_store() {
                // librdkafka commits one past the stored offset.
                if let Err(e) = consumer.store_offset(&self.cfg.topics.schedule, *p, offset) {
                    // The partition was revoked meanwhile: its next owner
                    // re-reads these records and applies them again
                    // (idempotent by job id).
                    debug!(partition = p, error = %e, "offset not stored");
                }
            }
        }
    }
}

/// The scheduler service.
pub struct Scheduler {
    shared: Arc<Shared>,
}

impl Scheduler {
    /// Open the store and create the Kafka clients.
    pub fn new(cfg: &Config, clock: SharedClock) -> Result<Self, SchedulerError> {
        let s = &cfg.scheduler;
        std::fs::create_dir_all(&s.data_dir).map_err(|e| StoreError::Sled(e.into()))?;
        let store = Store::open(&s.data_dir, s.cache_capacity)?;
        // After the store: its lock keeps a second process off this directory.
        let instance_id = super::instance::group_instance_id(cfg)?;
        let producer = kafka::producer(&cfg.kafka, "kairos-scheduler")?;
        let wheel = TimerWheel::new(s.window.as_millis() as i64, s.window_capacity);
        let (probe, probe_inbox) = std::sync::mpsc::sync_channel(1);
        Ok(Scheduler {
            shared: Arc::new(Shared {
                cfg: cfg.clone(),
                instance_id,
                store,
                wheel: Mutex::new(wheel),
                wake: Notify::new(),
                firing: Mutex::new(HashMap::default()),
                firing_done: Condvar::new(),
                direct: Mutex::new(HashMap::default()),
                producer,
                clock,
                stop: CancellationToken::new(),
                fatal: Mutex::new(None),
                reader_config: kafka::base_config(&cfg.kafka, "kairos-changelog-reader"),
                topic_check: kafka::TopicCheck::new(&cfg.kafka)?,
                caught_up: Mutex::new(CaughtUp::new(s.max_clock_skew.as_millis() as i64)),
                probe,
                probe_inbox: Mutex::new(Some(probe_inbox)),
                fire_unread: std::sync::atomic::AtomicBool::new(false),
                applying: ingest::Applying::default(),
                stats: Stats::default(),
            }),
        })
    }

    /// What the scheduler holds and has done.
    pub fn status(&self) -> Status {
        status(&self.shared)
    }

    /// Wake the dispatcher to look at the clock again (tests that drive a
    /// manual clock call this after moving it).
    pub fn wake(&self) {
        self.shared.wake.notify_one();
    }

    /// Fire due jobs as soon as they are due, without first reading their
    /// schedule partition up to their run-at: a cancel written before the
    /// run-at but not yet read then loses. Not for production; benchmarks
    /// measure what the rule costs against it.
    #[doc(hidden)]
    pub fn fire_unread(self) -> Self {
        self.shared.fire_unread.store(true, Ordering::Relaxed);
        self
    }

    /// A handle for reading status and waking the dispatcher while `run` goes on.
    pub fn handle(&self) -> SchedulerHandle {
        SchedulerHandle {
            shared: self.shared.clone(),
        }
    }

    /// Run until `shutdown` completes (or a fatal error): consume, persist,
    /// fire. On shutdown, the fire in flight finishes, stored offsets are
    /// committed and the group is left, so partitions move at once.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), SchedulerError> {
        let shared = self.shared;
        let ingest_shared = shared.clone();
        let ingest = std::thread::Builder::new()
            .name("kairos-ingest".into())
            .spawn(move || {
                if let Err(e) = ingest::ingest_loop(&ingest_shared) {
                    ingest_shared.fail(e.to_string());
                }
            })
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        let inbox = shared
            .probe_inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| SchedulerError::Fatal("scheduler already ran".into()))?;
        let probe_shared = shared.clone();
        let prober = std::thread::Builder::new()
            .name("kairos-probe".into())
            .spawn(move || probe_loop(&probe_shared, inbox))
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        let stop = shared.stop.clone();
        let warm = shared.clone();
        // The topics the producer writes: the changelog, the dead-letter
        // topic and the configured work topics, looked up once (the answer is
        // cached for the first fires) and, where they exist, the producer
        // warmed, so the first writes after a start do not wait for metadata.
        tokio::spawn(async move {
            let t = &warm.cfg.topics;
            let topics = [&t.changelog, &t.dead_letter].into_iter().chain(&t.work);
            for t in topics {
                if warm.stop.is_cancelled() {
                    break;
                }
                if let Ok(true) = warm.topic_check.exists(t).await {
                    kafka::warm_up(&warm.producer, t, warm.cfg.kafka.produce_timeout).await;
                }
            }
        });
        let cascader = tokio::spawn(cascade_loop(shared.clone()));
        let dispatcher = dispatch_loop(shared.clone());
        tokio::pin!(dispatcher);
        tokio::pin!(shutdown);
        tokio::select! {
            _ = &mut shutdown => {
                info!("shutdown requested");
                stop.cancel();
                shared.wake.notify_one();
                dispatcher.await;
            }
            _ = &mut dispatcher => {}
        }
        stop.cancel();
        let _ = cascader.await;
        tokio::task::spawn_blocking(move || ingest.join())
            .await
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?
            .map_err(|_| SchedulerError::Fatal("ingest thread panicked".into()))?;
        tokio::task::spawn_blocking(move || prober.join())
            .await
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?
            .map_err(|_| SchedulerError::Fatal("probe thread panicked".into()))?;
        if let Some(e) = shared.fatal.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(SchedulerError::Fatal(e));
        }
        info!(status = ?status(&shared), "scheduler stopped");
        Ok(())
    }
}

/// A cheap handle to a running scheduler.
#[derive(Clone)]
pub struct SchedulerHandle {
    shared: Arc<Shared>,
}

impl SchedulerHandle {
    /// What the scheduler holds and has done.
    pub fn status(&self) -> Status {
        status(&self.shared)
    }

    /// Wake the dispatcher to look at the clock again.
    pub fn wake(&self) {
        self.shared.wake.notify_one();
    }
}

fn status(shared: &Shared) -> Status {
    let (owned, in_memory) = {
        let w = shared.wheel();
        (w.partitions(), w.len())
    };
    let pending = owned
        .iter()
        .map(|p| shared.store.checkpoint(*p).map(|c| c.pending).unwrap_or(0))
        .sum();
    Status {
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
    }
}

// ---------------------------------------------------------------- ingest

/// The consumer context: the rebalance callbacks.
struct Ctx {
    shared: Arc<Shared>,
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        kafka::log_commit("scheduler", &result, offsets);
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else { return };
        let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        {
            let mut w = self.shared.wheel();
            for p in &parts {
                w.remove_partition(*p);
            }
        }
        {
            let mut gate = self.shared.caught_up();
            for p in &parts {
                gate.revoke(*p);
            }
        }
        // Wait for a fire in flight from these partitions to finish.
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut firing = self.shared.firing.lock().unwrap_or_else(|e| e.into_inner());
        while parts.iter().any(|p| firing.contains_key(p)) && Instant::now() < deadline {
            firing = self
                .shared
                .firing_done
                .wait_timeout(firing, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(firing);
        // The batches read from these partitions are applied (their offsets
        // may then be committed).
        if !self.shared.applying.wait_idle(deadline) {
            warn!(partitions = ?parts, "batches read still being applied at the deadline; their records will be read again");
        }
        // Direct jobs fired meanwhile release their offsets; those never
        // fired are re-read by the next owner.
        self.shared.store_offsets(consumer);
        {
            let mut direct = self.shared.direct();
            for p in &parts {
                direct.remove(p);
            }
        }
        match consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => warn!(error = %e, "commit on revocation failed"),
        }
        info!(partitions = ?parts, "schedule partitions released");
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                let started = Instant::now();
                // Place the cascade points before the rebuild, so that the
                // replayed jobs land at their final level at once.
                for p in &parts {
                    if let Err(e) = self.shared.store.cascade(*p, cascade_until(&self.shared)) {
                        self.shared.fail(format!("preparing partition {p}: {e}"));
                        return;
                    }
                }
                let read = match changelog::catch_up(
                    &self.shared.reader_config,
                    &self.shared.cfg.topics.changelog,
                    &parts,
                    &self.shared.store,
                    self.shared.cfg.scheduler.rebuild_timeout,
                ) {
                    Ok(read) => read,
                    Err(e) => {
                        self.shared.fail(format!("rebuilding partitions {parts:?}: {e}"));
                        return;
                    }
                };
                info!(partitions = ?parts, elapsed = ?started.elapsed(), "schedule partitions caught up");
                let starts = match reading_from(&self.shared, consumer, &parts) {
                    Ok(starts) => starts,
                    Err(e) => {
                        self.shared
                            .fail(format!("reading committed offsets of {parts:?}: {e}"));
                        return;
                    }
                };
                for (p, (next, skip_below)) in parts.iter().zip(starts) {
                    // Jobs fire only once the partition is read up to their run-at.
                    self.shared.caught_up().assign(*p, next, skip_below);
                    let records = read.get(p).copied().unwrap_or(0);
                    self.shared.stats.replayed.fetch_add(records, Ordering::Relaxed);
                    let pending = self.shared.store.checkpoint(*p).map(|c| c.pending).unwrap_or(0);
                    info!(
                        partition = p,
                        changelog_records = records,
                        pending,
                        "schedule partition assigned"
                    );
                    self.shared.wheel().add_partition(*p);
                }
                self.shared.wake.notify_one();
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

/// For each of `parts` (just assigned), where ingest starts reading and
/// below which records were handled before: the committed offset (or where
/// `auto.offset.reset` starts, when none is) and the store's checkpoint,
/// whichever is further.
fn reading_from(
    shared: &Shared,
    consumer: &BaseConsumer<Ctx>,
    parts: &[i32],
) -> Result<Vec<(i64, i64)>, SchedulerError> {
    let topic = &shared.cfg.topics.schedule;
    let timeout = shared.cfg.kafka.produce_timeout;
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    // Kairos's default is "earliest"; a user may choose the end.
    let resets_to_end = shared
        .cfg
        .kafka
        .consumer
        .get("auto.offset.reset")
        .is_some_and(|v| matches!(v.0.as_str(), "latest" | "end" | "largest"));
    parts
        .iter()
        .map(|p| {
            let handled = shared.store.checkpoint(*p)?.schedule_next;
            let from = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                // Nothing committed: where `auto.offset.reset` starts.
                _ => {
                    let (low, high) = consumer.fetch_watermarks(topic, *p, timeout)?;
                    if resets_to_end {
                        high
                    } else {
                        low
                    }
                }
            };
            Ok((from.max(handled), handled))
        })
        .collect()
}

// ---------------------------------------------------------------- probes

/// Look up the end offsets of the schedule partitions whose due jobs wait
/// (see [`CaughtUp`]), one request for all of them, whenever the dispatcher
/// asks. Runs on its own thread: the look-up blocks.
fn probe_loop(shared: &Arc<Shared>, inbox: Receiver<()>) {
    let mut cfg = shared.reader_config.clone();
    cfg.set("group.id", "kairos-probe");
    let consumer: BaseConsumer = match cfg.create() {
        Ok(c) => c,
        Err(e) => {
            shared.fail(format!("creating the schedule probe client: {e}"));
            return;
        }
    };
    let topic = &shared.cfg.topics.schedule;
    let mut delay = kafka::RetryDelay::new();
    while !shared.stop.is_cancelled() {
        match inbox.recv_timeout(Duration::from_millis(200)) {
            Ok(()) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let at = shared.clock.now().timestamp_millis();
        let parts = shared.caught_up().take_wanted(at);
        if parts.is_empty() {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        for p in &parts {
            // The end offset ("latest"), asked for as a timestamp.
            if let Err(e) = tpl.add_partition_offset(topic, *p, Offset::End) {
                warn!(partition = p, error = %e, "schedule probe");
            }
        }
        let answer = consumer.offsets_for_times(tpl, shared.cfg.kafka.produce_timeout);
        let mut gate = shared.caught_up();
        let mut failed = Vec::new();
        let mut moved = false;
        match answer {
            Ok(ends) => {
                for e in ends.elements() {
                    match (e.offset(), e.error()) {
                        (Offset::Offset(end), Ok(())) => moved |= gate.probed(e.partition(), at, end),
                        _ => failed.push(e.partition()),
                    }
                }
            }
            Err(e) => {
                warn!(partitions = ?parts, error = %e, "cannot look up the schedule partitions' ends; due jobs wait");
                failed = parts;
            }
        }
        if !failed.is_empty() {
            gate.probe_failed(&failed, at);
        }
        drop(gate);
        if moved {
            shared.wake.notify_one();
        }
        if failed.is_empty() {
            delay = kafka::RetryDelay::new();
        } else {
            std::thread::sleep(delay.next_delay());
        }
    }
}

// ---------------------------------------------------------------- dispatch

/// Keep every owned partition's cascade point three windows ahead, off the
/// dispatcher's path: moving far jobs into the near range rewrites their
/// chunks, and done inside a refill it held up the fires (by up to 100 ms
/// with a short window). The refill then finds the near range ready. The
/// window has nothing to follow: cascaded jobs are beyond its horizons.
async fn cascade_loop(shared: Arc<Shared>) {
    let every = (shared.cfg.scheduler.window / 4).clamp(Duration::from_millis(50), Duration::from_secs(15));
    loop {
        let parts = shared.wheel().partitions();
        let until = cascade_until(&shared);
        for p in parts {
            let moved = blocking_store(&shared, "cascade", move |s| loop {
                let t = s.store.cascade(p, until)?;
                if t >= until || s.stop.is_cancelled() {
                    return Ok(());
                }
            })
            .await;
            if let Err(e) = moved {
                shared.fail(format!("cascading partition {p}: {e}"));
                return;
            }
        }
        // Stragglers (jobs due far ahead) keep old value-log segments alive:
        // copy them forward so the segments can go.
        if let Err(e) = blocking_store(&shared, "compact", |s| {
            // Flushed now so that the emptied segments go now.
            if s.store.compact(COMPACT_BYTES)? > 0 {
                s.store.flush()?;
            }
            Ok(())
        })
        .await
        {
            shared.fail(format!("compacting the store's value log: {e}"));
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shared.stop.cancelled() => return,
        }
    }
}

/// Most bytes one compaction pass copies (one pass per cascade round).
const COMPACT_BYTES: u64 = 32 << 20;

/// Where the cascade point is kept: three windows ahead of now.
fn cascade_until(shared: &Shared) -> i64 {
    let window = shared.cfg.scheduler.window.as_millis() as i64;
    shared.clock.now().timestamp_millis().saturating_add(3 * window)
}

/// Run store calls on tokio's blocking pool (sled blocks; its own
/// `flush_async` runs on sled's small pool, and several at once deadlocked it).
async fn blocking_store<T: Send + 'static>(
    shared: &Arc<Shared>,
    what: &str,
    f: impl FnOnce(&Shared) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let s = shared.clone();
    tokio::task::spawn_blocking(move || f(&s))
        .await
        .map_err(|e| StoreError::Task(format!("{what}: {e}")))?
}

async fn dispatch_loop(shared: Arc<Shared>) {
    let max_sleep = Duration::from_secs(1);
    // Batches are handed to librdkafka here, in firing order, and finished
    // (acknowledged, tombstoned, deleted) by the finisher, so that jobs coming
    // due meanwhile do not wait for that. The idempotent producer keeps the
    // order per partition; a write that fails fails the later ones of its
    // partition too, and they all go back into the window in run-at order.
    let (to_finish, inbox) = tokio::sync::mpsc::unbounded_channel();
    let finisher = tokio::spawn(finish_loop(shared.clone(), inbox));
    let mut holding = Holding::default();
    loop {
        if shared.stop.is_cancelled() {
            break;
        }
        let now = shared.clock.now().timestamp_millis();
        // Read before the window: `until` only grows, so a stale copy only
        // holds jobs back a little longer.
        let mut until = shared.caught_up().snapshot();
        if shared.fire_unread.load(Ordering::Relaxed) {
            until.values_mut().for_each(|u| *u = i64::MAX);
        }
        let (due, direct, parts, wake_at, held) = {
            let mut w = shared.wheel();
            if w.refill_due_ms().is_some_and(|t| t <= now) {
                if let Err(e) = w.refill(&shared.store, now) {
                    drop(w);
                    shared.fail(e.to_string());
                    break;
                }
            }
            let Due { jobs: due, held } = w.take_due(now, shared.cfg.scheduler.fire_batch, &until);
            let direct = w.take_direct(&due);
            let parts: HashSet<i32> = due.iter().map(|(k, _)| k.partition).collect();
            if !parts.is_empty() {
                let mut firing = shared.firing.lock().unwrap_or_else(|e| e.into_inner());
                for p in &parts {
                    *firing.entry(*p).or_insert(0) += 1;
                }
            }
            // Jobs due but held wake the dispatcher when their partition
            // has been read further (ingest and probes notify).
            let wake = [w.next_after_ms(now), w.refill_due_ms()]
                .into_iter()
                .flatten()
                .min();
            (due, direct, parts, wake, held)
        };
        holding.update(&shared, &held, now);
        if !due.is_empty() {
            let writes = start_fire(&shared, &due).await;
            let batch = FireBatch {
                due,
                direct,
                writes,
                parts,
            };
            if to_finish.send(batch).is_err() {
                break; // the finisher ended: the scheduler is stopping
            }
            continue;
        }
        // Sleep until the next job is due; a wake-up re-reads the clock, so
        // the sleep is capped to notice a clock that jumps (tests' manual clocks).
        let sleep = wake_at
            .map(|t| Duration::from_millis(t.saturating_sub(now).max(0) as u64))
            .unwrap_or(max_sleep)
            .min(max_sleep);
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = shared.wake.notified() => {}
            _ = shared.stop.cancelled() => break,
        }
    }
    // Let the fires in flight finish (acknowledged jobs are deleted).
    drop(to_finish);
    let _ = finisher.await;
}

/// Due jobs held because their schedule partition has not been read up to
/// their run-at: asks for probes, and says so when it lasts.
#[derive(Default)]
struct Holding {
    /// Since when jobs have been held, and when that was last logged.
    since: Option<(Instant, Option<Instant>)>,
}

/// How long jobs may be held before the dispatcher logs it (then again as often).
const HELD_WARNING: Duration = Duration::from_secs(5);

impl Holding {
    fn update(&mut self, shared: &Shared, held: &HashMap<i32, i64>, now_ms: i64) {
        if held.is_empty() {
            if let Some((since, Some(_))) = self.since.take() {
                info!(held_for = ?since.elapsed(), "held jobs released: schedule partitions read up to their run-at");
            }
            return;
        }
        let mut gate = shared.caught_up();
        let ask = held
            .iter()
            .fold(false, |ask, (p, due_ms)| gate.want(*p, *due_ms) || ask);
        if ask {
            // Full: a probe is asked for already.
            let _ = shared.probe.try_send(());
        }
        let (since, logged) = self.since.get_or_insert((Instant::now(), None));
        if logged.unwrap_or(*since).elapsed() >= HELD_WARNING {
            *logged = Some(Instant::now());
            for (p, due_ms) in held {
                let (read_to, end) = gate.progress(*p).unwrap_or((-1, None));
                warn!(partition = p, held_for = ?since.elapsed(), latest_held_late_ms = now_ms - due_ms,
                    read_to, end = ?end, "due jobs held: the schedule partition is not read up to their run-at yet (a cancel written before then would be missed)");
            }
        }
    }
}

/// Due jobs handed to librdkafka, waiting for the finisher.
struct FireBatch {
    due: Vec<(DueKey, StoredJob)>,
    /// Which of `due` are direct jobs (not in the store, nor the changelog).
    direct: HashSet<DueKey>,
    writes: FireWrites,
    /// The partitions of `due`, each counted once in `Shared::firing`.
    parts: HashSet<i32>,
}

/// Most jobs one finisher round takes on. Merging the batches waiting saves
/// tombstone and flush work, but a round of a whole backlog (every batch
/// the dispatcher handed over meanwhile, copied and awaited at once) held
/// up offsets and the fired count for a third of a second in the drain bench.
const FINISH_ROUND_JOBS: usize = 8_192;

/// Finish fire batches as they come, merging the batches waiting (up to
/// [`FINISH_ROUND_JOBS`]) into one round of tombstones, store deletes and flush.
async fn finish_loop(shared: Arc<Shared>, mut inbox: tokio::sync::mpsc::UnboundedReceiver<FireBatch>) {
    while let Some(first) = inbox.recv().await {
        let mut jobs = first.due.len();
        let mut batches = vec![first];
        while jobs < FINISH_ROUND_JOBS {
            let Ok(b) = inbox.try_recv() else { break };
            jobs += b.due.len();
            batches.push(b);
        }
        let mut parts: Vec<HashSet<i32>> = Vec::with_capacity(batches.len());
        let mut due = Vec::with_capacity(jobs);
        let mut direct = HashSet::default();
        let mut writes: FireWrites = Vec::with_capacity(jobs);
        for b in batches {
            due.extend(b.due);
            direct.extend(b.direct);
            writes.extend(b.writes);
            parts.push(b.parts);
        }
        let ok = finish_fire(&shared, due, direct, writes).await;
        {
            let mut firing = shared.firing.lock().unwrap_or_else(|e| e.into_inner());
            for p in parts.into_iter().flatten() {
                if let Some(n) = firing.get_mut(&p) {
                    *n -= 1;
                    if *n == 0 {
                        firing.remove(&p);
                    }
                }
            }
        }
        shared.firing_done.notify_all();
        if let Err(e) = ok {
            shared.fail(e.to_string());
        }
    }
}

/// The writes of a fire batch, handed to librdkafka in firing order.
type FireWrites = Vec<
    std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<rdkafka::producer::future_producer::Delivery, KafkaError>>
                + Send,
        >,
    >,
>;

/// Hand a batch of due jobs to librdkafka, in order. Jobs for work topics
/// that do not exist are not written (librdkafka would only time out on
/// them): their write fails at once and [`finish_fire`] dead-letters them.
async fn start_fire(shared: &Arc<Shared>, due: &[(DueKey, StoredJob)]) -> FireWrites {
    // Whether each work topic is missing, asked once per batch. Jobs in a row
    // mostly share a topic: the answer for the last one is kept at hand.
    let mut missing: HashMap<&str, Result<bool, KafkaError>> = HashMap::default();
    let mut last: Option<(&str, Result<bool, KafkaError>)> = None;
    let mut writes: FireWrites = Vec::with_capacity(due.len());
    for (_, s) in due {
        let topic = s.job.topic.as_str();
        let state = match &last {
            Some((t, m)) if *t == topic => m,
            _ => {
                let m = match missing.get(topic) {
                    Some(m) => m.clone(),
                    None => {
                        let m = shared.topic_check.exists(topic).await.map(|e| !e);
                        missing.insert(topic, m.clone());
                        m
                    }
                };
                &last.insert((topic, m)).1
            }
        };
        match state {
            Ok(true) => {
                let e = KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition);
                writes.push(Box::pin(async move { Err(e) }));
            }
            Ok(false) => {
                writes.push(Box::pin(kafka::enqueue_job(&shared.producer, &s.job).await));
            }
            Err(e) => {
                let e = e.clone();
                writes.push(Box::pin(async move { Err(e) }));
            }
        }
    }
    writes
}

/// What a finisher round writes for one partition.
#[derive(Default)]
struct Fired {
    /// Changelog records: tombstones, then how far the partition is handled.
    tombs: Vec<OwnedRecord>,
    /// Store deletions.
    changes: Vec<Change>,
    /// The next changelog offset once `tombs` are written.
    changelog_next: i64,
    /// The first schedule offset not handled.
    schedule_next: Option<i64>,
}

/// Finish a fire batch: wait for its writes, then tombstone and delete the
/// stored jobs acknowledged, and release the offsets of the direct ones. Jobs
/// whose write failed go back into the window.
async fn finish_fire(
    shared: &Arc<Shared>,
    due: Vec<(DueKey, StoredJob)>,
    direct: HashSet<DueKey>,
    writes: FireWrites,
) -> Result<(), StoreError> {
    let cfg = &shared.cfg;
    // Every write is with librdkafka already: awaiting them in turn is
    // enough, and cheaper than joining them.
    let mut results = Vec::with_capacity(writes.len());
    for w in writes {
        results.push(w.await);
    }
    let now = Utc::now();
    let mut done: Vec<&(DueKey, StoredJob)> = Vec::new();
    let mut retry: Vec<(DueKey, StoredJob)> = Vec::new();
    let mut dead: Vec<(&(DueKey, StoredJob), OwnedRecord)> = Vec::new();
    let mut fired = 0u64;
    for (item, r) in due.iter().zip(results) {
        let (k, s) = item;
        match r {
            Ok(d) => {
                fired += 1;
                let late_ms = (now - s.job.run_at).num_milliseconds();
                debug!(job_id = %s.job.id, key = %s.job.key_lossy(), topic = %s.job.topic,
                    partition = d.partition, offset = d.offset, late_ms, "fired");
                done.push(item);
            }
            Err(e) if kafka::is_unknown_topic(&e) => {
                warn!(job_id = %s.job.id, topic = %s.job.topic, "work topic does not exist; dead-lettering");
                let reason = format!("work topic `{}` does not exist", s.job.topic);
                let d = DeadLetter {
                    reason,
                    origin_topic: cfg.topics.schedule.clone(),
                    origin_partition: k.partition,
                    origin_offset: k.seq as i64,
                };
                dead.push((item, wire::dead_job_record(&s.job, &d, &cfg.topics.dead_letter)));
            }
            Err(e) => {
                warn!(job_id = %s.job.id, topic = %s.job.topic, error = %e, "fire failed; will retry");
                retry.push(item.clone());
            }
        }
    }
    let dead_results =
        futures::future::join_all(dead.iter().map(|(_, r)| kafka::send(&shared.producer, r, None))).await;
    for ((item, _), r) in dead.iter().zip(dead_results) {
        match r {
            Ok(_) => {
                shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                done.push(item);
            }
            Err(e) => {
                warn!(job_id = %item.1.job.id, error = %e, "dead-letter write failed; will retry");
                retry.push((*item).clone());
            }
        }
    }
    // Direct jobs: nothing stored; their schedule offsets may now be committed.
    if !direct.is_empty() {
        let mut offsets = shared.direct();
        let before = done.len();
        done.retain(|(k, _)| {
            if !direct.contains(k) {
                return true;
            }
            if let Some(d) = offsets.get_mut(&k.partition) {
                d.release(k.seq as i64);
            }
            false
        });
        shared
            .stats
            .fired_direct
            .fetch_add((before - done.len()) as u64, Ordering::Relaxed);
    }
    // Tombstones, then the store.
    let mut by_part: HashMap<i32, Fired> = HashMap::default();
    for (k, s) in &done {
        let e = by_part.entry(k.partition).or_default();
        e.tombs
            .push(changelog::tombstone(&cfg.topics.changelog, &s.job.id));
        e.changes.push(Change::Fired(s.job.id, *k));
    }
    // How far each partition is handled, with the direct jobs just fired:
    // after its tombstones, so a new owner skips what fired here.
    {
        let offsets = shared.direct();
        for (p, f) in by_part.iter_mut() {
            if let Some(d) = offsets.get(p) {
                let next = d.safe() + 1;
                f.schedule_next = Some(next);
                f.tombs
                    .push(changelog::schedule_next_record(&cfg.topics.changelog, next));
            }
        }
    }
    let sends = by_part.iter().flat_map(|(p, f)| {
        f.tombs
            .iter()
            .map(move |r| kafka::send(&shared.producer, r, Some(*p)))
    });
    let mut results = futures::future::join_all(sends).await.into_iter();
    for f in by_part.values_mut() {
        for (r, rec) in results.by_ref().zip(&f.tombs) {
            match r {
                Ok(d) => f.changelog_next = f.changelog_next.max(d.offset + 1),
                // The local delete still happens; a later owner rebuilding from
                // the changelog may fire this job again (a documented duplicate).
                Err(err) => {
                    warn!(key = %String::from_utf8_lossy(&rec.key), error = %err, "changelog write failed")
                }
            }
        }
    }
    // Off the runtime threads, so that the dispatcher keeps firing meanwhile.
    let applied = if by_part.is_empty() {
        Vec::new()
    } else {
        blocking_store(shared, "store delete", move |s| {
            let writes: Vec<PartitionWrite> = by_part
                .iter()
                .map(|(p, f)| PartitionWrite {
                    changelog_next: (f.changelog_next > 0).then_some(f.changelog_next),
                    schedule_next: f.schedule_next,
                    ..PartitionWrite::new(*p, &f.changes)
                })
                .collect();
            let applied = s.store.apply_all(&writes)?;
            s.store.flush()?;
            Ok(applied)
        })
        .await?
    };
    shared.stats.fired.fetch_add(fired, Ordering::Relaxed);
    let backoff = !retry.is_empty();
    {
        // Deleted from the store and the window together: a change read
        // from now on finds the job gone, not being fired.
        let mut w = shared.wheel();
        w.follow(&applied);
        w.fired(&due);
        w.put_back(retry, &direct);
    }
    if backoff {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}
