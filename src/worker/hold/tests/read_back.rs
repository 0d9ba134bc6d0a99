//! Holds read back by a partition's next owner after the previous one
//! stopped between writing parks and writing the hold that counts them.

use super::*;

fn attempt(j: &Job, attempt: u32) -> Job {
    Job { attempt, ..j.clone() }
}

#[test]
fn numbers_a_previous_owner_may_have_given_without_writing_them_down_are_not_given_again() {
    // The previous owner: job 0 fails and holds key k; job 1 is parked as
    // number 1 (written). Job 0's retry succeeds, job 1 comes back and
    // fails in turn: it holds the key, and the hold is written.
    let mut holds = Holds::new(10);
    let (j0, j1, j2) = (job("k", 0), job("k", 1), job("k", 2));
    holds.settled(P, &j0, again(1_000), 0);
    let p1 = holds.admit(P, &j1, 10);
    assert_eq!(p1, Admit::Park { seq: 1, at_ms: 1_001 });
    holds.get_mut(P, b"k").expect("held").sent(1, Some(11));
    assert_eq!(holds.admit(P, &attempt(&j0, 2), 1_000), Admit::Run);
    holds.settled(P, &attempt(&j0, 2), Settlement::Finished, 1_005);
    assert_eq!(holds.admit(P, &back(&j1, p1), 1_010), Admit::Run);
    holds.settled(P, &back(&j1, p1), again(3_000), 1_020);
    let written = holds.get(P, b"k").expect("held").to_write();
    // Job 2 (offset 14) is parked as number 2 and Kafka has the park, but
    // the owner stops before the hold that counts it is written.
    let p2 = holds.admit(P, &j2, 1_030);
    assert_eq!(p2, Admit::Park { seq: 2, at_ms: 3_001 });
    holds.get_mut(P, b"k").expect("held").sent(2, Some(14));

    // The next owner reads the hold back and the partition from offset 12
    // (the offsets were committed up to there): job 0's retry, which the
    // previous owner ran as the blocker's next run, is a job like any other
    // now, parked behind job 1's retry. It must not get number 2.
    let mut next = Holds::new(10);
    next.load(P, b"k", Some(written));
    assert!(!next.read_again(P, &attempt(&j0, 2), 12));
    let copy0 = next.admit(P, &attempt(&j0, 2), 1_100);
    let Admit::Park { seq: first, .. } = copy0 else {
        panic!("parked behind job 1's retry: {copy0:?}")
    };
    assert_eq!(
        first,
        2 + LOAD_SKIP,
        "past the numbers the previous owner may have given"
    );
    assert_eq!(next.admit(P, &back(&j1, p1), 1_110), Admit::Stale);
    let again2 = next.admit(P, &j2, 1_120);
    assert!(
        matches!(again2, Admit::Park { seq, .. } if seq == first + 1),
        "{again2:?}"
    );
    assert_eq!(
        next.get(P, b"k").expect("held").parked(),
        3,
        "numbers 1 and the two new ones"
    );

    // Job 1's retry succeeds; job 0's copy comes back and fails: it holds
    // the key, in its place.
    assert_eq!(next.admit(P, &attempt(&j1, 2), 3_000), Admit::Run);
    next.settled(P, &attempt(&j1, 2), Settlement::Finished, 3_010);
    let copy0 = back(&attempt(&j0, 2), copy0);
    assert_eq!(next.admit(P, &copy0, 3_020), Admit::Run);
    let fails = Settlement::Again {
        attempt: 3,
        due_ms: 5_000,
        cause: Cause::Failed,
    };
    next.settled(P, &copy0, fails, 3_030);
    // The previous owner's park of job 2 comes back with number 2: not a
    // number this owner gave, so it is not let in past job 0's retry.
    let orphan = next.admit(P, &back(&j2, p2), 3_040);
    assert!(
        matches!(orphan, Admit::Park { at_ms, .. } if at_ms > 5_000),
        "job 2 must wait for job 0: {orphan:?}"
    );
    // Job 0's retry, then job 2 and the orphan's new park, in order.
    assert_eq!(next.admit(P, &attempt(&j0, 3), 5_000), Admit::Run);
    next.settled(P, &attempt(&j0, 3), Settlement::Finished, 5_010);
    assert_eq!(next.admit(P, &back(&j2, again2), 5_020), Admit::Run);
    next.settled(P, &back(&j2, again2), Settlement::Finished, 5_030);
    let orphan = back(&j2, orphan);
    assert_eq!(next.admit(P, &orphan, 5_040), Admit::Run);
    assert_eq!(
        next.settled(P, &orphan, Settlement::Finished, 5_050),
        HoldUpdate::Write(HoldWrite::Let),
        "no number is missing"
    );
}

#[test]
fn an_owner_reading_back_a_hold_read_back_before_passes_over_that_owners_numbers_too() {
    let mut holds = Holds::new(10);
    let (j0, j1, j2) = (job("k", 0), job("k", 1), job("k", 2));
    holds.settled(P, &j0, again(1_000), 0);
    let p1 = holds.admit(P, &j1, 10);
    holds.get_mut(P, b"k").expect("held").sent(1, Some(11));
    let written = holds.get(P, b"k").expect("held").to_write();
    assert!(written.skipped().is_empty());

    // A second owner reads it back: its skip must be written before it
    // parks past it; the record keeps the skip.
    let mut second = Holds::new(10);
    second.load(P, b"k", Some(written));
    let h = second.get(P, b"k").expect("held");
    assert!(h.skip_unwritten());
    let rec = record::record("held", None, "t", b"k", &HoldWrite::Put(h.to_write()));
    let read = record::decode(rec.value.as_deref()).unwrap().expect("a hold");
    assert_eq!(
        read.skipped(),
        [Skip {
            after: 1,
            upto: 1 + LOAD_SKIP
        }]
    );
    assert!(!read.skip_unwritten(), "not kept");
    let Admit::Park {
        seq: second_first, ..
    } = second.admit(P, &j2, 20)
    else {
        panic!("parked")
    };
    assert_eq!(second_first, 2 + LOAD_SKIP);

    // It stops before writing anything else: a third owner reads back the
    // hold with the second one's skip, and passes over the second owner's
    // numbers as well.
    let mut third = Holds::new(10);
    third.load(P, b"k", Some(read.clone()));
    let h = third.get(P, b"k").expect("held");
    assert_eq!(
        h.skipped(),
        [Skip {
            after: 1,
            upto: 1 + 2 * LOAD_SKIP
        }]
    );
    assert!(!h.gave(second_first), "the second owner's number is passed over");
    assert!(h.gave(1), "number 1 was written");
    let Admit::Park { seq: third_first, .. } = third.admit(P, &j2, 30) else {
        panic!("parked")
    };
    assert_eq!(third_first, 2 + 2 * LOAD_SKIP);
    // Job 0's retry, then job 1 (number 1), then job 2 in the third
    // owner's number: the key's order, nothing missing.
    assert_eq!(third.admit(P, &attempt(&j0, 2), 1_000), Admit::Run);
    third.settled(P, &attempt(&j0, 2), Settlement::Finished, 1_010);
    assert_eq!(
        third.admit(
            P,
            &back(
                &j2,
                Admit::Park {
                    seq: third_first,
                    at_ms: 1_001
                }
            ),
            1_020
        ),
        Admit::Park {
            seq: third_first,
            at_ms: 2_020
        },
        "job 2 back before job 1: out again"
    );
    assert_eq!(third.admit(P, &back(&j1, p1), 1_030), Admit::Run);
    third.settled(P, &back(&j1, p1), Settlement::Finished, 1_040);
    let back2 = back(
        &j2,
        Admit::Park {
            seq: third_first,
            at_ms: 2_020,
        },
    );
    assert_eq!(third.admit(P, &back2, 2_020), Admit::Run);
    assert_eq!(
        third.settled(P, &back2, Settlement::Finished, 2_030),
        HoldUpdate::Write(HoldWrite::Let)
    );
    // A hold written since its last skip (number 5 past it) gets one more.
    let h = Hold {
        last_seq: 5 + LOAD_SKIP,
        ..read
    };
    let mut fourth = Holds::new(10);
    fourth.load(P, b"k", Some(h));
    let skips = [
        Skip {
            after: 1,
            upto: 1 + LOAD_SKIP,
        },
        Skip {
            after: 5 + LOAD_SKIP,
            upto: 5 + 2 * LOAD_SKIP,
        },
    ];
    assert_eq!(fourth.get(P, b"k").expect("held").skipped(), skips);
}

#[test]
#[cfg(target_pointer_width = "64")]
fn a_hold_without_skips_or_a_release_stays_128_bytes() {
    // Each held key keeps a boxed hold (the memory bench's 100,000 held
    // keys): skips sit with a release, boxed apart.
    assert_eq!(std::mem::size_of::<Hold>(), 128);
}

#[test]
fn a_hold_read_back_again_and_again_near_the_last_number_still_parks() {
    // A hold whose numbers near the end of their range, read back far more
    // often than its numbers allow skips for: one of the old, narrow form
    // (its range the last there is), and one of the wide form.
    let wide_end = first_number(1_000) | u64::from(u32::MAX);
    for (since, skip, end) in [
        (0, LOAD_SKIP, u64::from(u32::MAX)),
        (1_000, LOAD_SKIP_WIDE, wide_end),
    ] {
        let mut holds = Holds::new(10);
        let (j0, j1) = (job("k", 0), job("k", 1));
        holds.settled(P, &j0, again(since + 1_000), since);
        let mut h = holds.get(P, b"k").expect("held").to_write();
        h.last_seq = end - 3 * skip;
        h.done_seq = h.last_seq;
        for _ in 0..10 {
            let mut next = Holds::new(10);
            next.load(P, b"k", Some(h));
            h = next.get(P, b"k").expect("held").to_write();
        }
        assert!(h.skipped().iter().all(|s| s.upto < end), "{:?}", h.skipped());
        let mut next = Holds::new(10);
        next.load(P, b"k", Some(h));
        let Admit::Park { seq, .. } = next.admit(P, &j1, since + 10) else {
            panic!("parked behind job 0's retry")
        };
        assert_eq!(seq, end, "the one number left");
        let h = next.get(P, b"k").expect("held");
        assert!(h.gave(seq));
        if since == 0 {
            assert_eq!(h.next_number(seq), seq, "a narrow hold stays narrow");
        }
    }
}
