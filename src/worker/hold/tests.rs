use std::collections::{BTreeMap, VecDeque};

use super::*;
use crate::job::Job;

const P: i32 = 0;

fn job(key: &str, n: u32) -> Job {
    let mut j = Job::new("t", key, n.to_string().into_bytes());
    j.run_at = chrono::DateTime::from_timestamp_millis(0).unwrap();
    j
}

fn n(job: &Job) -> u32 {
    String::from_utf8_lossy(&job.payload).parse().unwrap()
}

/// One partition, one worker, a scheduler that releases jobs in (run-at,
/// arrival) order: jobs are read from the log, held keys decide, a key's
/// admitted jobs run one at a time in order, and `fail` says how often each
/// job fails before it succeeds. Returns the starts, in order.
fn simulate(log: Vec<Job>, mut fail: BTreeMap<u32, u32>) -> (Vec<u32>, Holds<i32>) {
    let mut holds = Holds::new(100);
    let mut log: VecDeque<Job> = log.into();
    // The scheduler: (due, arrival) -> job.
    let mut scheduler: BTreeMap<(i64, u64), Job> = BTreeMap::new();
    let arrival = std::cell::Cell::new(0u64);
    let next_arrival = || {
        arrival.set(arrival.get() + 1);
        arrival.get()
    };
    let mut now = 1_000i64;
    // A retry goes to the scheduler as any job would.
    let park_retry = |next: Job, due: i64, scheduler: &mut BTreeMap<(i64, u64), Job>| {
        scheduler.insert((due, next_arrival()), next);
    };
    let mut fifo: VecDeque<Job> = VecDeque::new();
    // Jobs waiting in memory for the key's parked jobs.
    let mut waiting: Vec<Job> = Vec::new();
    let mut starts = Vec::new();
    let park = |p: Job, seq: u64, at_ms: i64, scheduler: &mut BTreeMap<(i64, u64), Job>| {
        let mut p = p;
        p.parked = Some(seq);
        p.run_at = chrono::DateTime::from_timestamp_millis(at_ms).unwrap();
        scheduler.insert((at_ms, next_arrival()), p);
    };
    for _ in 0..10_000 {
        // Read what the log has.
        while let Some(j) = log.pop_front() {
            match holds.admit(P, &j, now) {
                Admit::Run => fifo.push_back(j),
                Admit::Park { seq, at_ms } => park(j, seq, at_ms, &mut scheduler),
                Admit::Wait => waiting.push(j),
                Admit::Released => panic!("nothing released here"),
                // An earlier run of the job holding the key: finished.
                Admit::Stale => {}
            }
        }
        // Run the key's next job.
        if let Some(j) = fifo.pop_front() {
            starts.push(n(&j));
            let left = fail.entry(n(&j)).or_insert(0);
            let how = if *left > 0 {
                *left -= 1;
                let mut next = j.clone();
                next.attempt += 1;
                next.parked = None;
                next.run_at = chrono::DateTime::from_timestamp_millis(now + 100).unwrap();
                let attempt = next.attempt;
                let due = now + 100;
                park_retry(next, due, &mut scheduler);
                Settlement::Again {
                    attempt,
                    due_ms: due,
                    cause: Cause::Failed,
                }
            } else {
                Settlement::Finished
            };
            let update = holds.settled(P, &j, how, now);
            if holds.parks_buffered(P, &j.key) {
                for b in std::mem::take(&mut fifo) {
                    match holds.park_buffered(P, &b) {
                        Some(Admit::Park { seq, at_ms }) => park(b, seq, at_ms, &mut scheduler),
                        _ => fifo.push_back(b),
                    }
                }
                let w: Vec<Job> = std::mem::take(&mut waiting);
                let refs: Vec<&Job> = w.iter().collect();
                let admits = holds.park_waiting(P, &refs);
                for (b, a) in w.iter().zip(admits) {
                    let Admit::Park { seq, at_ms } = a else {
                        panic!("parked")
                    };
                    park(b.clone(), seq, at_ms, &mut scheduler);
                }
            } else if update == HoldUpdate::Write(HoldWrite::Let) {
                fifo.extend(waiting.drain(..));
            }
            continue;
        }
        // Nothing to run: time passes to the scheduler's next job.
        let Some((&(due, a), _)) = scheduler.iter().next() else {
            break;
        };
        now = now.max(due);
        let j = scheduler.remove(&(due, a)).unwrap();
        log.push_back(j);
    }
    (starts, holds)
}

#[test]
fn a_failing_job_holds_its_key_until_it_succeeds_then_the_rest_run_in_order() {
    let log = (1..=5).map(|i| job("k", i)).collect();
    let (starts, holds) = simulate(log, BTreeMap::from([(2, 2)]));
    assert_eq!(starts, vec![1, 2, 2, 2, 3, 4, 5]);
    assert!(holds.is_empty(), "the key is let go once its last parked job ran");
}

#[test]
fn parked_jobs_that_fail_hold_the_key_in_turn() {
    let log = (1..=6).map(|i| job("k", i)).collect();
    let (starts, holds) = simulate(log, BTreeMap::from([(2, 1), (4, 2), (6, 1)]));
    assert_eq!(starts, vec![1, 2, 2, 3, 4, 4, 4, 5, 6, 6]);
    assert!(holds.is_empty());
}

/// `job` as it comes back from the scheduler after `admit` parked it.
fn back(job: &Job, admit: Admit) -> Job {
    let Admit::Park { seq, at_ms } = admit else {
        panic!("not parked: {admit:?}")
    };
    let mut j = job.clone();
    j.parked = Some(seq);
    j.run_at = chrono::DateTime::from_timestamp_millis(at_ms).unwrap();
    j
}

fn again(due_ms: i64) -> Settlement {
    Settlement::Again {
        attempt: 2,
        due_ms,
        cause: Cause::Failed,
    }
}

#[test]
fn a_job_written_while_parked_jobs_are_out_is_parked_behind_them() {
    let mut holds = Holds::new(10);
    let (j1, j2, j3) = (job("k", 1), job("k", 2), job("k", 3));
    assert_eq!(holds.admit(P, &j1, 0), Admit::Run);
    assert!(matches!(
        holds.settled(P, &j1, again(500), 0),
        HoldUpdate::Write(HoldWrite::Put(_))
    ));
    let p2 = holds.admit(P, &j2, 10);
    assert_eq!(
        p2,
        Admit::Park { seq: 1, at_ms: 501 },
        "behind its blocker's retry"
    );
    // The retry comes back and succeeds: the key still waits for job 2.
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 500), Admit::Run);
    let HoldUpdate::Write(HoldWrite::Put(h)) = holds.settled(P, &retry, Settlement::Finished, 510) else {
        panic!("the blocker is done: written")
    };
    assert_eq!((h.blocker.is_none(), h.parked()), (true, 1));
    // Job 3, written to the work topic meanwhile, waits in memory for job
    // 2, due now, to come back and run.
    assert_eq!(holds.admit(P, &j3, 520), Admit::Wait);
    let back2 = back(&j2, p2);
    assert_eq!(holds.admit(P, &back2, 530), Admit::Run);
    assert_eq!(
        holds.settled(P, &back2, Settlement::Finished, 540),
        HoldUpdate::Write(HoldWrite::Let),
        "the key is let go: job 3 runs"
    );
    assert!(holds.is_empty());
    // A copy of job 2 back again later (a duplicate) just runs.
    assert_eq!(holds.admit(P, &back2, 570), Admit::Run);
}

#[test]
fn a_job_read_while_parked_jobs_are_due_later_is_parked_behind_them() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    holds.settled(P, &j1, again(60_000), 0);
    let p2 = holds.admit(P, &job("k", 2), 10);
    let p3 = holds.admit(P, &job("k", 3), 20);
    assert_eq!(
        p3,
        Admit::Park {
            seq: 2,
            at_ms: 60_001
        }
    );
    // Should job 3 come back first, it goes out again.
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 60_000), Admit::Run);
    assert_eq!(
        holds.admit(P, &back(&job("k", 3), p3), 60_005),
        Admit::Park {
            seq: 2,
            at_ms: 60_005 + BACK_TOO_SOON_MS
        }
    );
    assert_eq!(holds.admit(P, &back(&job("k", 2), p2), 60_006), Admit::Run);
}

#[test]
fn parked_jobs_back_before_their_blocker_go_out_again_keeping_their_place() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    holds.settled(P, &j1, again(5_000), 0);
    let p2 = holds.admit(P, &job("k", 2), 4_990);
    // The retry comes back, fails again: the next one is due at 9 000.
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 5_000), Admit::Run);
    holds.settled(P, &retry, again(9_000), 5_010);
    let p3 = holds.admit(P, &job("k", 3), 5_020);
    assert_eq!(p3, Admit::Park { seq: 2, at_ms: 9_001 });
    // Job 2 comes back before the retry: out again, same number, with it.
    assert_eq!(
        holds.admit(P, &back(&job("k", 2), p2), 5_030),
        Admit::Park { seq: 1, at_ms: 9_000 }
    );
    // Job 3 back after the retry but before job 2: out again too.
    let mut retry2 = retry.clone();
    retry2.attempt = 3;
    assert_eq!(holds.admit(P, &retry2, 9_000), Admit::Run);
    assert!(matches!(
        holds.admit(P, &back(&job("k", 3), p3), 9_005),
        Admit::Park { seq: 2, .. }
    ));
    assert_eq!(holds.admit(P, &back(&job("k", 2), p2), 9_010), Admit::Run);
    assert_eq!(holds.admit(P, &back(&job("k", 3), p3), 9_020), Admit::Run);
}

#[test]
fn a_retry_read_before_its_failure_was_settled_stays_and_runs_next() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    // The retry was due at once: written to the work topic and read while
    // job 1's failure was still being settled, behind job 2.
    let mut retry = j1.clone();
    retry.attempt = 2;
    holds.settled(P, &j1, again(0), 0);
    assert!(holds.parks_buffered(P, b"k"));
    assert!(matches!(
        holds.park_buffered(P, &job("k", 2)),
        Some(Admit::Park { .. })
    ));
    assert_eq!(holds.park_buffered(P, &retry), Some(Admit::Run));
    assert!(!holds.parks_buffered(P, b"k"), "its blocker is back");
}

#[test]
fn a_key_gives_up_on_a_parked_job_that_never_comes_back() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    holds.settled(P, &j1, again(1_000), 0);
    let _lost = holds.admit(P, &job("k", 2), 10);
    let p3 = holds.admit(P, &job("k", 3), 20);
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 1_000), Admit::Run);
    holds.settled(P, &retry, Settlement::Finished, 1_010);
    // Job 2's park was lost: job 3 goes out again until the wait is over.
    assert!(matches!(
        holds.admit(P, &back(&job("k", 3), p3), 2_000),
        Admit::Park { seq: 2, .. }
    ));
    assert!(matches!(
        holds.admit(P, &back(&job("k", 3), p3), 20_000),
        Admit::Park { .. }
    ));
    assert_eq!(
        holds.admit(P, &back(&job("k", 3), p3), 2_000 + GIVE_UP_MS),
        Admit::Run
    );
    assert_eq!(holds.get(P, b"k").map(|h| h.gave_up), Some(1));
}

#[test]
fn at_the_cap_a_failure_does_not_hold_its_key() {
    let mut holds = Holds::new(2);
    let again = Settlement::Again {
        attempt: 2,
        due_ms: 100,
        cause: Cause::Failed,
    };
    for k in ["a", "b"] {
        assert!(matches!(
            holds.settled(P, &job(k, 1), again, 0),
            HoldUpdate::Write(_)
        ));
    }
    assert_eq!(holds.settled(P, &job("c", 1), again, 0), HoldUpdate::Overflow);
    assert_eq!(holds.admit(P, &job("c", 2), 0), Admit::Run);
    assert_eq!(holds.len(), 2);
}

#[test]
fn a_released_key_runs_its_jobs_and_dead_letters_its_blocker_when_it_comes_back() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    holds.settled(P, &j1, again(60_000), 0);
    assert_eq!(holds.release(P, b"k", JobId::new()), None, "another job");
    let Some(HoldWrite::Put(h)) = holds.release(P, b"k", j1.id) else {
        panic!("released")
    };
    assert!(!h.holds());
    assert_eq!(holds.admit(P, &job("k", 2), 10), Admit::Run);
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 500), Admit::Released);
    assert_eq!(
        holds.settled(P, &retry, Settlement::Finished, 30),
        HoldUpdate::Write(HoldWrite::Let)
    );
}

#[test]
fn holds_are_per_partition_and_dropped_with_it() {
    let mut holds = Holds::new(10);
    let h = Hold {
        blocker: None,
        last_seq: 3,
        done_seq: 1,
        admitted_seq: 0,
        waiting: 0,
        sent_seq: 0,
        gap_since_ms: NEVER,
        wait_since_ms: NEVER,
        gave_up: 0,
        tail_at_ms: 100_000,
        since_ms: 0,
        rare: None,
        parked_to: NO_OFFSET,
    };
    holds.load(1, b"k", Some(h.clone()));
    holds.load(2, b"k", Some(h));
    assert!(matches!(holds.admit(1, &job("k", 1), 0), Admit::Park { .. }));
    holds.drop_partition(1);
    assert_eq!(holds.admit(1, &job("k", 1), 0), Admit::Run);
    assert!(matches!(holds.admit(2, &job("k", 1), 0), Admit::Park { .. }));
    holds.load(2, b"k", None);
    assert!(holds.is_empty());
}

mod faults;
mod read_back;
