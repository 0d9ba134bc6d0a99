//! The scheduler's store failing to write: the scheduler must stop consuming
//! and committing, with a clear error, instead of dropping jobs.
//!
//! The fault is real, not mocked: the scheduler process runs with a file-size
//! limit (`ulimit -f`) and SIGXFSZ ignored, so once sled's files reach the
//! limit every write fails with EFBIG, as on a full disk. A scheduler
//! restarted on the same store without the limit must then hold every job.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::system::enqueue_all;
use crate::common::{record_count, wait_for, Broker};
use chrono::Utc;
use kairos::scheduler::Scheduler;
use kairos::{Job, Producer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_cannot_write_stops_the_scheduler_without_losing_jobs() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = crate::common::system::config(broker, dir.path());
    // Small batches, so that some are persisted and committed before the limit hits.
    cfg.scheduler.ingest_batch = 100;
    kairos::topics::init(&cfg).await.unwrap();
    let path = dir.path().join("scheduler.toml");
    std::fs::write(&path, toml::to_string(&cfg).unwrap()).unwrap();

    // 2,000 far-future jobs of 4 KiB: about 8 MiB of store, past a 2 MiB limit.
    let producer = Producer::new(&cfg).unwrap();
    let work = cfg.topics.work[0].clone();
    let at = Utc::now() + chrono::Duration::days(1);
    let jobs = (0..2000)
        .map(|i| Job::new(&work, format!("key-{i}"), vec![b'x'; 4096]).at(at))
        .collect();
    let written = enqueue_all(&producer, jobs).await.len() as i64;

    let limited = Command::new("bash")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 2048; exec \"$0\" --config \"$1\" scheduler")
        .arg(env!("CARGO_BIN_EXE_kairos"))
        .arg(&path)
        .env("KAIROS_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = tokio::task::spawn_blocking(move || limited.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the scheduler must stop when its store cannot write"
    );
    assert!(
        stderr.contains("scheduler store") && stderr.contains("File too large"),
        "the error names the store and the cause: {stderr}"
    );
    let committed =
        crate::common::committed(&cfg.kafka.brokers, &cfg.scheduler.group_id, &cfg.topics.schedule);
    assert!(
        committed > 0 && committed < written,
        "some batches were persisted and committed, not all ({committed} of {written})"
    );
    eprintln!("store failed after {committed} of {written} records were committed");

    // Without the limit, on the same store: every job is pending, none lost.
    let s = Scheduler::builder(&cfg).build().unwrap();
    let handle = s.handle();
    let stop = tokio_util::sync::CancellationToken::new();
    let st = stop.clone();
    let task = tokio::spawn(s.run_until(async move { st.cancelled().await }));
    wait_for("every job pending again", Duration::from_secs(60), || {
        (handle.stats().pending == written as u64).then_some(())
    });
    stop.cancel();
    task.await.unwrap().unwrap();
    assert_eq!(record_count(&cfg.kafka.brokers, &work), 0, "nothing fired early");
}
