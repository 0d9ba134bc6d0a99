//! `kairos demo`: the whole system on one machine, visible on the terminal.
//!
//! Starts a development broker (unless one is given), the scheduler, writes
//! sample jobs for a few dozen keys (some due now, most delayed by a few
//! seconds), and prints each job as it arrives on its work topic with how
//! late it fired, then a summary: jobs seen, early fires (must be zero),
//! lateness percentiles, per-key order.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::time::Duration;

use chrono::Utc;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::Message;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::dev_broker::DevBroker;
use crate::scheduler::Scheduler;
use crate::wire::{self, Context, RecordView};
use crate::{Job, JobId, Producer};

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
#[derive(Clone, Debug, Default)]
pub struct DemoSummary {
    /// Jobs written.
    pub written: usize,
    /// Distinct jobs seen on the work topic.
    pub seen: usize,
    /// Jobs that arrived before their run-at (must be 0).
    pub early: usize,
    /// Jobs of a key seen out of run-at order.
    pub out_of_order: usize,
    /// Lateness percentiles (p50, p99, max) in milliseconds, over delayed jobs.
    pub lateness_ms: (i64, i64, i64),
}

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// Something the demo drives failed.
    #[error("{0}")]
    Failed(String),
}

fn failed(e: impl std::fmt::Display) -> DemoError {
    DemoError::Failed(e.to_string())
}

/// Run the demo. With `brokers = None` an in-process development broker serves.
pub async fn run(
    mut cfg: Config,
    opts: DemoOptions,
    brokers: Option<String>,
) -> Result<DemoSummary, DemoError> {
    let data = tempdir()?;
    cfg.scheduler.data_dir = data.join("scheduler");
    cfg.scheduler.group_id = format!("kairos-demo-{}", std::process::id());
    cfg.kafka
        .consumer
        .insert("session.timeout.ms".into(), "6000".into());
    let _dev = match brokers {
        Some(b) => {
            cfg.kafka.brokers = b;
            println!("broker: {} (topics init)", cfg.kafka.brokers);
            crate::topics::init(&cfg).await.map_err(failed)?;
            None
        }
        None => {
            let dev = DevBroker::start(&cfg).map_err(failed)?;
            cfg.kafka.brokers = dev.bootstrap_servers().to_string();
            println!(
                "broker: development broker (librdkafka mock cluster, in memory) at {}\n        \
                 pass --brokers HOST:PORT to use a real Kafka cluster",
                cfg.kafka.brokers
            );
            Some(dev)
        }
    };
    let work = cfg
        .topics
        .work
        .first()
        .cloned()
        .ok_or_else(|| failed("no work topic configured"))?;

    let scheduler = Scheduler::new(&cfg, crate::clock::system()).map_err(failed)?;
    let handle = scheduler.handle();
    let stop = CancellationToken::new();
    let sched_stop = stop.clone();
    let sched = tokio::spawn(scheduler.run(async move { sched_stop.cancelled().await }));
    println!(
        "scheduler: started, store in {}",
        cfg.scheduler.data_dir.display()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while handle.status().owned.len() < cfg.topics.schedule_partitions as usize {
        if std::time::Instant::now() > deadline {
            return Err(failed("the scheduler did not get its partitions within 60 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("scheduler: owns partitions {:?}", handle.status().owned);

    // The observer reads the work topic from the start.
    let observer: BaseConsumer = crate::kafka::base_config(&cfg.kafka, "kairos-demo-observer")
        .set("group.id", format!("kairos-demo-observer-{}", std::process::id()))
        .set("auto.offset.reset", "earliest")
        .create()
        .map_err(failed)?;
    observer.subscribe(&[&work]).map_err(failed)?;

    let producer = Producer::new(&cfg).map_err(failed)?;
    let start = Utc::now();
    // Delayed jobs start 2 s out, so that all are still in the future when written.
    let now = start + chrono::Duration::seconds(2);
    let mut jobs = Vec::new();
    let mut delayed = 0;
    for i in 0..opts.jobs {
        let key = format!("user-{:03}", i % opts.keys.max(1));
        let at = if i % 5 == 0 {
            Utc::now()
        } else {
            delayed += 1;
            let ms = (i as u64 * 7919) % (opts.max_delay.as_millis() as u64).max(1);
            now + chrono::Duration::milliseconds(ms as i64)
        };
        let job = Job::new(&work, key, format!("job #{i}").into_bytes())
            .tenant(format!("tenant-{}", i % 3))
            .at(at);
        jobs.push(job);
    }
    let writes = jobs.iter().map(|j| producer.enqueue(j.clone()).into_future());
    let mut written: HashMap<JobId, chrono::DateTime<Utc>> = HashMap::new();
    for (job, r) in jobs.iter().zip(futures::future::join_all(writes).await) {
        r.map_err(failed)?;
        written.insert(job.id, job.run_at);
    }
    println!(
        "producer: wrote {} jobs for {} keys ({} due now, {} delayed up to {:?})\n",
        opts.jobs,
        opts.keys,
        opts.jobs - delayed,
        delayed,
        opts.max_delay
    );
    println!(
        "{:<12} {:<10} {:<38} {:>8} {:>9}",
        "arrived", "key", "job id", "delay", "late"
    );

    let mut summary = DemoSummary {
        written: opts.jobs,
        ..Default::default()
    };
    let mut late: Vec<i64> = Vec::new();
    let mut last_per_key: HashMap<Vec<u8>, chrono::DateTime<Utc>> = HashMap::new();
    let mut seen: std::collections::HashSet<JobId> = Default::default();
    let limits = cfg.limits;
    let deadline = std::time::Instant::now() + opts.max_delay + Duration::from_secs(60);
    while seen.len() < written.len() && std::time::Instant::now() < deadline {
        let msg = match tokio::task::block_in_place(|| observer.poll(Duration::from_millis(100))) {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(failed(e)),
            None => continue,
        };
        let arrived = Utc::now();
        let Ok(wire::Command::Schedule(job)) =
            wire::decode(&RecordView::from_message(&msg), Context::Work, &limits)
        else {
            continue;
        };
        let Some(run_at) = written.get(&job.id).copied() else {
            continue;
        };
        if !seen.insert(job.id) {
            continue;
        }
        let written_ms = msg.timestamp().to_millis().unwrap_or(arrived.timestamp_millis());
        let late_ms = written_ms - run_at.timestamp_millis();
        if late_ms < 0 {
            summary.early += 1;
        }
        let delay = (run_at - start).num_milliseconds();
        if run_at >= now {
            late.push(late_ms);
        }
        if let Some(prev) = last_per_key.insert(job.key.clone(), run_at) {
            if prev > run_at {
                summary.out_of_order += 1;
            }
        }
        if seen.len() <= 15 || seen.len() % 25 == 0 || seen.len() == written.len() {
            println!(
                "{:<12} {:<10} {:<38} {:>7}ms {:>7}ms",
                arrived.format("%H:%M:%S%.3f"),
                job.key_lossy(),
                job.id.to_string(),
                delay,
                late_ms
            );
        }
    }
    summary.seen = seen.len();
    late.sort_unstable();
    let pct = |q: f64| {
        late.get(((late.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0)
    };
    summary.lateness_ms = (pct(0.5), pct(0.99), late.last().copied().unwrap_or(0));
    stop.cancel();
    sched.await.map_err(failed)?.map_err(failed)?;
    let _ = std::fs::remove_dir_all(&data);
    println!(
        "\nsummary: {}/{} jobs arrived, {} early, {} out of per-key order; \
         lateness of delayed jobs p50 {} ms, p99 {} ms, max {} ms",
        summary.seen,
        summary.written,
        summary.early,
        summary.out_of_order,
        summary.lateness_ms.0,
        summary.lateness_ms.1,
        summary.lateness_ms.2
    );
    if summary.seen != summary.written || summary.early > 0 || summary.out_of_order > 0 {
        return Err(failed("the demo saw lost, early or out-of-order jobs"));
    }
    Ok(summary)
}

fn tempdir() -> Result<std::path::PathBuf, DemoError> {
    let dir = std::env::temp_dir().join(format!("kairos-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(failed)?;
    Ok(dir)
}
