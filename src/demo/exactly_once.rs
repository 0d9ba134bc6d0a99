//! The demo's exactly-once settlement: a second worker, with `[worker]
//! exactly_once`, runs jobs whose handler writes a follow-up, on a topic
//! whose failing jobs hold their keys (one job fails once); the follow-ups
//! are read back as `read_committed` consumers see them, once per job, and
//! the held key's jobs ran in order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::Message as _;
use tokio_util::sync::CancellationToken;

use super::{failed, DemoError};
use kairos::worker::{Outcome, Worker};
use kairos::{Config, Job, Producer};

/// Jobs written to the exactly-once topic.
const JOBS: usize = 50;

/// The key one of whose jobs fails once, holding it.
const HELD: &str = "invoice-7";

/// What the exactly-once part saw: jobs written, jobs whose follow-up was
/// read back once, follow-ups read back more than once (must be 0), and
/// the worker's transactions committed.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExactlyOnceSeen {
    /// Jobs written.
    pub jobs: usize,
    /// Jobs whose follow-up was read back exactly once.
    pub once: usize,
    /// Follow-ups read back beyond the first of their job (must be 0).
    pub extra: usize,
    /// Transactions the worker committed.
    pub transactions: u64,
    /// The held key's job numbers, in the order they started (its first
    /// job fails once: it runs twice before the others).
    pub held_key: Vec<u32>,
    /// Jobs parked behind the held key.
    pub parked: u64,
}

/// Run a worker in exactly-once mode on `topic` (its own group and
/// transactional id), write [`JOBS`] jobs that each write a follow-up to
/// `follow`, and read the follow-ups back.
pub(super) async fn show(
    cfg: &Config,
    producer: &Producer,
    topic: &str,
    follow: &str,
) -> Result<ExactlyOnceSeen, DemoError> {
    let mut cfg = cfg.clone();
    cfg.worker.exactly_once = true;
    cfg.worker.group_id = format!("{}-eos", cfg.worker.group_id);
    cfg.worker.transactional_id = cfg.worker.group_id.clone();
    cfg.worker.topics = vec![topic.to_string()];
    cfg.worker
        .on_failure_by_topic
        .insert(topic.to_string(), kairos::config::OnFailure::HoldKey);
    cfg.worker.admin.listen = None;
    println!(
        "\nexactly once  a second worker ([worker] exactly_once) runs {JOBS} jobs on {topic}, each writing a \
         follow-up to {follow}:\n              its writes and its offsets commit together, in one transaction \
         per commit round; {topic} holds keys (on_failure = \"hold_key\"), and job 7 of {HELD} fails once"
    );
    let to = follow.to_string();
    let started: Arc<Mutex<Vec<u32>>> = Arc::default();
    let seen_start = started.clone();
    let worker = Worker::builder(&cfg)
        .build(move |job: Job, _ctx| {
            let n: u32 = String::from_utf8_lossy(&job.payload).parse().unwrap_or_default();
            if job.key == HELD.as_bytes() {
                seen_start.lock().unwrap_or_else(|e| e.into_inner()).push(n);
            }
            let outcome = if n == 7 && job.attempt == 1 {
                Outcome::retry_after(Duration::from_millis(500), "declined once")
            } else {
                let follow_up = Job::new(to.as_str(), job.key.clone(), format!("follow-up of {}", job.id));
                Outcome::done_with(vec![follow_up])
            };
            async move { outcome }
        })
        .map_err(failed)?;
    let handle = worker.handle();
    let stop = CancellationToken::new();
    let st = stop.clone();
    let task = tokio::spawn(worker.run_until(async move { st.cancelled().await }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handle.stats().owned == 0 {
        if tokio::time::Instant::now() > deadline {
            return Err(failed("the exactly-once worker got no partition within 60 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let jobs: Vec<Job> = (0..JOBS)
        .map(|i| Job::new(topic, format!("invoice-{}", i % 10), i.to_string().into_bytes()))
        .collect();
    for job in &jobs {
        producer.enqueue(job.clone()).await.map_err(failed)?;
    }
    let mut seen = ExactlyOnceSeen {
        jobs: JOBS,
        ..Default::default()
    };
    loop {
        let counts = read_back(&cfg, follow).await?;
        let once = jobs
            .iter()
            .filter(|j| counts.get(&format!("follow-up of {}", j.id)) == Some(&1))
            .count();
        seen.once = once;
        seen.extra = counts.values().map(|n| n.saturating_sub(1)).sum();
        let held_ran = started.lock().unwrap_or_else(|e| e.into_inner()).len();
        if (once == JOBS && held_ran == JOBS / 10 + 1) || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    seen.transactions = handle.stats().transactions;
    seen.parked = handle.stats().parked;
    seen.held_key = started.lock().unwrap_or_else(|e| e.into_inner()).clone();
    stop.cancel();
    task.await.map_err(failed)?.map_err(failed)?;
    println!(
        "              read back read_committed: {} of {} jobs' follow-ups once, {} more than once; {} \
         transactions committed\n              {HELD} ran {:?}: job 7 failed once and held the key, {} later jobs \
         parked, all in order",
        seen.once, seen.jobs, seen.extra, seen.transactions, seen.held_key, seen.parked
    );
    Ok(seen)
}

/// Per payload, the records of `topic` a read_committed reader sees.
async fn read_back(cfg: &Config, topic: &str) -> Result<HashMap<String, usize>, DemoError> {
    let (kafka, topic) = (cfg.kafka.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let mut counts: HashMap<String, usize> = HashMap::new();
        kairos::kafka::read_to_end(
            &kafka,
            "kairos-demo-eos",
            &topic,
            None,
            Duration::from_secs(10),
            |m| {
                let text = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
                *counts.entry(text).or_default() += 1;
            },
        )
        .map(|()| counts)
    })
    .await
    .map_err(failed)?
    .map_err(failed)
}
