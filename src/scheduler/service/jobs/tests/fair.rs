//! The fair lanes' transitions: a release reads the store without the
//! window's lock, a job being changed or fired is never released, a failed
//! fire waits again, a revoked partition releases nothing. The store's
//! scan is a closure over a list (the lanes read nothing else), so these
//! run without a store on disk; `dispatch/tests.rs` runs fair rounds
//! against a real one.

use std::sync::mpsc;

use super::*;
use crate::scheduler::fair::Weights;

const TOPIC: &str = "fair";

fn fair_job(tenant: &str, key: &str, run_at_ms: i64, seq: u64) -> (DueKey, StoredJob) {
    let job = Job::new(TOPIC, key, b"p".to_vec())
        .tenant(tenant)
        .at(Utc.timestamp_millis_opt(run_at_ms).unwrap());
    let s = StoredJob { job, seq };
    (DueKey::of(0, &s), s)
}

/// Partitions 0 and 1 owned, topic `fair` dispatched fairly.
fn fair_jobs() -> SchedulerJobs {
    let lanes = FairWindow::new(&[TOPIC.to_string()], Weights::default(), 60_000, 1000, NOW);
    let jobs = SchedulerJobs::new(TimerWheel::new(SPAN_MS, 100), Some(lanes));
    for p in [0, 1] {
        jobs.assign(p);
    }
    jobs
}

/// The store's `scan_due` over `stored`: a partition's jobs after a key,
/// due by a time, at most a number of them, in key order.
fn scan(
    stored: &[(DueKey, StoredJob)],
    p: i32,
    after: Option<DueKey>,
    until_ms: i64,
    limit: usize,
) -> Vec<(DueKey, StoredJob)> {
    let mut got: Vec<(DueKey, StoredJob)> = stored
        .iter()
        .filter(|(k, _)| k.partition == p && after.is_none_or(|a| *k > a) && k.run_at_ms <= until_ms)
        .cloned()
        .collect();
    got.sort_by_key(|(k, _)| *k);
    got.truncate(limit);
    got
}

/// A round: the window's (empty here), then the fair lanes' release.
fn release(jobs: &SchedulerJobs, stored: &[(DueKey, StoredJob)]) -> Taken {
    let mut t = jobs.take_round(NOW, 100, &read_all());
    let allowance = [(TOPIC.to_string(), 100)].into_iter().collect();
    let mut read = |p, after, until_ms, limit| Ok(scan(stored, p, after, until_ms, limit));
    jobs.release_fair(NOW, &read_all(), &allowance, &mut read, &mut t)
        .unwrap();
    t
}

fn keys(t: &Taken) -> Vec<String> {
    t.due[t.fair_from..]
        .iter()
        .map(|(_, s)| s.job.key_lossy().into_owned())
        .collect()
}

#[test]
fn a_fair_release_reads_the_store_while_the_window_is_free() {
    let jobs = fair_jobs();
    let stored = vec![fair_job("t1", "a", NOW - 10, 1)];
    let (go, asked) = mpsc::channel::<()>();
    let (answer, answered) = mpsc::channel();
    let mut waited_for_the_window = 0;
    std::thread::scope(|s| {
        let jobs = &jobs;
        s.spawn(move || {
            for () in asked {
                // Takes the window's lock.
                let _ = answer.send(jobs.partitions());
            }
        });
        let mut t = jobs.take_round(NOW, 100, &read_all());
        let allowance = [(TOPIC.to_string(), 100)].into_iter().collect();
        let mut read = |p, after, until_ms, limit| {
            go.send(()).unwrap();
            if answered.recv_timeout(Duration::from_secs(10)).is_err() {
                waited_for_the_window += 1;
            }
            Ok(scan(&stored, p, after, until_ms, limit))
        };
        jobs.release_fair(NOW, &read_all(), &allowance, &mut read, &mut t)
            .unwrap();
        drop(go);
        assert_eq!(keys(&t), ["a"]);
    });
    assert_eq!(
        waited_for_the_window, 0,
        "the window's lock was held while the store was read"
    );
}

#[test]
fn a_fair_job_a_batch_is_changing_is_not_released_and_once_cancelled_never_is() {
    let jobs = fair_jobs();
    let (ka, a) = fair_job("t1", "a", NOW - 10, 1);
    let (kb, b) = fair_job("t2", "b", NOW - 10, 2);
    let mut stored = vec![(ka, a.clone()), (kb, b)];
    let named = claim_one(&jobs, 0, 9, Command::Cancel(a.job.id));
    let t = release(&jobs, &stored);
    assert_eq!(keys(&t), ["b"], "a is held while the batch is applied");
    assert_eq!(t.parts, [0].into_iter().collect());
    // The batch cancels a: gone from the store, then admitted.
    stored.retain(|(k, _)| *k != ka);
    jobs.take_named(&named);
    jobs.admit(
        &[Applied::Removed(ka, a.job.id)],
        &mut HashMap::default(),
        NOW,
        &named,
    );
    assert!(
        !jobs.with_window(|w| w.is_changing(0, &a.job.id)),
        "the batch is applied"
    );
    assert_eq!(jobs.fair_counts().map(|c| c.0), Some(0), "a left its lane");
    assert!(
        release(&jobs, &stored).due.is_empty(),
        "a was cancelled, b is being fired"
    );
}

#[test]
fn a_released_fair_job_is_claimed_as_firing_until_its_round_is_finished() {
    let jobs = fair_jobs();
    let (ka, a) = fair_job("t1", "a", NOW - 10, 1);
    let stored = vec![(ka, a.clone())];
    let t = release(&jobs, &stored);
    assert_eq!(keys(&t), ["a"]);
    let cancel = |offset| claim_one(&jobs, 0, offset, Command::Cancel(a.job.id));
    assert!(cancel(9)[&(0, a.job.id)].firing, "a cancel now comes too late");
    assert!(release(&jobs, &stored).due.is_empty(), "not released twice");
    jobs.finished(&[Applied::Removed(ka, a.job.id)], &t.due, Vec::new(), &t.direct);
    jobs.rounds_done([&t.parts]);
    assert!(!cancel(10)[&(0, a.job.id)].firing, "fired: no longer being fired");
}

#[test]
fn a_failed_fair_fire_waits_in_its_lane_and_is_released_again() {
    let jobs = fair_jobs();
    let stored = vec![fair_job("t1", "a", NOW - 10, 1)];
    let t = release(&jobs, &stored);
    assert_eq!(keys(&t), ["a"]);
    jobs.finished(&[], &t.due, t.due.clone(), &t.direct);
    jobs.rounds_done([&t.parts]);
    assert_eq!(keys(&release(&jobs, &stored)), ["a"]);
    assert_eq!(jobs.fair_counts().map(|c| c.0), Some(0), "nothing left buffered");
}

#[test]
fn a_revocation_waits_for_a_fair_round_and_the_partition_releases_nothing_more() {
    let jobs = fair_jobs();
    let stored = vec![fair_job("t1", "a", NOW - 10, 1), fair_job("t1", "b", NOW - 5, 2)];
    let mut first = jobs.take_round(NOW, 100, &read_all());
    let allowance = [(TOPIC.to_string(), 1)].into_iter().collect();
    let mut read = |p, after, until_ms, limit| Ok(scan(&stored, p, after, until_ms, limit));
    jobs.release_fair(NOW, &read_all(), &allowance, &mut read, &mut first)
        .unwrap();
    assert_eq!(keys(&first), ["a"], "one allowed");
    jobs.revoke(&[0]);
    assert!(
        !jobs.wait_idle(&[0], Instant::now()),
        "a fair round of 0 in flight"
    );
    jobs.rounds_done([&first.parts]);
    assert!(jobs.wait_idle(&[0], Instant::now()));
    assert!(release(&jobs, &stored).due.is_empty(), "b's partition is gone");
    assert_eq!(jobs.fair_counts().map(|c| c.0), Some(0), "its lane was dropped");
}
