//! The scheduler's apply lanes in a real scheduler process: a lane's apply
//! thread ends once the lane has been quiet for a while (so that what it
//! allocated during a flood goes back to the system), and the lane's own
//! thread starts a fresh one, which applies what comes next. Seen in the
//! process's threads (`/proc`).

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::Utc;

use crate::common::system::enqueue_all;
use crate::common::wait_for;
use crate::scheduler::{check_fired, due_at, set_up, spawn_scheduler, SetUp};

/// `pid`'s threads whose names start with `prefix`, by thread id (Linux:
/// `/proc/PID/task/TID/comm`).
fn threads(pid: u32, prefix: &str) -> BTreeSet<u64> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return BTreeSet::new();
    };
    tasks
        .filter_map(|t| {
            let t = t.ok()?;
            let name = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let tid = t.file_name().to_str()?.parse().ok()?;
            name.starts_with(prefix).then_some(tid)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_threads_end_when_quiet_and_lanes_start_them_again_for_more_records() {
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        producer,
    } = set_up(|_| {}).await;
    let lanes = cfg.scheduler.apply_threads;
    assert!(lanes >= 2, "the default has several lanes: {lanes}");
    let child = spawn_scheduler(&cfg);
    let pid = child.0.id();

    // Jobs due a few seconds ahead go through the store: applied before
    // they can fire.
    let first = enqueue_all(
        &producer,
        due_at(&work, 300, Utc::now() + chrono::Duration::seconds(3)),
    )
    .await;
    let worked = wait_for("the jobs to be applied", Duration::from_secs(60), || {
        let n = crate::common::record_count(&cfg.kafka.brokers, &cfg.topics.changelog);
        (n >= 300).then(|| threads(pid, "kairos-apply-"))
    });
    assert_eq!(check_fired(&cfg, &first), 0, "fired twice");

    // Quiet: the threads that applied them end, and each lane (whose own
    // thread stays) has a fresh one.
    wait_for(
        "the apply threads that worked to end",
        Duration::from_secs(30),
        || {
            let now = threads(pid, "kairos-apply-");
            (now.is_disjoint(&worked) && now.len() == lanes).then_some(())
        },
    );
    assert_eq!(threads(pid, "kairos-lane-").len(), lanes, "each lane stays");

    // More records: the fresh threads apply them, and they fire.
    let second = enqueue_all(
        &producer,
        due_at(&work, 300, Utc::now() + chrono::Duration::seconds(3)),
    )
    .await;
    assert!(
        second.keys().all(|id| !first.contains_key(id)),
        "the second jobs are new ones"
    );
    let mut both = first;
    both.extend(second);
    assert_eq!(check_fired(&cfg, &both), 0, "fired twice");
}
