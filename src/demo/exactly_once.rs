//! The demo's exactly-once settlement: a second worker, with `[worker]
//! exactly_once`, runs jobs whose handler writes a follow-up; the
//! follow-ups are read back as `read_committed` consumers see them, once
//! per job.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::Message as _;
use tokio_util::sync::CancellationToken;

use super::{failed, DemoError};
use kairos::worker::{Outcome, Worker};
use kairos::{Config, Job, Producer};

/// Jobs written to the exactly-once topic.
const JOBS: usize = 50;

/// What the exactly-once part saw: jobs written, jobs whose follow-up was
/// read back once, follow-ups read back more than once (must be 0), and
/// the worker's transactions committed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExactlyOnceSeen {
    /// Jobs written.
    pub jobs: usize,
    /// Jobs whose follow-up was read back exactly once.
    pub once: usize,
    /// Follow-ups read back beyond the first of their job (must be 0).
    pub extra: usize,
    /// Transactions the worker committed.
    pub transactions: u64,
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
    cfg.worker.admin.listen = None;
    println!(
        "\nexactly once  a second worker ([worker] exactly_once) runs {JOBS} jobs on {topic}, each writing a \
         follow-up to {follow}:\n              its writes and its offsets commit together, in one transaction \
         per commit round"
    );
    let to = follow.to_string();
    let worker = Worker::builder(&cfg)
        .build(move |job: Job, _ctx| {
            let follow_up = Job::new(to.as_str(), job.key.clone(), format!("follow-up of {}", job.id));
            async move { Outcome::done_with(vec![follow_up]) }
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
        if once == JOBS || tokio::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    seen.transactions = handle.stats().transactions;
    stop.cancel();
    task.await.map_err(failed)?.map_err(failed)?;
    println!(
        "              read back read_committed: {} of {} jobs' follow-ups once, {} more than once; {} \
         transactions committed",
        seen.once, seen.jobs, seen.extra, seen.transactions
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
