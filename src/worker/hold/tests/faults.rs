//! Holds through crashes, re-reads, duplicates and outages: jobs read again
//! from uncommitted offsets, copies delivered twice, holds read back by a
//! partition's next owner, pieces that come back late.

use super::*;

#[test]
fn jobs_read_again_after_their_parks_were_written_are_not_parked_again() {
    // Key k in the work topic: job 1 at offset 10 fails; jobs 2 and 3
    // (offsets 11, 12) are parked and handed to Kafka with the hold.
    let mut holds = Holds::new(10);
    let (j1, j2, j3, j4) = (job("k", 1), job("k", 2), job("k", 3), job("k", 4));
    assert_eq!(holds.admit(P, &j1, 0), Admit::Run);
    holds.settled(P, &j1, again(60_000), 0);
    for (j, offset) in [(&j2, 11), (&j3, 12)] {
        let Admit::Park { seq, .. } = holds.admit(P, j, 10) else {
            panic!("parked behind job 1")
        };
        holds.get_mut(P, b"k").expect("held").sent(seq, Some(offset));
    }
    // A parked job out again (its own record at offset 30) does not move
    // the mark: job 4, read at 20 and waiting in memory, was not parked.
    holds.get_mut(P, b"k").expect("held").sent(1, None);
    // The worker dies before the offsets are committed; the next owner
    // reads the hold back, then the partition from offset 10 again.
    let written = holds.get(P, b"k").expect("held").to_write();
    assert_eq!(written.parked_to, 12);
    let mut next = Holds::new(10);
    next.load(P, b"k", Some(written));
    assert!(
        next.read_again(P, &j1, 10),
        "job 1's first run: its failure holds the key"
    );
    assert!(next.read_again(P, &j2, 11), "parked already: not a second number");
    assert!(next.read_again(P, &j3, 12));
    assert!(!next.read_again(P, &j4, 20), "never parked");
    // Its number comes after those the previous owner may have given
    // without writing them down (see `read_back.rs`).
    let p4 = next.admit(P, &j4, 20);
    assert!(
        matches!(p4, Admit::Park { seq, .. } if seq == 3 + LOAD_SKIP),
        "{p4:?}"
    );
    // Job 1's next run (attempt 2) is not a run read again, wherever it
    // sits; nor is a parked job back from the scheduler.
    let mut retry = j1.clone();
    retry.attempt = 2;
    assert!(!next.read_again(P, &retry, 5));
    assert!(!next.read_again(
        P,
        &back(
            &j2,
            Admit::Park {
                seq: 1,
                at_ms: 60_001
            }
        ),
        7
    ));
    // A job that may start early was handed to the scheduler, not parked.
    let mut early = job("k", 5);
    early.early = Some(std::time::Duration::from_secs(1));
    assert!(!next.read_again(P, &early, 9));
    // Another key, or a key not held, is never read again.
    assert!(!next.read_again(P, &job("other", 1), 1));
    // Nor is anything of a key whose blocker an operator released: its
    // next run must be dead-lettered, and its runs cannot be told apart.
    assert!(next.release(P, b"k", j1.id).is_some());
    assert!(!next.read_again(P, &j1, 10));
    assert!(!next.read_again(P, &j2, 11));
}

#[test]
fn a_parked_copy_of_the_blockers_next_run_counts_its_number_in_its_turn() {
    let mut holds = Holds::new(10);
    let (j0, j1, j2, j3) = (job("k", 0), job("k", 1), job("k", 2), job("k", 3));
    let retry_of = |j: &Job, attempt| Job { attempt, ..j.clone() };
    holds.settled(P, &j0, again(1_000), 0);
    let p1 = holds.admit(P, &j1, 10);
    let p2 = holds.admit(P, &j2, 20);
    // A stale copy of job 1's retry (written before a crash, read again
    // now) is parked behind the jobs out, under a number of its own.
    let stale = holds.admit(P, &retry_of(&j1, 2), 30);
    assert!(matches!(stale, Admit::Park { seq: 3, .. }), "{stale:?}");
    let p3 = holds.admit(P, &j3, 40);
    assert!(matches!(p3, Admit::Park { seq: 4, .. }), "{p3:?}");
    assert_eq!(holds.admit(P, &retry_of(&j0, 2), 1_000), Admit::Run);
    holds.settled(P, &retry_of(&j0, 2), Settlement::Finished, 1_010);
    // Job 1 comes back and fails: it holds the key again.
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_100), Admit::Run);
    holds.settled(P, &back1, again(3_000), 1_110);
    // The stale copy of its next run is back before job 2: out again,
    // whether read now or buffered behind job 1 while it ran.
    let copy = back(&retry_of(&j1, 2), stale);
    assert!(matches!(
        holds.park_buffered(P, &copy),
        Some(Admit::Park { seq: 3, .. })
    ));
    assert!(matches!(holds.admit(P, &copy, 1_200), Admit::Park { seq: 3, .. }));
    // Job 1's own retry runs; then job 2, the copy (a duplicate run), job 3.
    assert_eq!(holds.admit(P, &retry_of(&j1, 2), 3_000), Admit::Run);
    holds.settled(P, &retry_of(&j1, 2), Settlement::Finished, 3_010);
    let back2 = back(&j2, p2);
    assert_eq!(holds.admit(P, &back2, 3_020), Admit::Run);
    holds.settled(P, &back2, Settlement::Finished, 3_030);
    assert_eq!(holds.admit(P, &copy, 3_040), Admit::Run);
    holds.settled(P, &copy, Settlement::Finished, 3_050);
    let back3 = back(&j3, p3);
    assert_eq!(holds.admit(P, &back3, 3_060), Admit::Run, "no number is missing");
    assert_eq!(
        holds.settled(P, &back3, Settlement::Finished, 3_070),
        HoldUpdate::Write(HoldWrite::Let)
    );
}

#[test]
fn a_copy_parked_under_an_earlier_hold_of_its_key_is_a_job_like_any_other() {
    let mut holds = Holds::new(10);
    let (j0, j1, j2) = (job("k", 0), job("k", 1), job("k", 2));
    // A first hold parks job 1 as its number 1, and is let go.
    holds.settled(P, &j0, again(1_000), 0);
    let p1 = holds.admit(P, &j1, 10);
    assert_eq!(p1, Admit::Park { seq: 1, at_ms: 1_001 });
    let retry0 = Job {
        attempt: 2,
        ..j0.clone()
    };
    assert_eq!(holds.admit(P, &retry0, 1_000), Admit::Run);
    holds.settled(P, &retry0, Settlement::Finished, 1_005);
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_010), Admit::Run);
    assert_eq!(
        holds.settled(P, &back1, Settlement::Finished, 1_020),
        HoldUpdate::Write(HoldWrite::Let)
    );
    // A second hold of the key numbers its parks apart.
    holds.settled(P, &j2, again(9_000), 5_000);
    let first = first_number(5_000);
    assert_ne!(first >> 32, 0, "another range");
    // The first hold's copy of job 1, read again after a crash, is parked
    // behind job 2's retry under a number of the second hold, not taken
    // for the second hold's first park.
    assert_eq!(
        holds.admit(P, &back1, 5_010),
        Admit::Park {
            seq: first + 1,
            at_ms: 9_001
        }
    );
    assert!(!holds.get(P, b"k").unwrap().gave(1));
}

#[test]
fn a_park_of_the_keys_hold_before_is_not_taken_for_one_of_the_hold_now() {
    // Two holds of key k that began 93.7 s apart (times from a soak run):
    // under the narrow numbering both drew the same 10-bit range, and the
    // first hold's parks, still coming back, were taken for the second's:
    // the key then waited for numbers nobody had given.
    let (first_began, second_began) = (1_795_815_930_198, 1_795_816_023_921);
    assert_ne!(first_number(first_began), first_number(second_began));
    let mut first = Holds::new(10);
    let (j0, j1, j2) = (job("k", 0), job("k", 1), job("k", 2));
    first.settled(P, &j0, again(first_began + 60_000), first_began);
    let Admit::Park { seq: old, .. } = first.admit(P, &j1, first_began + 10) else {
        panic!("parked behind job 0")
    };
    // The first hold is long let go; a job of k fails and holds it again.
    let mut second = Holds::new(10);
    second.settled(P, &j2, again(second_began + 60_000), second_began);
    let h = second.get(P, b"k").expect("held");
    assert!(!h.gave(old), "park {old:#x} is the first hold's");
    // Job 1's copy from the first hold comes back: a job like any other,
    // parked behind job 2's retry under the second hold's first number.
    let back1 = Job {
        parked: Some(old),
        ..j1
    };
    assert_eq!(
        second.admit(P, &back1, second_began + 10),
        Admit::Park {
            seq: first_number(second_began) + 1,
            at_ms: second_began + 60_001
        }
    );
}

/// Key `k` held by a failing job 0 (its retry due at 1 000), `jobs` parked
/// behind it (each park handed to Kafka), then job 0's retry back and
/// succeeded: the table, and each job's park.
fn parked_behind_a_retry_that_succeeded(jobs: &[&Job]) -> (Holds<i32>, Vec<Admit>) {
    let mut holds = Holds::new(10);
    let j0 = job("k", 0);
    holds.settled(P, &j0, again(1_000), 0);
    let mut parks = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let p = holds.admit(P, j, 10 * (i as i64 + 1));
        let Admit::Park { seq, .. } = p else {
            panic!("parked: {p:?}")
        };
        holds.get_mut(P, b"k").expect("held").sent(seq, None);
        parks.push(p);
    }
    let retry0 = Job { attempt: 2, ..j0 };
    assert_eq!(holds.admit(P, &retry0, 1_000), Admit::Run);
    holds.settled(P, &retry0, Settlement::Finished, 1_010);
    (holds, parks)
}

#[test]
fn a_parked_job_holding_its_key_keeps_its_place_when_the_hold_is_read_back() {
    let (j1, j2) = (job("k", 1), job("k", 2));
    let retry_of = |j: &Job, attempt| Job { attempt, ..j.clone() };
    let (mut holds, parks) = parked_behind_a_retry_that_succeeded(&[&j1, &j2]);
    let (p1, p2) = (parks[0], parks[1]);
    // Job 1 comes back, runs in its turn and fails: it holds the key, in
    // its place (number 1).
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_100), Admit::Run);
    let HoldUpdate::Write(HoldWrite::Put(written)) = holds.settled(P, &back1, again(3_000), 1_110) else {
        panic!("held again: written")
    };
    // Its worker dies; the next owner reads the hold back. Job 1's retry
    // (no park number: retries are not parked) runs and succeeds, then
    // job 2 comes back: its turn, nothing before it is missing.
    let mut next = Holds::new(10);
    next.load(P, b"k", Some(written.to_write()));
    assert_eq!(next.admit(P, &retry_of(&j1, 2), 3_000), Admit::Run);
    next.settled(P, &retry_of(&j1, 2), Settlement::Finished, 3_010);
    assert_eq!(next.admit(P, &back(&j2, p2), 3_020), Admit::Run, "job 2 is next");
    assert_eq!(
        next.settled(P, &back(&j2, p2), Settlement::Finished, 3_030),
        HoldUpdate::Write(HoldWrite::Let)
    );
}

#[test]
fn parked_jobs_back_while_their_blocker_is_overdue_go_round_less_often() {
    let mut holds = Holds::new(10).give_up_after(600_000);
    let j1 = job("k", 1);
    holds.settled(P, &j1, again(1_000), 0);
    let p2 = holds.admit(P, &job("k", 2), 10);
    let back2 = back(&job("k", 2), p2);
    // The blocker's retry is late (an outage): job 2, back each time it is
    // due, goes out again after half the time the retry is overdue, from a
    // second up to 30 s.
    let mut now = 1_001;
    let mut rounds = Vec::new();
    while now < 1_000 + 600_000 {
        let Admit::Park { seq: 1, at_ms } = holds.admit(P, &back2, now) else {
            panic!("out again while the retry is missing, at {now}")
        };
        rounds.push(at_ms - now);
        now = at_ms;
    }
    assert_eq!(&rounds[..4], &[1_000, 1_000, 1_000, 1_500]);
    assert_eq!(rounds.iter().max(), Some(&BACK_OFF_MAX_MS));
    assert!(rounds.len() < 40, "{} rounds in ten minutes", rounds.len());
    // Once the give-up time is over, the key goes on without the retry.
    assert_eq!(holds.admit(P, &back2, 1_000 + 600_000 + 1), Admit::Run);
    assert_eq!(holds.get(P, b"k").map(|h| h.gave_up), Some(1));
}

#[test]
fn an_earlier_run_of_the_job_holding_its_key_is_finished_without_running() {
    let mut holds = Holds::new(10);
    let (j1, j2) = (job("k", 1), job("k", 2));
    holds.settled(P, &j1, again(1_000), 0);
    // Job 1's first run, delivered again (read from an uncommitted offset,
    // or a copy fired twice): its failure already holds the key.
    assert_eq!(holds.admit(P, &j1, 10), Admit::Stale);
    assert_eq!(holds.park_buffered(P, &j1), Some(Admit::Stale));
    let h = holds.get(P, b"k").expect("held");
    assert_eq!(h.blocker.as_ref().map(|b| (b.id, b.attempt)), Some((j1.id, 2)));
    // Its next run is not stale: it runs, and the key goes on.
    let retry = Job {
        attempt: 2,
        ..j1.clone()
    };
    assert!(matches!(holds.admit(P, &j2, 20), Admit::Park { seq: 1, .. }));
    assert_eq!(holds.admit(P, &retry, 1_000), Admit::Run);
}

#[test]
fn a_parked_job_run_twice_does_not_hold_its_key_again_when_its_second_run_fails() {
    let (j1, j2) = (job("k", 1), job("k", 2));
    let (mut holds, parks) = parked_behind_a_retry_that_succeeded(&[&j1, &j2]);
    let (p1, p2) = (parks[0], parks[1]);
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_020), Admit::Run);
    holds.settled(P, &back1, Settlement::Finished, 1_030);
    // A second copy of job 1 runs as any duplicate does, and fails: the
    // key keeps its place, job 2 is next.
    assert_eq!(holds.admit(P, &back1, 1_040), Admit::Run, "a duplicate runs");
    assert_eq!(
        holds.settled(P, &back1, again(2_000), 1_050),
        HoldUpdate::Unchanged
    );
    let h = holds.get(P, b"k").expect("held");
    assert!(h.blocker.is_none(), "{h:?}");
    assert_eq!(holds.admit(P, &back(&j2, p2), 1_060), Admit::Run);
    assert_eq!(
        holds.settled(P, &back(&j2, p2), Settlement::Finished, 1_070),
        HoldUpdate::Write(HoldWrite::Let)
    );
}

#[test]
fn jobs_waiting_in_memory_for_late_parked_jobs_are_parked_behind_them_in_their_order() {
    let mut holds = Holds::new(10);
    let (j1, j2, j3, j4) = (job("k", 1), job("k", 2), job("k", 3), job("k", 4));
    holds.settled(P, &j1, again(1_000), 0);
    let p2 = holds.admit(P, &j2, 10);
    let retry = Job {
        attempt: 2,
        ..j1.clone()
    };
    assert_eq!(holds.admit(P, &retry, 1_000), Admit::Run);
    holds.settled(P, &retry, Settlement::Finished, 1_010);
    // Job 2 is due now: jobs 3 and 4 wait for it in memory.
    assert_eq!(holds.admit(P, &j3, 1_020), Admit::Wait);
    assert_eq!(holds.admit(P, &j4, 1_030), Admit::Wait);
    assert!(holds.overdue_waiting(1_020 + MAX_WAIT_MS - 1).is_empty());
    // Job 2 is late: they go out behind it, in their order, and the key
    // still waits for job 2 (nothing given up).
    assert_eq!(
        holds.overdue_waiting(1_020 + MAX_WAIT_MS),
        vec![(P, Box::from(&b"k"[..]))]
    );
    let parked = holds.park_waiting(P, &[&j3, &j4]);
    assert!(
        matches!(
            parked[..],
            [Admit::Park { seq: 2, .. }, Admit::Park { seq: 3, .. }]
        ),
        "{parked:?}"
    );
    assert!(holds.overdue_waiting(60_000).is_empty());
    assert_eq!(holds.get(P, b"k").map(|h| h.gave_up), Some(0));
    assert!(matches!(
        holds.admit(P, &back(&j3, parked[0]), 7_000),
        Admit::Park { seq: 2, .. }
    ));
    assert_eq!(holds.admit(P, &back(&j2, p2), 7_100), Admit::Run);
}

#[test]
fn a_numbered_copy_of_an_earlier_run_of_the_job_holding_its_key_still_counts_its_number() {
    let (j1, j2) = (job("k", 1), job("k", 2));
    // Job 1 is parked twice (its copy from an earlier hold read again after
    // a crash), then job 2.
    let (mut holds, parks) = parked_behind_a_retry_that_succeeded(&[&j1, &j1, &j2]);
    let (p1, copy, p2) = (parks[0], parks[1], parks[2]);
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_020), Admit::Run);
    holds.settled(P, &back1, again(2_000), 1_030);
    // The second copy (attempt 1, number 2) is not finished unseen: its
    // number must come round, or job 2 would wait for it for good. It is
    // next in line: taken as the blocker's next run.
    let copy = back(&j1, copy);
    assert_eq!(holds.admit(P, &copy, 1_040), Admit::Run);
    holds.settled(P, &copy, Settlement::Finished, 1_050);
    assert_eq!(
        holds.admit(P, &back(&j2, p2), 1_060),
        Admit::Run,
        "no number is missing"
    );
}

#[test]
fn a_second_copy_of_a_parked_job_holding_its_key_is_not_taken_for_its_next_run() {
    let (j1, j2) = (job("k", 1), job("k", 2));
    let (mut holds, parks) = parked_behind_a_retry_that_succeeded(&[&j1, &j2]);
    let (p1, p2) = (parks[0], parks[1]);
    // Job 1 comes back, runs in its turn and fails: it holds the key.
    let back1 = back(&j1, p1);
    assert_eq!(holds.admit(P, &back1, 1_020), Admit::Run);
    holds.settled(P, &back1, again(3_000), 1_030);
    // A second copy of its park (fired twice, or read again after a
    // crash): its number is counted, and it is not job 1's next run.
    assert_eq!(holds.admit(P, &back1, 1_040), Admit::Stale);
    assert_eq!(holds.park_buffered(P, &back1), Some(Admit::Stale));
    assert!(
        matches!(holds.admit(P, &back(&j2, p2), 1_050), Admit::Park { seq: 2, .. }),
        "job 2 waits for job 1's next run"
    );
}
