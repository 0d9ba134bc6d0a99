use std::collections::{BTreeMap, VecDeque};

use super::*;

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
    let mut arrival = 0u64;
    let mut now = 1_000i64;
    let mut fifo: VecDeque<Job> = VecDeque::new();
    let mut starts = Vec::new();
    for _ in 0..10_000 {
        // Read what the log has.
        while let Some(j) = log.pop_front() {
            match holds.admit(P, &j, now) {
                Admit::Run => fifo.push_back(j),
                Admit::Park { seq, at_ms } => {
                    let mut p = j;
                    p.parked = Some(seq);
                    p.run_at = chrono::DateTime::from_timestamp_millis(at_ms).unwrap();
                    arrival += 1;
                    scheduler.insert((at_ms, arrival), p);
                }
                Admit::Released => panic!("nothing released here"),
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
                next.run_at = chrono::DateTime::from_timestamp_millis(now + 100).unwrap();
                arrival += 1;
                scheduler.insert((now + 100, arrival), next.clone());
                Settlement::Again {
                    attempt: next.attempt,
                    due_ms: now + 100,
                    cause: Cause::Failed,
                }
            } else {
                Settlement::Finished
            };
            holds.settled(P, &j, how, now);
            if holds.parks_buffered(P, &j.key) {
                for b in std::mem::take(&mut fifo) {
                    let Some(Admit::Park { seq, at_ms }) = holds.park_buffered(P, &b) else {
                        panic!("held")
                    };
                    let mut p = b;
                    p.parked = Some(seq);
                    arrival += 1;
                    scheduler.insert((at_ms, arrival), p);
                }
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

#[test]
fn a_job_written_while_parked_jobs_are_out_is_parked_behind_them() {
    let mut holds = Holds::new(10);
    let (j1, j2, j3) = (job("k", 1), job("k", 2), job("k", 3));
    assert_eq!(holds.admit(P, &j1, 0), Admit::Run);
    let again = Settlement::Again {
        attempt: 2,
        due_ms: 500,
        cause: Cause::Failed,
    };
    assert!(matches!(
        holds.settled(P, &j1, again, 0),
        HoldUpdate::Write(Change::Put(_))
    ));
    assert_eq!(
        holds.admit(P, &j2, 10),
        Admit::Park { seq: 1, at_ms: 500 },
        "due with its blocker's retry, behind it"
    );
    // The retry comes back and succeeds: the key still waits for job 2.
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 500), Admit::Run);
    let HoldUpdate::Write(Change::Put(h)) = holds.settled(P, &retry, Settlement::Finished, 510) else {
        panic!("the blocker is done: written")
    };
    assert_eq!((h.blocker, h.tail), (None, 1));
    // Job 3, written to the work topic meanwhile, may overtake job 2's
    // return: it is parked behind it.
    assert_eq!(holds.admit(P, &j3, 520), Admit::Park { seq: 2, at_ms: 500 });
    let mut back2 = j2.clone();
    back2.parked = Some(1);
    assert_eq!(holds.admit(P, &back2, 530), Admit::Run);
    assert_eq!(
        holds.settled(P, &back2, Settlement::Finished, 540),
        HoldUpdate::Unchanged,
        "not the last parked"
    );
    let mut back3 = j3.clone();
    back3.parked = Some(2);
    assert_eq!(holds.admit(P, &back3, 550), Admit::Run);
    assert_eq!(
        holds.settled(P, &back3, Settlement::Finished, 560),
        HoldUpdate::Write(Change::Let)
    );
    assert!(holds.is_empty());
}

#[test]
fn a_parked_job_back_before_its_blocker_goes_out_again_later() {
    let mut holds = Holds::new(10);
    let j1 = job("k", 1);
    holds.settled(
        P,
        &j1,
        Settlement::Again {
            attempt: 2,
            due_ms: 5_000,
            cause: Cause::Failed,
        },
        0,
    );
    let mut back = job("k", 2);
    back.parked = Some(1);
    // (Its blocker's retry was moved later, say.)
    assert_eq!(holds.admit(P, &back, 100), Admit::Park { seq: 1, at_ms: 5_000 });
    let mut late = job("k", 3);
    late.parked = Some(1);
    assert_eq!(
        holds.admit(P, &late, 6_000),
        Admit::Park {
            seq: 2,
            at_ms: 6_000 + REPARK_AFTER_MS
        }
    );
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
    holds.settled(
        P,
        &j1,
        Settlement::Again {
            attempt: 2,
            due_ms: 60_000,
            cause: Cause::Failed,
        },
        0,
    );
    assert_eq!(holds.release(P, b"k", JobId::new()), None, "another job");
    let Some(Change::Put(h)) = holds.release(P, b"k", j1.id) else {
        panic!("released")
    };
    assert!(!h.holds());
    assert_eq!(holds.admit(P, &job("k", 2), 10), Admit::Run);
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert_eq!(holds.admit(P, &retry, 20), Admit::Released);
    assert_eq!(
        holds.settled(P, &retry, Settlement::Finished, 30),
        HoldUpdate::Write(Change::Let)
    );
}

#[test]
fn holds_are_per_partition_and_dropped_with_it() {
    let mut holds = Holds::new(10);
    let h = Hold {
        blocker: None,
        tail: 3,
        tail_at_ms: 0,
        since_ms: 0,
        released: None,
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
