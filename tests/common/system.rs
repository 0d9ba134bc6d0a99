//! Running Kairos in-process for a test: a worker, optionally with a
//! scheduler, on one configuration, stopped on demand.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::time::Duration;

use kairos::scheduler::Scheduler;
use kairos::worker::{Handler, Worker, WorkerHandle};
use kairos::{Config, Job, JobId, Producer};
use tokio_util::sync::CancellationToken;

use super::{unique, Broker};

/// A configuration for a scheduler and workers under test: their own store,
/// groups and topics, short retry backoff, and quick failure detection (a
/// killed member's partitions move within seconds).
pub fn config(broker: &Broker, dir: &std::path::Path) -> Config {
    let mut cfg = broker.config();
    cfg.scheduler.data_dir = dir.join("scheduler");
    cfg.scheduler.group_id = unique("sched");
    // A short window puts the cascade point about 1.5 s ahead, so that jobs
    // due a few seconds out go to the far buckets and every test exercises
    // the cascade into the near range. (Benchmarks keep the default.)
    cfg.scheduler.window = Duration::from_millis(500);
    cfg.worker.group_id = unique("workers");
    cfg.worker.topics = cfg.topics.work.clone();
    cfg.worker.backoff_base = Duration::from_millis(300);
    cfg.worker.session_timeout = Duration::from_secs(6);
    cfg.scheduler.session_timeout = Duration::from_secs(6);
    let consumer = &mut cfg.kafka.consumer;
    consumer.insert("heartbeat.interval.ms".into(), "500".into());
    cfg
}

/// Switch `cfg` to the consumer group protocol of KIP-848, with the same
/// quick failure detection as [`config`]: the session timeout and the
/// heartbeat interval are the broker's under that protocol, so they are set
/// as group configs (`consumer.session.timeout.ms` 6 s,
/// `consumer.heartbeat.interval.ms` 500 ms) of the scheduler's and the
/// workers' groups, as an operator would.
pub async fn consumer_protocol(cfg: &mut Config) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    cfg.kafka.group_protocol = kairos::config::GroupProtocol::Consumer;
    cfg.kafka.consumer.remove("heartbeat.interval.ms");
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .expect("admin client");
    let groups = [cfg.scheduler.group_id.as_str(), cfg.worker.group_id.as_str()];
    let changes: Vec<AlterConfig<'_>> = groups
        .iter()
        .map(|g| {
            AlterConfig::new(ResourceSpecifier::Group(g))
                .set("consumer.session.timeout.ms", "6000")
                .set("consumer.heartbeat.interval.ms", "500")
        })
        .collect();
    let answer = admin
        .alter_configs(&changes, &AdminOptions::new())
        .await
        .expect("alter group configs");
    assert!(answer.iter().all(|r| r.is_ok()), "group configs: {answer:?}");
}

/// A running worker (and optionally a scheduler), stopped on `stop()`.
pub struct System {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The worker's counters.
    pub worker: WorkerHandle,
}

impl System {
    /// Stop everything and check that each part ended cleanly.
    pub async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            t.await.unwrap();
        }
    }
}

/// Start a worker with `handler` (and a scheduler if asked) on `cfg`.
pub fn run<H: Handler>(cfg: &Config, with_scheduler: bool, handler: H) -> System {
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    if with_scheduler {
        let s = Scheduler::builder(cfg).build().unwrap();
        let st = stop.clone();
        tasks.push(tokio::spawn(async move {
            s.run_until(async move { st.cancelled().await })
                .await
                .expect("scheduler");
        }));
    }
    let w = Worker::builder(cfg).build(handler).unwrap();
    let worker = w.handle();
    let st = stop.clone();
    tasks.push(tokio::spawn(async move {
        w.run_until(async move { st.cancelled().await })
            .await
            .expect("worker");
    }));
    System { stop, tasks, worker }
}

/// Write all jobs concurrently; returns each id with its run-at in epoch ms.
pub async fn enqueue_all(producer: &Producer, jobs: Vec<Job>) -> HashMap<JobId, i64> {
    let writes = jobs.iter().map(|j| producer.enqueue(j.clone()).into_future());
    let ids = futures::future::join_all(writes).await;
    jobs.iter()
        .zip(ids)
        .map(|(j, r)| (r.expect("enqueue"), j.run_at.timestamp_millis()))
        .collect()
}

/// Run the `kairos` binary with `cfg` written to a file in `dir`, and read
/// what it prints as JSON (the command must succeed).
pub fn kairos_json(cfg: &Config, dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&kairos_text(cfg, dir, args)).expect("kairos printed JSON")
}

/// Run the `kairos` binary with `cfg` (written to a file in `dir`) and
/// `args`; what it printed on stdout (it must succeed).
#[allow(dead_code)]
pub fn kairos_text(cfg: &Config, dir: &std::path::Path, args: &[&str]) -> String {
    let file = dir.join("kairos.toml");
    std::fs::write(&file, toml::to_string(cfg).expect("config as TOML")).expect("config file");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kairos"))
        .arg("--config")
        .arg(&file)
        .args(args)
        .output()
        .expect("run kairos");
    assert!(
        out.status.success(),
        "kairos {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
