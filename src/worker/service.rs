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
//!
//! Files: [`poll`] (the poll thread and the rebalance callbacks), [`ready`]
//! (the jobs to start now, and the paced turns as they come), [`drive`]
//! (the drivers), [`offsets`] (records read and finished), [`touch`] (no
//! job starts while the group coordinator does not answer). Outcomes are
//! carried out by [`crate::worker::settle`], the same rules a
//! [`crate::worker::TestWorker`] runs.

mod drive;
mod held;
mod held_load;
mod held_round;
mod jobs;
mod keeper;
mod metrics;
mod offsets;
mod pace;
mod poll;
mod ready;
mod round;
mod stats;
mod touch;
mod transactions;

use stats::{stats, TopicCounts, WorkerCounters};
pub use stats::{WorkerHandle, WorkerStats};

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::clock::SharedClock;
use crate::config::Config;
use crate::hash::HashMap;
use crate::job::Job;
use crate::kafka;
use crate::producer::Producer;
use crate::sync::Lock;
use crate::worker::handler::{Backoff, Handler, Outcome};
use crate::worker::hold::Holds;
use crate::worker::lock_table::{Keyed, LockTable};
use crate::worker::offset_tracker::OffsetTracker;
use crate::worker::settle::{KafkaOutbox, RetryPolicy, Settler};
use jobs::WorkerJobs;
use poll::poll_loop;
use ready::Start;

/// Why the worker could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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
    /// The admin endpoint could not listen.
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
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
    /// Settle with this instead of running the handler (a released key's
    /// blocker is dead-lettered; a paced job whose turn is far ahead goes
    /// through the scheduler).
    instead: Option<Outcome>,
    /// Its pacing turn was handed out (it waited for it here).
    turn_given: bool,
}

impl Entry {
    fn new(job: Job, tp: Tp, offset: i64) -> Self {
        Entry {
            job,
            tp,
            offset,
            instead: None,
            turn_given: false,
        }
    }
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
    /// The claim its held-topic records and commits carry (holdable
    /// partitions only; see [`crate::worker::hold::claim`]).
    claim: Option<u64>,
}

/// Mutable state shared by the poll thread and the handler tasks.
#[derive(Default)]
struct WorkerState {
    table: LockTable<Entry>,
    tracker: OffsetTracker,
    owned: HashMap<Tp, Owned>,
    /// Running handlers per partition (revocation waits for zero).
    in_flight: HashMap<Tp, usize>,
    /// Commit points that advanced, for the poll thread to store.
    to_store: HashMap<Tp, i64>,
    next_generation: u64,
    /// Held keys of the owned partitions whose topics hold keys.
    holds: Holds<Tp>,
    /// Paced jobs waiting for their turn, and the turns handed out.
    paced: pace::Paced,
    /// Jobs started that take no concurrency slot (settled without their
    /// handler: a deferral, a released job's dead letter).
    no_slot: usize,
    /// Per held key, jobs read while its parked jobs come back, waiting in
    /// memory to run after them (not counted as buffered: what they wait
    /// for is further on in the partition).
    waiting: HashMap<(Tp, Vec<u8>), Vec<Entry>>,
    /// When the group coordinator last answered this worker: an offset
    /// commit it took, or an assignment (see `Shared::in_touch`).
    heard: Option<std::time::Instant>,
    /// Jobs are not started for want of such an answer.
    out_of_touch: bool,
    /// Exactly-once mode: per partition, the writes of its finished jobs
    /// by offset, until a transaction commits the partition past them.
    staged: HashMap<Tp, std::collections::BTreeMap<i64, Vec<crate::wire::OwnedRecord>>>,
    /// Exactly-once mode: per holdable partition, the held keys whose
    /// holds changed since a transaction last took them.
    dirty: HashMap<Tp, crate::hash::HashSet<Vec<u8>>>,
    /// Exactly-once mode: per holdable partition, the records above its
    /// committed offset that its last owner finished (read back on
    /// assignment; see [`crate::worker::hold::progress`]).
    done_above: HashMap<Tp, crate::worker::hold::progress::Done>,
}

impl WorkerState {
    /// Jobs read and not started: in the lock table, or waiting for their
    /// pacing turn.
    fn buffered(&self) -> usize {
        self.table.buffered() + self.paced.holding()
    }

    /// Handler runs going on (keys running in the lock table, less the
    /// paced jobs waiting, whose keys count as running there, and the jobs
    /// settled without their handler).
    fn running(&self) -> usize {
        self.table
            .running()
            .saturating_sub(self.paced.holding() + self.no_slot)
    }
}

/// The work topics, by index (a [`Tp`]'s first half).
struct Topics {
    names: Vec<String>,
    /// Whether each topic's keys can be held.
    holding: Vec<bool>,
    /// Each topic's pacing rules, if it is paced.
    rules: Vec<Option<crate::worker::pacing::TopicRules>>,
}

impl Topics {
    /// `topic`'s partition as a [`Tp`], if `topic` is a work topic.
    fn tp(&self, topic: &str, partition: i32) -> Option<Tp> {
        self.names.iter().position(|t| t == topic).map(|i| (i, partition))
    }
}

/// What the worker writes with.
struct Writers {
    /// Writes early jobs (routed by run-at).
    producer: Producer,
    /// Writes dead letters of records that cannot be read.
    raw: FutureProducer,
    /// Carries out outcomes: retries, follow-ups and dead letters.
    settler: Settler,
    /// Writes parked jobs and held keys.
    keeper: keeper::Keeper,
}

/// The driver tasks that run the handlers, and the runtime they run on.
struct Drivers {
    /// Where the poll thread sends jobs to start, one channel per driver.
    inboxes: Vec<tokio::sync::mpsc::UnboundedSender<Vec<Start>>>,
    /// Round-robin over the drivers.
    next: AtomicUsize,
    /// Where the poll thread runs its Kafka writes.
    runtime: tokio::runtime::Handle,
}

/// Stop and wake-ups.
struct Signals {
    stop: CancellationToken,
    /// The first fatal error met off the poll loop (in a rebalance callback).
    fatal: Mutex<Option<String>>,
    /// Wakes the pacing task when a paced job waits for an earlier turn.
    pace_wake: tokio::sync::Notify,
}

/// State shared by the poll thread, the drivers, the keeper and the pacing
/// task: each part has its owner and its own lock, if any.
struct Shared {
    /// Settings; `[worker]` as the builder set it (topics, group, concurrency).
    cfg: Config,
    clock: SharedClock,
    handler: Arc<dyn Handler>,
    /// The jobs read and running, held keys, paced jobs, offsets.
    jobs: WorkerJobs,
    topics: Topics,
    out: Writers,
    drivers: Drivers,
    signals: Signals,
    stats: WorkerCounters,
}

impl Shared {
    /// Stop the worker for `what`, which `run_until` returns.
    fn fail(&self, what: String) {
        tracing::error!(error = %what, "worker stopping");
        self.signals.fatal.locked().get_or_insert(what);
        self.signals.stop.cancel();
    }

    /// Hand jobs started by the poll thread to a driver.
    fn dispatch(&self, starts: Vec<Start>) {
        if starts.is_empty() {
            return;
        }
        let d = &self.drivers;
        let i = d.next.fetch_add(1, Ordering::Relaxed) % d.inboxes.len();
        if let Err(unsent) = d.inboxes[i].send(starts) {
            // The drivers are gone only once the worker has stopped: the jobs
            // stay unfinished and are re-delivered to the next owner.
            debug!(jobs = unsent.0.len(), "worker stopped; jobs not started");
        }
    }

    fn tp(&self, topic: &str, partition: i32) -> Option<Tp> {
        self.topics.tp(topic, partition)
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
    /// The admin endpoint, bound, served once the worker runs.
    admin: Option<crate::admin::Admin>,
    /// The drivers' ends of `Drivers::inboxes`, one each.
    driver_inboxes: Vec<tokio::sync::mpsc::UnboundedReceiver<Vec<Start>>>,
    /// The keeper task's end of `Writers::keeper`.
    keeper_inbox: tokio::sync::mpsc::UnboundedReceiver<keeper::Request>,
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
        let holds = Holds::new(w.max_held_keys)
            .give_up_after(i64::try_from(w.hold_give_up.as_millis()).unwrap_or(i64::MAX));
        let producer = Producer::from_parts(raw.clone(), &cfg, self.clock.clone())?;
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| WorkerError::Config("build the worker inside a tokio runtime".into()))?;
        let admin = crate::admin::Admin::bind(&w.admin)?;
        let (drivers, driver_inboxes) = (0..runtime.metrics().num_workers().max(1))
            .map(|_| tokio::sync::mpsc::unbounded_channel())
            .unzip();
        let (keeper, keeper_inbox) = keeper::Keeper::new();
        let outbox = Arc::new(KafkaOutbox {
            producer: producer.clone(),
            raw: raw.clone(),
            dead_letter_topic: cfg.topics.dead_letter.clone(),
        });
        Ok(Worker {
            admin,
            driver_inboxes,
            keeper_inbox,
            shared: Arc::new(Shared {
                handler: Arc::new(handler),
                jobs: WorkerJobs::new(
                    holds,
                    w.exactly_once.then(|| held_round::Naming {
                        held: cfg.topics.held.clone(),
                        topics: w.topics.clone(),
                    }),
                ),
                topics: Topics {
                    names: w.topics.clone(),
                    holding: w.topics.iter().map(|t| w.holds_keys(t)).collect(),
                    rules: w
                        .topics
                        .iter()
                        .map(|t| w.pacing.get(t).map(crate::worker::pacing::TopicRules::of))
                        .collect(),
                },
                out: Writers {
                    settler: Settler {
                        outbox: outbox.clone(),
                        policy: RetryPolicy {
                            max_attempts: w.max_attempts,
                            backoff: Backoff {
                                base: w.backoff_base,
                                max: w.backoff_max,
                            },
                        },
                        clock: self.clock.clone(),
                        staged: w.exactly_once.then_some(outbox),
                    },
                    producer,
                    raw,
                    keeper,
                },
                drivers: Drivers {
                    inboxes: drivers,
                    next: AtomicUsize::new(0),
                    runtime,
                },
                signals: Signals {
                    stop: CancellationToken::new(),
                    fatal: Mutex::new(None),
                    pace_wake: tokio::sync::Notify::new(),
                },
                clock: self.clock,
                stats: WorkerCounters {
                    by_topic: w.topics.iter().map(|_| TopicCounts::default()).collect(),
                    ..WorkerCounters::default()
                },
                cfg,
            }),
        })
    }
}

impl Worker {
    /// The worker's counters now.
    pub fn stats(&self) -> WorkerStats {
        stats(&self.shared)
    }

    /// Where the admin endpoint listens (`[worker.admin] listen`; with port
    /// 0, the port chosen), or `None` when it is off.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin.as_ref().map(crate::admin::Admin::local_addr)
    }

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
        let admin = self.admin.map(|a| {
            let source = Arc::new(WorkerHandle {
                shared: shared.clone(),
            });
            a.serve(source, shared.signals.stop.clone())
        });
        let halt = CancellationToken::new();
        for inbox in self.driver_inboxes {
            tokio::spawn(drive::drive(shared.clone(), inbox, halt.clone()));
        }
        tokio::spawn(keeper::keep(shared.clone(), self.keeper_inbox, halt.clone()));
        if shared.topics.rules.iter().any(Option::is_some) {
            tokio::spawn(ready::release_turns(shared.clone()));
        }
        let poll_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kairos-worker-poll".into())
            .spawn(move || poll_loop(&poll_shared))
            .map_err(|e| WorkerError::Fatal(e.to_string()))?;
        let stop = shared.signals.stop.clone();
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
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        let result = result?;
        info!(stats = ?stats(&shared), "worker stopped");
        if let Some(e) = shared.signals.fatal.locked().take() {
            return Err(WorkerError::Fatal(e));
        }
        result
    }
}
