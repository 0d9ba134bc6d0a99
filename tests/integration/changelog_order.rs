//! The changelog keeps a retry put while its job's first fire was still
//! being finished.
//!
//! A worker's retry is a put under the id of the job it retries, and it can
//! reach the scheduler while that job's fire is still being finished: the
//! finisher waits for every write of its round before it tombstones the
//! round's jobs. The changelog must end with the retry's put, not the first
//! fire's tombstone, or a new instance rebuilding from the changelog loses
//! the retry.
//!
//! The test broker acknowledges every write within milliseconds, so the
//! window is too short to hit on demand there. This test uses librdkafka's
//! mock cluster instead, for its one fault the real broker cannot produce:
//! a slow broker. Work partition 0 is led by a broker that answers after
//! 2 s; everything else is on a fast one. A round of fires then waits 2 s
//! for partition 0 while the jobs fired to partitions 1 and 2 are read by
//! the test (a fast-failing worker), put again, and stored.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::Utc;
use kairos::scheduler::Scheduler;
use kairos::wire::{self, Command as Cmd, Context, Limits, RecordView};
use kairos::{Config, Job, Producer};
use rdkafka::mocking::MockCluster;

use crate::common::system::enqueue_all;
use crate::common::{assign_from_start, reader, unique, wait_for};

const T: Duration = Duration::from_secs(60);
const FAST: i32 = 1;
const SLOW: i32 = 2;

struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kairos::scheduler::SchedulerError>>,
    handle: kairos::scheduler::SchedulerHandle,
}

fn start(cfg: &Config) -> Running {
    let s = Scheduler::builder(cfg).build().expect("scheduler");
    let handle = s.handle();
    let (stop, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(s.run_until(async {
        let _ = rx.await;
    }));
    let r = Running { stop, task, handle };
    wait_for("the scheduler to own its partitions", T, || {
        (r.handle.stats().owned.len() == 3).then_some(())
    });
    r
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().expect("scheduler ran cleanly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_put_while_its_job_was_being_fired_survives_a_rebuild() {
    const N: usize = 300;
    let cluster = MockCluster::new(2).expect("mock cluster");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::default();
    cfg.kafka.brokers = cluster.bootstrap_servers();
    crate::common::fresh_topics(&mut cfg);
    cfg.scheduler.data_dir = dir.path().join("a");
    cfg.scheduler.group_id = unique("sched");
    // Jobs a few seconds out are stored, not held in memory.
    cfg.scheduler.window = Duration::from_millis(500);
    for (k, v) in [
        ("session.timeout.ms", "6000"),
        ("heartbeat.interval.ms", "500"),
        // The mock cluster answers a fetch when its wait expires.
        ("fetch.wait.max.ms", "10"),
    ] {
        cfg.kafka.consumer.insert(k.into(), v.into());
    }
    for (name, partitions) in kairos::topics::planned(&cfg) {
        cluster.create_topic(&name, partitions, 1).expect("topic");
        for part in 0..partitions {
            cluster.partition_leader(&name, part, Some(FAST)).expect("leader");
        }
    }
    let work = cfg.topics.work[0].clone();
    cluster.partition_leader(&work, 0, Some(SLOW)).expect("leader");
    cluster
        .broker_round_trip_time(SLOW, Duration::from_secs(2))
        .expect("rtt");

    let producer = Producer::new(&cfg).unwrap();
    let first = start(&cfg);
    // All due at once, beyond the window: stored, then fired in one round.
    let at = Utc::now() + chrono::Duration::seconds(3);
    let jobs = (0..N)
        .map(|i| Job::new(&work, format!("key-{i}"), b"x".to_vec()).at(at))
        .collect();
    enqueue_all(&producer, jobs).await;

    // A fast-failing worker: every job seen fired is put again at once, due
    // in a day.
    let worker = reader(&cfg.kafka.brokers, "fast-failing", &[("fetch.wait.max.ms", "10")]);
    assign_from_start(&worker, &work);
    let later = Utc::now() + chrono::Duration::days(1);
    let mut seen = HashSet::new();
    let deadline = Instant::now() + T;
    while seen.len() < N {
        assert!(Instant::now() < deadline, "{} of {N} fired", seen.len());
        let mut retries = Vec::new();
        let mut wait = Duration::from_millis(100);
        while let Some(m) = worker.poll(wait) {
            wait = Duration::ZERO;
            let m = m.expect("consume");
            let mut job = match wire::decode(&RecordView::from_message(&m), Context::Work, &Limits::default())
            {
                Ok(Cmd::Schedule(j)) => j,
                other => panic!("fired record does not decode: {other:?}"),
            };
            if seen.insert(job.id) {
                job.run_at = later;
                retries.push(job);
            }
        }
        enqueue_all(&producer, retries).await;
    }
    wait_for("every retry stored", T, || {
        (first.handle.stats().pending == N as u64).then_some(())
    });
    first.stop().await;

    // A new instance with an empty store rebuilds from the changelog.
    let mut fresh_cfg = cfg.clone();
    fresh_cfg.scheduler.data_dir = dir.path().join("b");
    let fresh = start(&fresh_cfg);
    let st = fresh.handle.stats();
    fresh.stop().await;
    assert_eq!(st.pending, N as u64, "retries rebuilt from the changelog: {st:?}");
}
