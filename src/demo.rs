//! `kairos demo`: the whole system on one machine, visible on the terminal.
//!
//! Starts a development broker (unless one is given), the scheduler and a
//! worker running the [example handler](crate::example), writes sample jobs
//! for a few dozen keys (some due now, most delayed by a few seconds, some
//! failing once and retried, a few failing for good, a few cancelled or
//! rescheduled before their run-at), and prints what happens, then a summary
//! that checks the guarantees: nothing lost, nothing early, no two jobs of a
//! key at once, each key's jobs in order, cancels and reschedules obeyed.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::dev_broker::DevBroker;
use kairos::config::Config;
use kairos::scheduler::Scheduler;
use kairos::worker::{Outcome, Worker};
use kairos::{Job, JobId, Producer};

mod exactly_once;
mod fair;
mod held;
mod operator;
mod recurring;
mod sample;
mod summary;

pub use exactly_once::ExactlyOnceSeen;
pub use fair::TenantWaits;
pub use recurring::RecurringSeen;

/// Options of the demo.
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// Jobs to write.
    pub jobs: usize,
    /// Distinct keys.
    pub keys: usize,
    /// Longest delay of a delayed job.
    pub max_delay: Duration,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            jobs: 300,
            keys: 30,
            max_delay: Duration::from_secs(8),
        }
    }
}

/// What the demo saw.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DemoSummary {
    /// Jobs written.
    pub written: usize,
    /// Jobs that finished done.
    pub done: usize,
    /// Jobs dead-lettered.
    pub dead: usize,
    /// Handler runs that failed and were retried.
    pub retries: usize,
    /// Runs that started before their run-at (must be 0).
    pub early: usize,
    /// Runs of a key that started while another of the key ran (must be 0).
    pub overlaps: usize,
    /// First attempts of a key that started out of run-at order (must be 0).
    pub out_of_order: usize,
    /// Start lateness (start minus run-at) of delayed first attempts: p50, p99, max, in ms.
    pub lateness_ms: (i64, i64, i64),
    /// Delayed jobs cancelled before their run-at.
    pub cancelled: usize,
    /// Delayed jobs moved later before their run-at.
    pub rescheduled: usize,
    /// Runs of cancelled jobs, and runs of rescheduled jobs at their old
    /// time or more than once (must be 0).
    pub changes_ignored: usize,
    /// The fair topic: per tenant, jobs started and their wait p50 / max.
    pub fair_waits: TenantWaits,
    /// The held key's starts, by job number (1, 2, 2, 2, 3, 4, 5: job 2
    /// failing twice holds the key).
    pub held_key: Vec<u32>,
    /// The exactly-once worker: jobs, follow-ups read back once and more
    /// than once, transactions.
    pub exactly_once: ExactlyOnceSeen,
    /// The recurring schedule: occurrences, fired once, fired more than once.
    pub recurring: RecurringSeen,
    /// The demo's own topics (deleted at the end on a real cluster).
    pub topics: Vec<String>,
}

/// How much later the demo's rescheduled jobs run.
const MOVED_BY_MS: i64 = 2_000;

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DemoError(String);

fn failed(e: impl std::fmt::Display) -> DemoError {
    DemoError(e.to_string())
}

/// When a run started and ended.
type Interval = (DateTime<Utc>, DateTime<Utc>);

/// One handler run, as the worker reports it to the demo.
struct RunEvent {
    job: Job,
    started: DateTime<Utc>,
    ended: DateTime<Utc>,
    outcome: Outcome,
}

/// Run the demo. With `brokers = None` an in-process development broker
/// serves. Its topics and groups have names of its own (`kairos-demo-` and a
/// random suffix), so that on a real cluster it never reads or fires what
/// another Kairos there holds; there it deletes its topics at the end.
pub async fn run(
    mut cfg: Config,
    opts: DemoOptions,
    brokers: Option<String>,
) -> Result<DemoSummary, DemoError> {
    let prefix = format!("kairos-demo-{:08x}", rand::random::<u32>());
    own_names(&mut cfg, &prefix);
    // A second work topic, dispatched fairly across tenants, a third,
    // whose failing jobs hold their keys, and one run by a worker in
    // exactly-once mode (with the topic its jobs' follow-ups go to), and
    // the one a recurring schedule's occurrences go to.
    let work = cfg.topics.work.first().cloned().unwrap_or_default();
    let (fair_topic, held_topic) = (format!("{work}.fair"), format!("{work}.orders"));
    let (eos_topic, follow_topic) = (format!("{work}.invoices"), format!("{work}.invoices.sent"));
    cfg.topics.work.extend([
        fair_topic.clone(),
        held_topic.clone(),
        eos_topic,
        follow_topic,
        format!("{work}.reports"),
    ]);
    let on_cluster = brokers.is_some();
    if let Some(b) = brokers {
        cfg.kafka.brokers = b;
    }
    let result = run_on(cfg.clone(), opts, on_cluster, fair_topic, held_topic).await;
    if on_cluster {
        match kairos::topics::delete(&cfg).await {
            Ok(gone) => println!("cleanup    deleted the demo's {} topics ({prefix}.*)", gone.len()),
            Err(e) => println!("cleanup    could not delete the demo's topics ({prefix}.*): {e}"),
        }
    }
    result.map(|s| DemoSummary {
        topics: kairos::topics::planned(&cfg)
            .into_iter()
            .map(|(t, _)| t)
            .collect(),
        ..s
    })
}

/// Give every topic and group the demo uses a name under `prefix`.
fn own_names(cfg: &mut Config, prefix: &str) {
    let t = &mut cfg.topics;
    t.schedule = format!("{prefix}.schedule");
    t.changelog = format!("{prefix}.changelog");
    t.dead_letter = format!("{prefix}.dead");
    t.schedules = format!("{prefix}.schedules");
    t.schedule_cursors = format!("{prefix}.schedules.cursors");
    t.held = format!("{prefix}.held");
    t.work = vec![format!("{prefix}.jobs")];
    cfg.scheduler.group_id = format!("{prefix}-scheduler");
    cfg.worker.group_id = format!("{prefix}-worker");
}

async fn run_on(
    mut cfg: Config,
    opts: DemoOptions,
    on_cluster: bool,
    fair_topic: String,
    held_topic: String,
) -> Result<DemoSummary, DemoError> {
    let data = std::env::temp_dir().join(format!("kairos-demo-{}", std::process::id()));
    cfg.scheduler.data_dir = data.join("scheduler");
    cfg.worker.max_attempts = 3;
    cfg.worker.backoff_base = Duration::from_millis(500);
    cfg.worker.concurrency = 32;
    if cfg.kafka.group_protocol == kairos::config::GroupProtocol::Classic {
        // Under the consumer protocol the broker keeps the session.
        cfg.kafka
            .consumer
            .insert("session.timeout.ms".into(), "6000".into());
    }
    cfg.fair.topics = vec![fair_topic.clone()];
    cfg.worker
        .on_failure_by_topic
        .insert(held_topic.clone(), kairos::config::OnFailure::HoldKey);
    cfg.fair.backlog_target = 200;
    let _dev = if on_cluster {
        println!(
            "broker     {} (real cluster; the demo's own topics {}.*, deleted at the end)",
            cfg.kafka.brokers,
            cfg.topics.schedule.trim_end_matches(".schedule")
        );
        kairos::topics::init(&cfg).await.map_err(failed)?;
        None
    } else {
        let dev = DevBroker::start(&cfg).map_err(failed)?;
        cfg.kafka.brokers = dev.bootstrap_servers().to_string();
        // The mock cluster answers a fetch only when its wait expires,
        // not when data arrives as Kafka does: keep the wait short.
        cfg.kafka.consumer.insert("fetch.wait.max.ms".into(), "5".into());
        println!(
            "broker     development broker at {} (librdkafka's in-process mock cluster, in memory;\n           \
             run with --brokers HOST:PORT to use a real Kafka cluster)",
            cfg.kafka.brokers
        );
        Some(dev)
    };
    let work = cfg
        .topics
        .work
        .first()
        .cloned()
        .ok_or_else(|| failed("no work topic configured"))?;
    cfg.worker.topics = vec![
        work.clone(),
        fair_topic.clone(),
        held_topic.clone(),
        format!("{work}.reports"),
    ];

    // Admin endpoints on free local ports, unless configured.
    for admin in [&mut cfg.scheduler.admin, &mut cfg.worker.admin] {
        if admin.listen.is_none() {
            admin.listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        }
    }
    let stop = CancellationToken::new();
    let scheduler = Scheduler::builder(&cfg).build().map_err(failed)?;
    let sched_admin = scheduler.admin_addr();
    let member = scheduler
        .instance_id()
        .map_or("a dynamic member".to_string(), |id| format!("static member {id}"));
    let sched = scheduler.handle();
    let st = stop.clone();
    let sched_task = tokio::spawn(scheduler.run_until(async move { st.cancelled().await }));
    println!(
        "scheduler  started as {member} (a restart takes its partitions back at once);\n           \
         pending jobs kept in {}",
        cfg.scheduler.data_dir.display()
    );

    let (tx, mut rx) = mpsc::unbounded_channel::<RunEvent>();
    let (fair_tx, mut fair_rx) = mpsc::unbounded_channel::<fair::FairStart>();
    let (held_tx, mut held_rx) = mpsc::unbounded_channel::<held::HeldStart>();
    let fair_jobs = fair_topic.clone();
    let held_jobs = held_topic.clone();
    let worker = Worker::builder(&cfg)
        .build(move |job: Job, ctx| {
            let tx = tx.clone();
            let fair_tx = (job.topic == fair_jobs).then(|| fair_tx.clone());
            let held_tx = (job.topic == held_jobs).then(|| held_tx.clone());
            async move {
                let started = Utc::now();
                if let Some(held_tx) = held_tx {
                    let _ = held_tx.send(held::HeldStart {
                        key: job.key_lossy().into_owned(),
                        n: String::from_utf8_lossy(&job.payload).parse().unwrap_or(0),
                        attempt: job.attempt,
                        at: started,
                    });
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    return held::outcome(&job);
                }
                if let Some(fair_tx) = fair_tx {
                    let _ = fair_tx.send(fair::FairStart {
                        tenant: job.tenant.clone().unwrap_or_default(),
                        run_at: job.run_at,
                        started,
                    });
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    return Outcome::done();
                }
                let outcome = crate::example::handle(job.clone(), ctx, None).await;
                let _ = tx.send(RunEvent {
                    job,
                    started,
                    ended: Utc::now(),
                    outcome: outcome.clone(),
                });
                outcome
            }
        })
        .map_err(failed)?;
    let wh = worker.handle();
    let worker_admin = worker.admin_addr();
    if let (Some(s), Some(w)) = (sched_admin, worker_admin) {
        println!(
            "admin      scheduler dashboard http://{s}/ (and /metrics, /status, /readyz), worker http://{w}/metrics"
        );
    }
    let st = stop.clone();
    let worker_task = tokio::spawn(worker.run_until(async move { st.cancelled().await }));
    println!(
        "worker     started; concurrency {}, up to 3 attempts per job",
        cfg.worker.concurrency
    );

    let ready = std::time::Instant::now() + Duration::from_secs(60);
    while sched.stats().owned.len() < cfg.topics.schedule_partitions as usize || wh.stats().owned == 0 {
        if std::time::Instant::now() > ready {
            return Err(failed(
                "scheduler and worker did not get their partitions within 60 s",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let producer = Producer::new(&cfg).map_err(failed)?;
    let sample::Sample {
        jobs,
        delayed_from,
        cancelled,
        moved,
    } = sample::write(&producer, &work, &opts).await?;
    let written: HashMap<JobId, &Job> = jobs.iter().map(|j| (j.id, j)).collect();
    if let (Some(addr), Some(example)) = (sched_admin, moved.keys().next()) {
        operator::held(&cfg, &sched, addr, jobs.len() - jobs.len().div_ceil(5), *example).await?;
    }
    println!(
        "{:<13} {:<9} {:<9} {:>7} {:>9}  outcome",
        "started", "key", "job", "attempt", "late"
    );

    let mut s = DemoSummary {
        written: jobs.len(),
        cancelled: cancelled.len(),
        rescheduled: moved.len(),
        ..Default::default()
    };
    let mut moved_runs: HashSet<JobId> = HashSet::new();
    let mut ran_cancelled = 0;
    let expected = written.len() - cancelled.len();
    let mut finished: HashSet<JobId> = HashSet::new();
    let mut runs: HashMap<Vec<u8>, Vec<Interval>> = HashMap::new();
    let mut last_first_attempt: HashMap<Vec<u8>, DateTime<Utc>> = HashMap::new();
    let mut late: Vec<i64> = Vec::new();
    let mut shown = 0;
    let deadline = tokio::time::Instant::now() + opts.max_delay + Duration::from_secs(60);
    while finished.len() < expected {
        let ev = match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(ev)) => ev,
            _ => break,
        };
        let job = &ev.job;
        let Some(original) = written.get(&job.id) else {
            continue;
        };
        if cancelled.contains(&job.id) {
            s.changes_ignored += 1;
            ran_cancelled += 1;
            println!(
                "{:<13} {:<9} cancelled job ran",
                ev.started.format("%H:%M:%S%.3f"),
                job.key_lossy()
            );
        }
        if let Some(at) = moved.get(&job.id) {
            if job.attempt == 1 && (job.run_at != *at || !moved_runs.insert(job.id)) {
                s.changes_ignored += 1;
                println!(
                    "{:<13} {:<9} rescheduled job ran at its old time or twice",
                    ev.started.format("%H:%M:%S%.3f"),
                    job.key_lossy()
                );
            }
        }
        let late_ms = (ev.started - job.run_at).num_milliseconds();
        if late_ms < 0 {
            s.early += 1;
        }
        runs.entry(job.key.clone())
            .or_default()
            .push((ev.started, ev.ended));
        if job.attempt == 1 {
            if original.run_at >= delayed_from {
                late.push(late_ms);
            }
            if let Some(prev) = last_first_attempt.insert(job.key.clone(), job.run_at) {
                if prev > job.run_at {
                    s.out_of_order += 1;
                }
            }
        }
        let what = match &ev.outcome {
            Outcome::Done { .. } => {
                s.done += 1;
                finished.insert(job.id);
                "done".to_string()
            }
            Outcome::Retry { .. } if job.attempt >= cfg.worker.max_attempts => {
                s.dead += 1;
                finished.insert(job.id);
                format!("failed; dead-lettered after {} attempts", job.attempt)
            }
            Outcome::Retry { .. } => {
                s.retries += 1;
                "failed; retry scheduled with backoff".to_string()
            }
            Outcome::Dead { .. } => {
                s.dead += 1;
                finished.insert(job.id);
                "dead-lettered".to_string()
            }
            Outcome::RateLimited { until } => format!("rate limited until {}", until.format("%H:%M:%S%.3f")),
            other => format!("{other:?}"),
        };
        let interesting = job.attempt > 1 || !matches!(ev.outcome, Outcome::Done { .. });
        if shown < 12 || interesting || finished.len().is_multiple_of(50) {
            shown += 1;
            let label = String::from_utf8_lossy(&job.payload);
            let label = label.split_whitespace().next().unwrap_or("");
            println!(
                "{:<13} {:<9} {:<9} {:>7} {:>7}ms  {}",
                ev.started.format("%H:%M:%S%.3f"),
                job.key_lossy(),
                label,
                job.attempt,
                late_ms,
                what
            );
        }
    }
    for intervals in runs.values_mut() {
        intervals.sort();
        s.overlaps += intervals.windows(2).filter(|w| w[1].0 < w[0].1).count();
    }
    s.fair_waits = fair::show(&producer, &fair_topic, &mut fair_rx).await?;
    s.held_key = held::show(&producer, &held_topic, &mut held_rx).await?;
    let (eos_topic, follow_topic) = (format!("{work}.invoices"), format!("{work}.invoices.sent"));
    s.exactly_once = exactly_once::show(&cfg, &producer, &eos_topic, &follow_topic).await?;
    let reports = format!("{work}.reports");
    s.recurring = recurring::show(&cfg, &reports, sched_admin, &wh).await?;
    let ws = wh.stats();
    // The exactly-once worker's topics belong to a group of its own, and
    // the last report may still run: the operator's view of the main
    // worker's group leaves them out.
    let mut main_group = cfg.clone();
    main_group
        .topics
        .work
        .retain(|t| !t.starts_with(&eos_topic) && *t != reports);
    operator::after_run(&main_group, sched_admin, worker_admin).await?;
    stop.cancel();
    worker_task.await.map_err(failed)?.map_err(failed)?;
    sched_task.await.map_err(failed)?.map_err(failed)?;
    let _ = std::fs::remove_dir_all(&data);
    late.sort_unstable();
    let pct = |q: f64| {
        late.get(((late.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    s.lateness_ms = (pct(0.5), pct(0.99), late.last().copied().unwrap_or(0));
    summary::print(
        &s,
        summary::Tally {
            lost: expected.saturating_sub(finished.len()),
            ran_cancelled,
            moved_ran: moved_runs.len(),
            started: ws.started,
            owned: ws.owned,
        },
    );
    if finished.len() != expected
        || s.early > 0
        || s.out_of_order > 0
        || s.overlaps > 0
        || s.changes_ignored > 0
        || moved_runs.len() != moved.len()
        || s.held_key != [1, 2, 2, 2, 3, 4, 5]
        || s.exactly_once.once != s.exactly_once.jobs
        || s.exactly_once.extra > 0
        || s.exactly_once.held_key != [7, 7, 17, 27, 37, 47]
        || s.recurring.once != s.recurring.occurrences
        || s.recurring.extra > 0
    {
        return Err(failed(
            "the demo saw lost, early or out-of-order jobs, an ignored cancel or reschedule, a held key \
             out of order, a follow-up missing or written twice, or an occurrence missing or fired twice",
        ));
    }
    Ok(s)
}
