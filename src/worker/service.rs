//! The running worker: a poll thread feeding the lock table, a few driver
//! tasks on the tokio runtime running the handlers, offsets committed only
//! below the first unfinished job, and partitions drained before they are
//! released.
//!
//! Handlers are not spawned one task per job: each driver task holds the
//! handler futures it runs in a `FuturesUnordered`, takes new jobs from the
//! poll thread a batch at a time, and settles every job that finished in one
//! wake-up under one lock, starting the next ones itself. There is one
//! driver per runtime worker thread, so handlers still run on every core;
//! a handler that computes for long without awaiting holds up the other
//! handlers of its driver, so CPU-heavy work belongs in `spawn_blocking`.

use crate::hash::HashMap;
use std::future::{Future, IntoFuture};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::producer::FutureProducer;
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};

use crate::clock::SharedClock;
use crate::config::Config;
use crate::job::Job;
use crate::kafka;
use crate::producer::Producer;
use crate::wire::{self, Context, DeadLetter, RecordView};
use crate::worker::handler::{Backoff, Handler, JobContext, Outcome};
use crate::worker::lock_table::{Keyed, LockTable};
use crate::worker::offset_tracker::OffsetTracker;

/// Why the worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// A Kafka client could not be created or subscribed.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// The producer for retries and follow-ups could not be created.
    #[error(transparent)]
    Produce(#[from] crate::producer::ProduceError),
    /// The configuration is unusable.
    #[error("worker configuration: {0}")]
    Config(String),
    /// The poll thread ended abnormally.
    #[error("worker stopped: {0}")]
    Fatal(String),
}

/// A topic partition, as (index into the worker's topics, partition).
type Tp = (usize, i32);

/// A job read from a work topic, waiting in or running from the lock table.
struct Entry {
    job: Job,
    tp: Tp,
    offset: i64,
}

impl Keyed for Entry {
    fn key(&self) -> &[u8] {
        &self.job.key
    }
    fn partition(&self) -> Tp {
        self.tp
    }
}

/// An owned partition.
struct Owned {
    /// Cancelled on revocation: tells its running handlers to stop.
    cancel: CancellationToken,
    /// Distinguishes this ownership from a later one of the same partition,
    /// so a handler that outlives a revocation cannot move offsets.
    generation: u64,
}

/// Mutable state shared by the poll thread and the handler tasks.
#[derive(Default)]
struct State {
    table: LockTable<Entry>,
    tracker: OffsetTracker,
    owned: HashMap<Tp, Owned>,
    /// Running handlers per partition (revocation waits for zero).
    in_flight: HashMap<Tp, usize>,
    /// Commit points that advanced, for the poll thread to store.
    to_store: HashMap<Tp, i64>,
    next_generation: u64,
}

/// Counters of what the worker did.
#[derive(Default)]
struct Stats {
    started: AtomicU64,
    succeeded: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    panicked: AtomicU64,
    handed_to_scheduler: AtomicU64,
}

/// A snapshot of the worker's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// Partitions owned now.
    pub owned: usize,
    /// Jobs buffered or running now.
    pub open: usize,
}

struct Shared {
    cfg: Config,
    topics: Vec<String>,
    group: String,
    concurrency: usize,
    handler: Arc<dyn Handler>,
    state: Mutex<State>,
    /// Signalled whenever a handler finishes.
    finished: Condvar,
    /// Writes retries, follow-ups and early jobs (routed by run-at).
    producer: Producer,
    /// Writes dead letters.
    raw: FutureProducer,
    /// Where the poll thread sends jobs to start, one channel per driver.
    drivers: Vec<tokio::sync::mpsc::UnboundedSender<Vec<Start>>>,
    /// The drivers' ends of those channels, taken when the worker runs.
    driver_inboxes: Mutex<Vec<tokio::sync::mpsc::UnboundedReceiver<Vec<Start>>>>,
    /// Round-robin over the drivers.
    next_driver: std::sync::atomic::AtomicUsize,
    /// Whether a thread waits on `finished` (saves a wake-up syscall per
    /// batch of finished jobs when nobody does).
    waiters: std::sync::atomic::AtomicUsize,
    clock: SharedClock,
    backoff: Backoff,
    stop: CancellationToken,
    stats: Stats,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until a handler finishes, or `timeout`.
    fn wait_finished<'a>(&self, st: MutexGuard<'a, State>, timeout: Duration) -> MutexGuard<'a, State> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let st = self
            .finished
            .wait_timeout(st, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        st
    }

    /// Wake the threads waiting in [`Shared::wait_finished`], if any. Called
    /// after the state lock is released; a waiter registers under the lock,
    /// so it either sees the change or is counted here.
    fn notify_finished(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.finished.notify_all();
        }
    }

    /// Hand jobs started by the poll thread to a driver.
    fn dispatch(&self, starts: Vec<Start>) {
        if starts.is_empty() {
            return;
        }
        let i = self.next_driver.fetch_add(1, Ordering::Relaxed) % self.drivers.len();
        if let Err(unsent) = self.drivers[i].send(starts) {
            // The drivers are gone only once the worker has stopped: the jobs
            // stay unfinished and are re-delivered to the next owner.
            debug!(jobs = unsent.0.len(), "worker stopped; jobs not started");
        }
    }

    fn tp(&self, topic: &str, partition: i32) -> Option<Tp> {
        self.topics
            .iter()
            .position(|t| t == topic)
            .map(|i| (i, partition))
    }
}

/// Builds a [`Worker`].
///
/// ```no_run
/// # async fn demo(cfg: kairos::Config) -> Result<(), kairos::worker::WorkerError> {
/// use kairos::worker::{Outcome, Worker};
///
/// let worker = Worker::builder(&cfg)
///     .topics(["emails"])
///     .concurrency(64)
///     .build(|job: kairos::Job, _ctx| async move {
///         println!("sending {:?}", job.payload);
///         Outcome::done()
///     })?;
/// worker.run_until(tokio::signal::ctrl_c().map(|_| ())).await?;
/// # Ok(()) }
/// # use futures::FutureExt;
/// ```
pub struct WorkerBuilder {
    cfg: Config,
    clock: SharedClock,
}

/// A consumer-group member that runs jobs: in parallel across keys, one at a
/// time per key, in order.
pub struct Worker {
    shared: Arc<Shared>,
}

impl Worker {
    /// Start building a worker from configuration (`[worker]` and the rest).
    pub fn builder(cfg: &Config) -> WorkerBuilder {
        WorkerBuilder {
            cfg: cfg.clone(),
            clock: crate::clock::system(),
        }
    }
}

impl WorkerBuilder {
    /// Work topics to consume (default: `[worker] topics`).
    pub fn topics<S: Into<String>>(mut self, topics: impl IntoIterator<Item = S>) -> Self {
        self.cfg.worker.topics = topics.into_iter().map(Into::into).collect();
        self
    }

    /// Consumer group (default: `[worker] group_id`).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.cfg.worker.group_id = group.into();
        self
    }

    /// Most jobs running at once (default: `[worker] concurrency`).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.cfg.worker.concurrency = n;
        self
    }

    /// The clock that decides whether a job is due (tests inject one).
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Finish with the job handler. Must be called inside a tokio runtime.
    pub fn build<H: Handler>(self, handler: H) -> Result<Worker, WorkerError> {
        let cfg = self.cfg;
        let w = &cfg.worker;
        if w.topics.is_empty() {
            return Err(WorkerError::Config("no work topics to consume".into()));
        }
        if w.concurrency == 0 {
            return Err(WorkerError::Config("concurrency must be at least 1".into()));
        }
        let raw = kafka::producer(&cfg.kafka, "kairos-worker")?;
        let producer = Producer::from_parts(raw.clone(), &cfg, self.clock.clone())?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| WorkerError::Config("build the worker inside a tokio runtime".into()))?;
        let (drivers, driver_inboxes) = (0..runtime.metrics().num_workers().max(1))
            .map(|_| tokio::sync::mpsc::unbounded_channel())
            .unzip();
        Ok(Worker {
            shared: Arc::new(Shared {
                topics: w.topics.clone(),
                group: w.group_id.clone(),
                concurrency: w.concurrency,
                backoff: Backoff {
                    base: w.backoff_base,
                    max: w.backoff_max,
                },
                handler: Arc::new(handler),
                state: Mutex::new(State::default()),
                finished: Condvar::new(),
                producer,
                raw,
                drivers,
                driver_inboxes: Mutex::new(driver_inboxes),
                next_driver: Default::default(),
                waiters: Default::default(),
                clock: self.clock,
                stop: CancellationToken::new(),
                stats: Stats::default(),
                cfg,
            }),
        })
    }
}

/// Reads a running worker's counters.
#[derive(Clone)]
pub struct WorkerHandle {
    shared: Arc<Shared>,
}

impl WorkerHandle {
    /// The worker's counters now.
    pub fn stats(&self) -> WorkerStats {
        stats(&self.shared)
    }
}

fn stats(shared: &Shared) -> WorkerStats {
    let s = &shared.stats;
    let st = shared.state();
    WorkerStats {
        started: s.started.load(Ordering::Relaxed),
        succeeded: s.succeeded.load(Ordering::Relaxed),
        retried: s.retried.load(Ordering::Relaxed),
        dead_lettered: s.dead_lettered.load(Ordering::Relaxed),
        panicked: s.panicked.load(Ordering::Relaxed),
        handed_to_scheduler: s.handed_to_scheduler.load(Ordering::Relaxed),
        owned: st.owned.len(),
        open: st.tracker.open(),
    }
}

impl Worker {
    /// A handle for reading counters while the worker runs.
    pub fn handle(&self) -> WorkerHandle {
        WorkerHandle {
            shared: self.shared.clone(),
        }
    }

    /// Run until `shutdown` completes. On shutdown every partition is
    /// drained as on a revocation (running handlers are cancelled and given
    /// the revocation deadline), offsets are committed and the group is left.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), WorkerError> {
        let shared = self.shared;
        let inboxes = std::mem::take(&mut *shared.driver_inboxes.lock().unwrap_or_else(|e| e.into_inner()));
        if inboxes.is_empty() {
            return Err(WorkerError::Fatal("the worker already ran".into()));
        }
        let halt = CancellationToken::new();
        for inbox in inboxes {
            tokio::spawn(drive(shared.clone(), inbox, halt.clone()));
        }
        let poll_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kairos-worker-poll".into())
            .spawn(move || poll_loop(&poll_shared))
            .map_err(|e| WorkerError::Fatal(e.to_string()))?;
        let stop = shared.stop.clone();
        tokio::select! {
            _ = shutdown => info!("worker shutdown requested"),
            _ = stop.cancelled() => {}
        }
        stop.cancel();
        let result = tokio::task::spawn_blocking(move || thread.join())
            .await
            .map_err(|e| WorkerError::Fatal(e.to_string()))?
            .map_err(|_| WorkerError::Fatal("poll thread panicked".into()));
        // Every partition has been released. Handlers still running now are
        // past the revocation deadline: their drivers end after them.
        halt.cancel();
        let result = result?;
        info!(stats = ?stats(&shared), "worker stopped");
        result
    }
}

// ---------------------------------------------------------------- poll thread

struct Ctx {
    shared: Arc<Shared>,
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        kafka::log_commit("worker", &result, offsets);
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let tps: Vec<Tp> = tpl
                .elements()
                .iter()
                .filter_map(|e| self.shared.tp(e.topic(), e.partition()))
                .collect();
            release(&self.shared, consumer, &tps);
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let mut st = self.shared.state();
                for e in tpl.elements() {
                    if let Some(tp) = self.shared.tp(e.topic(), e.partition()) {
                        st.next_generation += 1;
                        let generation = st.next_generation;
                        let cancel = self.shared.stop.child_token();
                        st.owned.insert(tp, Owned { cancel, generation });
                    }
                }
                info!(partitions = ?tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect::<Vec<_>>(),
                    "work partitions assigned");
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

/// Let go of partitions: drop their buffered jobs, cancel their running
/// handlers, wait for them up to the revocation deadline, commit what is
/// finished, forget them.
fn release(shared: &Shared, consumer: &BaseConsumer<Ctx>, tps: &[Tp]) {
    let deadline = Instant::now() + shared.cfg.worker.revocation_deadline;
    let mut st = shared.state();
    let mut dropped = 0;
    for tp in tps {
        dropped += st.table.drop_partition(*tp).len();
        if let Some(o) = st.owned.get(tp) {
            o.cancel.cancel();
        }
    }
    while tps
        .iter()
        .any(|tp| st.in_flight.get(tp).copied().unwrap_or(0) > 0)
    {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let stuck: Vec<_> = tps
                .iter()
                .filter(|tp| st.in_flight.get(tp).copied().unwrap_or(0) > 0)
                .collect();
            warn!(partitions = ?stuck, deadline = ?shared.cfg.worker.revocation_deadline,
                "handlers still running past the revocation deadline; releasing anyway (their jobs may run again elsewhere)");
            break;
        }
        st = shared.wait_finished(st, left.min(Duration::from_millis(100)));
    }
    let mut tpl = TopicPartitionList::new();
    for tp in tps {
        if let Some(c) = st.tracker.commit_point(*tp) {
            let _ = tpl.add_partition_offset(&shared.topics[tp.0], tp.1, Offset::Offset(c));
            // Store it too: librdkafka commits the stored offsets once more
            // when the partition goes (auto-commit), and a stale stored offset
            // would move the committed one back.
            let _ = consumer.store_offset(&shared.topics[tp.0], tp.1, c - 1);
        }
        st.tracker.remove(*tp);
        st.owned.remove(tp);
        st.to_store.remove(tp);
    }
    drop(st);
    if tpl.count() > 0 {
        if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
            warn!(error = %e, "commit on release failed");
        }
    }
    info!(partitions = ?tps, dropped_buffered = dropped, "work partitions released");
}

fn poll_loop(shared: &Arc<Shared>) -> Result<(), WorkerError> {
    let member = kafka::Membership {
        group: &shared.group,
        session_timeout: shared.cfg.worker.session_timeout,
        instance_id: None,
    };
    let consumer: BaseConsumer<Ctx> = kafka::consumer(
        &shared.cfg.kafka,
        &member,
        "kairos-worker",
        Ctx {
            shared: shared.clone(),
        },
    )?;
    let topics: Vec<&str> = shared.topics.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    let max_buffered = shared.cfg.worker.max_buffered.max(1);
    while !shared.stop.is_cancelled() {
        store_offsets(shared, &consumer);
        // Back-pressure: with the buffer full, stop reading until it has
        // drained to three quarters (reading again after every finished job
        // would wake this thread once per job). Pausing the partitions
        // instead would make librdkafka drop what it had fetched and stall
        // for most of a second after the resume. librdkafka's own read-ahead
        // is bounded by `queued.max.messages.kbytes`. One poll a second still
        // serves rebalances (each may add one record beyond the bound).
        let mut polled_at_most = Duration::from_millis(50);
        {
            let mut st = shared.state();
            if st.table.buffered() >= max_buffered {
                let resume_below = (max_buffered - max_buffered / 4).max(1);
                let until = Instant::now() + Duration::from_secs(1);
                while st.table.buffered() >= resume_below && !shared.stop.is_cancelled() {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    st = shared.wait_finished(st, left);
                }
                if st.table.buffered() >= max_buffered {
                    polled_at_most = Duration::ZERO;
                } else {
                    continue;
                }
            }
        }
        let room = max_buffered
            .saturating_sub(shared.state().table.buffered())
            .clamp(1, 1024);
        let mut batch: Vec<BorrowedMessage<'_>> = Vec::new();
        let mut next = consumer.poll(polled_at_most);
        while let Some(r) = next {
            match r {
                Ok(m) => batch.push(m),
                Err(e) => warn!(error = %e, "work topic consumer"),
            }
            // Take what is already fetched, up to the free room in the buffer.
            if polled_at_most.is_zero() || batch.len() >= room {
                break;
            }
            next = consumer.poll(Duration::ZERO);
        }
        if !batch.is_empty() {
            accept_batch(shared, &batch);
        }
    }
    // Shutdown: drain everything we own, as on a revocation.
    let owned: Vec<Tp> = shared.state().owned.keys().copied().collect();
    release(shared, &consumer, &owned);
    consumer.unsubscribe();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !consumer.assignment().map(|a| a.count() == 0).unwrap_or(true) && Instant::now() < deadline {
        consumer.poll(Duration::from_millis(50));
    }
    Ok(())
}

fn store_offsets(shared: &Shared, consumer: &BaseConsumer<Ctx>) {
    let pending: Vec<(Tp, i64)> = shared.state().to_store.drain().collect();
    for (tp, offset) in pending {
        // librdkafka commits one past the stored offset.
        if let Err(e) = consumer.store_offset(&shared.topics[tp.0], tp.1, offset - 1) {
            debug!(error = %e, partition = tp.1, "offset not stored (partition gone)");
        }
    }
}

/// Take a batch of records from the work topics: decode them outside the
/// lock, then buffer the runnable ones and start what may start, under one
/// lock for the whole batch.
fn accept_batch(shared: &Arc<Shared>, msgs: &[BorrowedMessage<'_>]) {
    let now = shared.clock.now();
    let tolerance = chrono::Duration::from_std(shared.cfg.worker.early_tolerance).unwrap_or_default();
    let mut runnable: Vec<Entry> = Vec::with_capacity(msgs.len());
    for m in msgs {
        let Some(tp) = shared.tp(m.topic(), m.partition()) else {
            continue;
        };
        let offset = m.offset();
        let view = RecordView::from_message(m);
        match wire::decode_job(&view, Context::Work, &shared.cfg.limits) {
            Ok(job) if job.run_at <= now + tolerance => runnable.push(Entry { job, tp, offset }),
            Ok(job) => hand_to_scheduler(shared, job, tp, offset),
            Err(e) => dead_letter_record(shared, m, &view, &e, tp),
        }
    }
    let starts = {
        let mut st = shared.state();
        for e in runnable {
            if st.owned.contains_key(&e.tp) {
                st.tracker.read(e.tp, e.offset);
                st.table.push(e);
            }
        }
        start_ready(shared, &mut st)
    };
    shared.dispatch(starts);
}

/// A record that does not decode goes to the dead-letter topic with the reason.
fn dead_letter_record(
    shared: &Shared,
    m: &BorrowedMessage<'_>,
    view: &RecordView<'_>,
    e: &wire::DecodeError,
    tp: Tp,
) {
    let offset = m.offset();
    if !begin(shared, tp, offset) {
        return;
    }
    warn!(topic = m.topic(), partition = tp.1, offset, reason = %e, "work record dead-lettered");
    let dead = DeadLetter {
        reason: e.to_string(),
        origin_topic: m.topic().to_string(),
        origin_partition: tp.1,
        origin_offset: offset,
    };
    let rec = wire::dead_letter_record(view, &dead, &shared.cfg.topics.dead_letter, &shared.cfg.limits);
    if write_until_done(shared, None, || kafka::send(&shared.raw, &rec, None)) {
        shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        finish_offset(shared, tp, offset, None);
    }
}

/// A job read before its run-at goes back to the scheduler.
fn hand_to_scheduler(shared: &Shared, job: Job, tp: Tp, offset: i64) {
    if !begin(shared, tp, offset) {
        return;
    }
    debug!(job_id = %job.id, key = %job.key_lossy(), partition = tp.1, offset, "read before its run-at; handed to the scheduler");
    let producer = shared.producer.clone();
    if write_until_done(shared, None, move || {
        let producer = producer.clone();
        let j = job.clone();
        async move { producer.enqueue(j).await.map(|_| ()) }
    }) {
        shared.stats.handed_to_scheduler.fetch_add(1, Ordering::Relaxed);
        finish_offset(shared, tp, offset, None);
    }
}

/// Note a record as read and unfinished, if its partition is owned.
fn begin(shared: &Shared, tp: Tp, offset: i64) -> bool {
    let mut st = shared.state();
    if !st.owned.contains_key(&tp) {
        return false;
    }
    st.tracker.read(tp, offset);
    true
}

/// Retry a write until it succeeds; false if the worker stopped first (the
/// record then stays unfinished and is re-delivered).
fn write_until_done<F, Fut, T, E>(shared: &Shared, cancel: Option<&CancellationToken>, f: F) -> bool
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut delay = kafka::RetryDelay::new();
    loop {
        match futures::executor::block_on(f()) {
            Ok(_) => return true,
            Err(e) => warn!(error = %e, "write failed; retrying"),
        }
        if shared.stop.is_cancelled() || cancel.is_some_and(|c| c.is_cancelled()) {
            return false;
        }
        std::thread::sleep(delay.next_delay());
    }
}

/// Mark a record finished; if it belongs to the current ownership of its
/// partition, its commit point may advance.
fn finish_offset(shared: &Shared, tp: Tp, offset: i64, generation: Option<u64>) {
    finish_in(&mut shared.state(), tp, offset, generation);
}

fn finish_in(st: &mut State, tp: Tp, offset: i64, generation: Option<u64>) {
    let current = st.owned.get(&tp).map(|o| o.generation);
    if current.is_none() || (generation.is_some() && generation != current) {
        return;
    }
    if let Some(c) = st.tracker.finish(tp, offset) {
        st.to_store.insert(tp, c);
    }
}

/// A job taken from the lock table to run.
struct Start {
    entry: Entry,
    cancel: CancellationToken,
    generation: u64,
}

/// A job whose handler run is over.
struct Finished {
    key: Vec<u8>,
    tp: Tp,
    offset: i64,
    generation: u64,
    /// Its outcome is acknowledged by Kafka: its offset may be committed.
    settled: bool,
}

/// Take as many ready jobs as free slots allow; the caller runs them.
fn start_ready(shared: &Shared, st: &mut State) -> Vec<Start> {
    let mut starts = Vec::new();
    while st.table.running() < shared.concurrency {
        let Some(entry) = st.table.next_ready() else { break };
        let Some(owned) = st.owned.get(&entry.tp) else {
            // Partition gone since the job was buffered: forget it.
            let key = entry.job.key.clone();
            st.table.complete(&key);
            continue;
        };
        let cancel = owned.cancel.clone();
        let generation = owned.generation;
        *st.in_flight.entry(entry.tp).or_insert(0) += 1;
        starts.push(Start {
            entry,
            cancel,
            generation,
        });
    }
    starts
}

/// A driver: runs the handlers of the jobs it is given, settles finished
/// jobs in batches and starts the jobs they unblock. Once `halt` is
/// cancelled (every partition was released) it ends when its last handler
/// does: a handler deaf to cancellation runs on past the worker's stop, as a
/// spawned task would (the documented overlap).
async fn drive(
    shared: Arc<Shared>,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<Vec<Start>>,
    halt: CancellationToken,
) {
    let mut running = FuturesUnordered::new();
    let mut done: Vec<Finished> = Vec::new();
    let mut halted = false;
    loop {
        if halted && running.is_empty() {
            return;
        }
        // The inbox never closes while a driver runs: its senders live in
        // `Shared`, which the driver holds.
        tokio::select! {
            _ = halt.cancelled(), if !halted => halted = true,
            Some(starts) = inbox.recv() => {
                running.extend(starts.into_iter().map(|s| run_job(shared.clone(), s)));
            }
            Some(f) = running.next(), if !running.is_empty() => done.push(f),
        }
        // Whatever else finished meanwhile is settled in the same lock.
        while let Some(Some(f)) = running.next().now_or_never() {
            done.push(f);
        }
        if !done.is_empty() {
            let starts = settle_finished(&shared, &mut done);
            running.extend(starts.into_iter().map(|s| run_job(shared.clone(), s)));
        }
    }
}

/// Mark finished jobs done in the lock table and offset tracker; returns the
/// jobs that may start now.
fn settle_finished(shared: &Shared, done: &mut Vec<Finished>) -> Vec<Start> {
    let starts = {
        let mut st = shared.state();
        for f in done.drain(..) {
            st.table.complete(&f.key);
            if let Some(n) = st.in_flight.get_mut(&f.tp) {
                *n = n.saturating_sub(1);
            }
            if f.settled {
                finish_in(&mut st, f.tp, f.offset, Some(f.generation));
            }
        }
        start_ready(shared, &mut st)
    };
    shared.notify_finished();
    starts
}

async fn run_job(shared: Arc<Shared>, start: Start) -> Finished {
    let Start {
        entry: Entry { job, tp, offset },
        cancel,
        generation,
    } = start;
    let ctx = JobContext {
        topic: shared.topics[tp.0].clone(),
        partition: tp.1,
        offset,
        cancel: cancel.clone(),
    };
    // A job slightly early (within the tolerance) waits here, never runs early.
    let early = job.run_at - shared.clock.now();
    if early > chrono::Duration::zero() {
        let wait = early.to_std().unwrap_or_default();
        // Boxed, as it is rare: a timer inline would grow every job's future.
        Box::pin(async {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancel.cancelled() => {}
            }
        })
        .await;
    }
    let settled = if cancel.is_cancelled() {
        false
    } else {
        shared.stats.started.fetch_add(1, Ordering::Relaxed);
        let span = tracing::debug_span!("job", job_id = %job.id, key = %job.key_lossy(), topic = %ctx.topic,
            partition = tp.1, offset, attempt = job.attempt);
        let outcome = match AssertUnwindSafe(shared.handler.call(job.clone(), ctx).instrument(span.clone()))
            .catch_unwind()
            .await
        {
            Ok(o) => o,
            Err(panic) => {
                shared.stats.panicked.fetch_add(1, Ordering::Relaxed);
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                warn!(parent: &span, panic = %msg, "handler panicked");
                Outcome::retry(format!("handler panicked: {msg}"))
            }
        };
        // Boxed: the settling future is large and rarely more than one
        // write; inline, it would make every job's future kilobytes big.
        Box::pin(settle(&shared, &job, tp, offset, outcome, &cancel))
            .instrument(span)
            .await
    };
    Finished {
        key: job.key,
        tp,
        offset,
        generation,
        settled,
    }
}

/// Carry out an outcome; true once its effects are acknowledged by Kafka.
async fn settle(
    shared: &Shared,
    job: &Job,
    tp: Tp,
    offset: i64,
    outcome: Outcome,
    cancel: &CancellationToken,
) -> bool {
    let mut delay = kafka::RetryDelay::new();
    loop {
        let result: Result<(), String> = match &outcome {
            Outcome::Done { follow_ups } => {
                let writes = follow_ups
                    .iter()
                    .map(|f| shared.producer.enqueue(f.clone()).into_future());
                let results = futures::future::join_all(writes).await;
                match results.into_iter().find_map(Result::err) {
                    None => {
                        shared.stats.succeeded.fetch_add(1, Ordering::Relaxed);
                        debug!(job_id = %job.id, follow_ups = follow_ups.len(), "done");
                        Ok(())
                    }
                    // A follow-up that can never be written fails the job for
                    // good (retrying the job would hit the same wall).
                    Some(e) if e.is_permanent() => {
                        let reason = format!("follow-up rejected: {e}");
                        dead_letter(shared, job, tp, offset, &reason, None).await
                    }
                    Some(e) => Err(e.to_string()),
                }
            }
            Outcome::Retry { after, error } => {
                let max = job.max_attempts.unwrap_or(shared.cfg.worker.max_attempts);
                if job.attempt >= max {
                    let reason = format!("gave up after {} attempts: {error}", job.attempt);
                    dead_letter(shared, job, tp, offset, &reason, Some(error)).await
                } else {
                    let delay =
                        after.unwrap_or_else(|| shared.backoff.delay(job.attempt, &mut rand::thread_rng()));
                    let mut next = job.clone();
                    next.attempt += 1;
                    next.last_error = Some(error.clone());
                    let now = shared.clock.now();
                    next.run_at = now + chrono::Duration::from_std(delay).unwrap_or_default();
                    next.run_at = crate::job::truncate_to_millis(next.run_at);
                    match shared.producer.enqueue(next).await {
                        Ok(_) => {
                            shared.stats.retried.fetch_add(1, Ordering::Relaxed);
                            debug!(job_id = %job.id, attempt = job.attempt, delay = ?delay, error = %error, "retry scheduled");
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
            }
            Outcome::Dead { reason } => dead_letter(shared, job, tp, offset, reason, None).await,
        };
        match result {
            Ok(()) => return true,
            Err(e) => warn!(job_id = %job.id, error = %e, "writing the outcome failed; retrying"),
        }
        if cancel.is_cancelled() {
            return false; // re-delivered to the partition's next owner
        }
        tokio::time::sleep(delay.next_delay()).await;
    }
}

async fn dead_letter(
    shared: &Shared,
    job: &Job,
    tp: Tp,
    offset: i64,
    reason: &str,
    last_error: Option<&String>,
) -> Result<(), String> {
    let mut j = job.clone();
    if let Some(e) = last_error {
        j.last_error = Some(e.clone());
    }
    let dead = DeadLetter {
        reason: reason.to_string(),
        origin_topic: shared.topics[tp.0].clone(),
        origin_partition: tp.1,
        origin_offset: offset,
    };
    let rec = wire::dead_job_record(&j, &dead, &shared.cfg.topics.dead_letter);
    kafka::send(&shared.raw, &rec, None)
        .await
        .map_err(|e| e.to_string())?;
    shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
    warn!(job_id = %job.id, key = %job.key_lossy(), reason, "job dead-lettered");
    Ok(())
}
