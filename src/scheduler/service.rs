//! The running scheduler: ingest, dispatch and partition moves. The files
//! follow a job's way through it:
//!
//! - [`ingest`] (thread `kairos-ingest`, the consumer's): reads schedule
//!   records, decodes them, skips what was handled before, dead-letters
//!   what is malformed, claims the jobs a batch names; hands the batch over
//!   through [`lanes`] to
//! - [`apply`] (threads `kairos-apply-N`, each for a lane of partitions,
//!   started by the lane's `kairos-lane-N` and ended when quiet):
//!   resolves each change against the batch, the window's direct jobs and
//!   the store, and [`persist`]s it (changelog acknowledged, store flushed)
//!   before the batch's offsets may be committed.
//! - [`probe`] (thread `kairos-probe`): the end offsets of schedule
//!   partitions whose due jobs wait to have their partition read up to
//!   their run-at.
//! - [`dispatch`] (a task): sleeps until the earliest job in the window is
//!   due (or a sooner one arrives, the window needs a refill, or a
//!   partition has been read further), and hands due jobs to librdkafka in
//!   order; [`finish`] (a task) waits for their acknowledgements, then
//!   tombstones and deletes them.
//! - [`upkeep`] (a task): the store's cascade kept ahead, its value log
//!   compacted.
//! - [`rebalance`]: a revoked partition leaves the window first, then the
//!   callback waits for any fire in flight from it and for the batches read
//!   from it to be applied, commits, and lets go; an assigned one catches
//!   up with its changelog from its checkpoint before it enters the window
//!   or a record of it is ingested.

mod apply;
mod batch;
mod commits;
mod direct;
mod dispatch;
mod draining;
mod error;
pub use error::SchedulerError;
mod fair_release;
mod finish;
mod fire;
mod ingest;
mod jobs;
mod lanes;
mod metrics;
pub use metrics::DUE_SPANS;
mod persist;
mod probe;
mod rebalance;
mod recurring;
mod stats;
mod transactions;
mod upkeep;

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use rdkafka::config::ClientConfig;
use rdkafka::producer::FutureProducer;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::clock::SharedClock;
use crate::config::Config;
use crate::kafka;
use crate::scheduler::caught_up::CaughtUp;
use crate::scheduler::store::{Store, StoreError};
use crate::scheduler::timer_wheel::TimerWheel;
use crate::sync::Lock;
use dispatch::dispatch_loop;
use jobs::SchedulerJobs;
use probe::probe_loop;
use rebalance::SchedulerContext;
pub use stats::SchedulerStats;
use stats::{fair_status, stats, FairStatus, SchedulerCounters};
use upkeep::cascade_loop;

/// State shared by the service's threads (ingest, apply, probe) and tasks
/// (dispatch, finish, upkeep), and the rebalance callbacks: each part has
/// its owner and its own lock, if any.
struct Shared {
    /// Topics, limits and scheduler settings.
    cfg: Config,
    /// Decides what is due.
    clock: SharedClock,
    /// Pending jobs on disk.
    store: Store,
    /// The jobs in memory: the window (also the set of owned partitions),
    /// the offsets direct jobs hold back, the fire rounds in flight.
    jobs: SchedulerJobs,
    /// How far the schedule partitions are read, and the batches read on
    /// their way to be applied.
    reads: Reads,
    /// The Kafka clients the service writes and looks up with.
    kafka: Clients,
    /// Stop and wake-ups.
    signals: Signals,
    /// How many jobs fair topics may release: their backlogs, and the
    /// watch on those releasing nothing.
    fair: fair_release::FairRelease,
    /// The recurring schedules of owned partitions.
    schedules: recurring::Recurring,
    stats: SchedulerCounters,
}

/// The read side: how far each owned schedule partition is read, and what
/// was read and is not yet applied.
struct Reads {
    /// How far each owned schedule partition has been read, in time: jobs
    /// fire only up to it.
    caught_up: Mutex<CaughtUp>,
    /// Asks the probe thread to look up partition ends.
    probe: SyncSender<()>,
    /// Batches of schedule records read and not yet applied, per apply lane.
    lanes: lanes::Lanes,
    /// The partitions store writes may touch (not those let go).
    owned: draining::Owned,
    /// Fire due jobs without waiting for their partition to be read up to
    /// their run-at (benchmarks measure the rule's cost against this).
    fire_unread: std::sync::atomic::AtomicBool,
}

impl Reads {
    fn caught_up(&self) -> std::sync::MutexGuard<'_, CaughtUp> {
        self.caught_up.locked()
    }
}

/// The Kafka clients of the service, beside its consumer.
struct Clients {
    /// Writes fired jobs, changelog records and dead letters.
    producer: FutureProducer,
    /// Held while changelog records are handed to the producer: a
    /// finisher's tombstones and an apply batch's puts of the same job go
    /// to the changelog in the order their writers decided them.
    changelog_order: tokio::sync::Mutex<()>,
    /// Connection settings for changelog readers.
    reader_config: ClientConfig,
    /// Whether a job's work topic exists (a job for a missing one is dead-lettered).
    topic_check: kafka::TopicCheck,
    /// `group.instance.id` (static membership), or `None`.
    instance_id: Option<String>,
    /// Exactly-once mode: the transactions every write goes into.
    txn: Option<transactions::Transactions>,
}

/// Stop and wake-ups.
struct Signals {
    /// Wakes the dispatcher: a job due sooner, a new partition, shutdown,
    /// a cascade point moved on.
    wake: Notify,
    /// Wakes the cascader: the window could not reach a span ahead.
    cascade_wanted: Notify,
    /// Cancelled on shutdown or on a fatal error.
    stop: CancellationToken,
    /// The first fatal error, reported by `run`.
    fatal: Mutex<Option<String>>,
}

impl Shared {
    fn fail(&self, what: String) {
        error!(error = %what, "scheduler stopping");
        self.signals.fatal.locked().get_or_insert(what);
        self.signals.stop.cancel();
        self.signals.wake.notify_one();
    }
}

/// The scheduler service: a consumer-group member that holds the schedule
/// topic's jobs on disk and fires each into its work topic at its run-at.
///
/// ```no_run
/// # async fn demo(cfg: kairos::Config) -> Result<(), kairos::scheduler::SchedulerError> {
/// use futures::FutureExt;
///
/// let scheduler = kairos::Scheduler::builder(&cfg).build()?;
/// let handle = scheduler.handle();
/// tokio::spawn(async move {
///     loop {
///         tokio::time::sleep(std::time::Duration::from_secs(60)).await;
///         println!("{} jobs pending", handle.stats().pending);
///     }
/// });
/// scheduler.run_until(tokio::signal::ctrl_c().map(|_| ())).await?;
/// # Ok(()) }
/// ```
pub struct Scheduler {
    shared: Arc<Shared>,
    /// The admin endpoint, bound, served once the scheduler runs.
    admin: Option<crate::admin::Admin>,
    /// The probe thread's end of `Shared::probe`.
    probe_inbox: Receiver<()>,
}

/// Builds a [`Scheduler`].
pub struct SchedulerBuilder {
    cfg: Config,
    clock: SharedClock,
}

impl SchedulerBuilder {
    /// The clock that decides when jobs are due (tests inject a
    /// [`crate::ManualClock`]; default: the system clock).
    pub fn clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Open the store (`scheduler.data_dir`) and create the Kafka clients.
    pub fn build(self) -> Result<Scheduler, SchedulerError> {
        Scheduler::open(&self.cfg, self.clock)
    }
}

impl Scheduler {
    /// Start building a scheduler from configuration (`[scheduler]` and the rest).
    pub fn builder(cfg: &Config) -> SchedulerBuilder {
        SchedulerBuilder {
            cfg: cfg.clone(),
            clock: crate::clock::system(),
        }
    }

    fn open(cfg: &Config, clock: SharedClock) -> Result<Self, SchedulerError> {
        let s = &cfg.scheduler;
        std::fs::create_dir_all(&s.data_dir).map_err(|e| StoreError::Sled(e.into()))?;
        let store = Store::open_with_clock(&s.data_dir, s.cache_capacity, clock.clone())?;
        // After the store: its lock keeps a second process off this directory.
        let instance_id = super::instance::group_instance_id(cfg)?;
        let producer = kafka::producer(&cfg.kafka, "kairos-scheduler")?;
        let txn = match s.exactly_once {
            true => {
                let id = super::instance::transactional_id(cfg)?;
                Some(transactions::Transactions::start(cfg, &id)?)
            }
            false => None,
        };
        let wheel = TimerWheel::new(s.window.as_millis() as i64, s.window_capacity);
        let mut fair = None;
        if !cfg.fair.topics.is_empty() {
            let f = &cfg.fair;
            let weights = crate::scheduler::fair::Weights {
                default: f.default_weight,
                tenants: f.weights.iter().map(|(t, w)| (t.clone(), *w)).collect(),
            };
            let now_ms = clock.now().timestamp_millis();
            // Fair jobs buffered: a share of the window's capacity.
            let buffered = (s.window_capacity / 4).max(crate::scheduler::fair::LANE_JOBS);
            fair = Some(crate::scheduler::fair::FairWindow::new(
                &f.topics,
                weights,
                f.half_life.as_millis() as i64,
                buffered,
                now_ms,
            ));
        }
        let (probe, probe_inbox) = std::sync::mpsc::sync_channel(1);
        let admin = crate::admin::Admin::bind(&s.admin)?;
        Ok(Scheduler {
            admin,
            probe_inbox,
            shared: Arc::new(Shared {
                cfg: cfg.clone(),
                clock,
                store,
                jobs: SchedulerJobs::new(wheel, fair),
                reads: Reads {
                    caught_up: Mutex::new(CaughtUp::new(s.max_clock_skew.as_millis() as i64)),
                    probe,
                    lanes: lanes::Lanes::new(s.apply_threads),
                    owned: draining::Owned::default(),
                    fire_unread: std::sync::atomic::AtomicBool::new(false),
                },
                kafka: Clients {
                    producer,
                    changelog_order: tokio::sync::Mutex::new(()),
                    reader_config: kafka::base_config(&cfg.kafka, "kairos-changelog-reader"),
                    topic_check: kafka::TopicCheck::new(&cfg.kafka)?,
                    instance_id,
                    txn,
                },
                signals: Signals {
                    wake: Notify::new(),
                    cascade_wanted: Notify::new(),
                    stop: CancellationToken::new(),
                    fatal: Mutex::new(None),
                },
                fair: fair_release::FairRelease::new(&cfg.fair.topics),
                schedules: recurring::Recurring::default(),
                stats: SchedulerCounters::default(),
            }),
        })
    }

    /// What the scheduler holds and has done.
    pub fn stats(&self) -> SchedulerStats {
        stats(&self.shared)
    }

    /// Where the admin endpoint listens (`[scheduler.admin] listen`; with
    /// port 0, the port chosen), or `None` when it is off.
    pub fn admin_addr(&self) -> Option<std::net::SocketAddr> {
        self.admin.as_ref().map(crate::admin::Admin::local_addr)
    }

    /// The id this instance joins its group with as a static member
    /// (`group.instance.id`, also when `[kafka.consumer]` sets it), or
    /// `None` for dynamic membership.
    pub fn instance_id(&self) -> Option<&str> {
        let configured = || self.shared.cfg.kafka.consumer.get("group.instance.id");
        self.shared
            .kafka
            .instance_id
            .as_deref()
            .or_else(|| configured().map(|v| v.0.as_str()))
    }

    /// Wake the dispatcher to look at the clock again (tests that drive a
    /// manual clock call this after moving it).
    pub fn wake(&self) {
        self.shared.signals.wake.notify_one();
    }

    /// Fire due jobs as soon as they are due, without first reading their
    /// schedule partition up to their run-at: a cancel written before the
    /// run-at but not yet read then loses. Not for production; benchmarks
    /// measure what the rule costs against it.
    #[doc(hidden)]
    pub fn fire_unread(self) -> Self {
        self.shared.reads.fire_unread.store(true, Ordering::Relaxed);
        self
    }

    /// A handle for reading counters and waking the dispatcher while
    /// [`Scheduler::run_until`] goes on.
    pub fn handle(&self) -> SchedulerHandle {
        SchedulerHandle {
            shared: self.shared.clone(),
        }
    }

    /// Run until `shutdown` completes (or a fatal error): consume, persist,
    /// fire. On shutdown, the fire in flight finishes and stored offsets are
    /// committed. A dynamic member then leaves the group, so its partitions
    /// move at once; a static member (the default) keeps them until it
    /// comes back or `scheduler.session_timeout` has passed.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), SchedulerError> {
        let shared = self.shared;
        let admin = self.admin.map(|a| {
            let source = Arc::new(SchedulerHandle {
                shared: shared.clone(),
            });
            a.serve(source, shared.signals.stop.clone())
        });
        let ingest_shared = shared.clone();
        let ingest = std::thread::Builder::new()
            .name("kairos-ingest".into())
            .spawn(move || {
                if let Err(e) = ingest::ingest_loop(&ingest_shared) {
                    ingest_shared.fail(e.to_string());
                }
            })
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        let inbox = self.probe_inbox;
        let probe_shared = shared.clone();
        let prober = std::thread::Builder::new()
            .name("kairos-probe".into())
            .spawn(move || probe_loop(&probe_shared, inbox))
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        let backlogger = if shared.cfg.fair.topics.is_empty() {
            None
        } else {
            let b = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("kairos-backlog".into())
                    .spawn(move || fair_release::backlog_loop(&b, b.fair.backlog()))
                    .map_err(|e| SchedulerError::Fatal(e.to_string()))?,
            )
        };
        let recurring_shared = shared.clone();
        let recurring = std::thread::Builder::new()
            .name("kairos-schedules".into())
            .spawn(move || recurring::run(&recurring_shared))
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        let stop = shared.signals.stop.clone();
        let warm = shared.clone();
        // The topics the producer writes: the changelog, the dead-letter
        // topic and the configured work topics, looked up once (the answer is
        // cached for the first fires) and, where they exist, the producer
        // warmed, so the first writes after a start do not wait for metadata.
        tokio::spawn(async move {
            let t = &warm.cfg.topics;
            if crate::topics::schedule_has_append_time(&warm.cfg).await == Some(false) {
                warn!(
                    topic = %t.schedule,
                    "the schedule topic's records carry their producers' times (CreateTime): \
                     they are not trusted, so a due job waits for a look-up of its partition's end \
                     before it fires; set message.timestamp.type=LogAppendTime on the topic \
                     (kairos topics init does on the topics it creates)"
                );
            }
            let topics = [&t.changelog, &t.dead_letter].into_iter().chain(&t.work);
            for t in topics {
                if warm.signals.stop.is_cancelled() {
                    break;
                }
                if let Ok(true) = warm.kafka.topic_check.exists(t).await {
                    kafka::warm_up(&warm.kafka.producer, t, warm.cfg.kafka.produce_timeout).await;
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
                shared.signals.wake.notify_one();
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
        tokio::task::spawn_blocking(move || recurring.join())
            .await
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?
            .map_err(|_| SchedulerError::Fatal("recurring schedules thread panicked".into()))?;
        if let Some(b) = backlogger {
            tokio::task::spawn_blocking(move || b.join())
                .await
                .map_err(|e| SchedulerError::Fatal(e.to_string()))?
                .map_err(|_| SchedulerError::Fatal("backlog thread panicked".into()))?;
        }
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        if let Some(e) = shared.signals.fatal.locked().take() {
            return Err(SchedulerError::Fatal(e));
        }
        info!(stats = ?stats(&shared), "scheduler stopped");
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
    pub fn stats(&self) -> SchedulerStats {
        stats(&self.shared)
    }

    /// Wake the dispatcher to look at the clock again.
    pub fn wake(&self) {
        self.shared.signals.wake.notify_one();
    }
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
