//! [`WorkerJobs`]'s transitions, without a broker: what holds a
//! partition's commit point, what a release waits for and returns, and
//! what an earlier ownership can no longer move.

use super::*;

const TP: Tp = (0, 3);

fn jobs() -> WorkerJobs {
    WorkerJobs::new(Holds::new(16), None)
}

/// Exactly-once mode, work topic `work` (partition 3 is [`TP`]).
fn eos_jobs() -> WorkerJobs {
    let naming = Naming {
        held: "held".into(),
        topics: vec!["work".into()],
    };
    WorkerJobs::new(Holds::new(16), Some(naming))
}

/// The progress record of a round, decoded.
fn progress_of(round: &Round) -> Option<Done> {
    round.pinned.iter().find_map(|(p, r)| {
        assert_eq!(*p, TP.1, "on the work partition's number");
        let (claim, topic) = progress::split_key(&r.key)?;
        assert_eq!((claim, topic), (7, "work"));
        progress::decode(r.value.as_deref()).unwrap()
    })
}

fn assign(jobs: &WorkerJobs, claim: Option<u64>) -> CancellationToken {
    let stop = CancellationToken::new();
    let claims: HashMap<Tp, u64> = claim.map(|c| (TP, c)).into_iter().collect();
    jobs.assign(&[TP], &claims, &stop);
    stop
}

#[test]
fn a_write_off_the_poll_thread_holds_the_commit_point_until_it_is_written() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 5).expect("owned");
    assert!(jobs.take_commit_points().is_empty(), "record 5 unfinished");
    assert_eq!(jobs.uncommitted(), 1);
    jobs.write_done(TP, 5, generation, Some(Vec::new()));
    assert_eq!(jobs.take_commit_points(), vec![(TP, 6, None)]);
    assert!(jobs.take_commit_points().is_empty(), "taken once");
}

#[test]
fn a_write_given_up_leaves_its_record_to_be_read_again() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 5).expect("owned");
    jobs.write_done(TP, 5, generation, None);
    assert!(jobs.take_commit_points().is_empty());
    assert!(
        jobs.wait_idle(&[TP], Instant::now()).is_empty(),
        "not running any more"
    );
}

#[test]
fn nothing_is_begun_or_finished_for_a_partition_not_owned() {
    let jobs = jobs();
    assert!(jobs.begin_write(TP, 5).is_none());
    jobs.finish_now(TP, 5);
    jobs.track_read([(TP, 6)]);
    assert!(jobs.take_commit_points().is_empty());
    assert_eq!(jobs.uncommitted(), 0);
}

#[test]
fn a_write_of_an_earlier_ownership_moves_no_commit_point_of_the_next() {
    let jobs = jobs();
    assign(&jobs, None);
    let (cancel, old) = jobs.begin_write(TP, 5).expect("owned");
    assert_eq!(jobs.drop_partitions(&[TP]), 0);
    assert!(
        cancel.is_cancelled(),
        "a release cancels what runs for the partition"
    );
    assert_eq!(
        jobs.wait_idle(&[TP], Instant::now()),
        vec![TP],
        "the write still runs at the deadline"
    );
    jobs.let_go(&[TP]);
    assign(&jobs, None);
    jobs.track_read([(TP, 5)]);
    jobs.write_done(TP, 5, old, Some(Vec::new()));
    assert!(
        jobs.take_commit_points().is_empty(),
        "5 is unfinished for the new owner"
    );
}

#[test]
fn a_release_waits_for_the_writes_of_its_partitions_and_returns_their_claimed_commit_point() {
    let jobs = jobs();
    assign(&jobs, Some(42));
    jobs.finish_now(TP, 2);
    let (_, generation) = jobs.begin_write(TP, 3).expect("owned");
    std::thread::scope(|s| {
        s.spawn(|| jobs.write_done(TP, 3, generation, Some(Vec::new())));
        assert!(jobs
            .wait_idle(&[TP], Instant::now() + Duration::from_secs(10))
            .is_empty());
    });
    assert_eq!(
        jobs.let_go(&[TP]).points,
        vec![(TP, 4, Some(42))],
        "every commit names the claim"
    );
    assert!(jobs.owned().is_empty());
    assert!(
        jobs.take_commit_points().is_empty(),
        "nothing left to store for it"
    );
}

#[test]
fn the_keep_alive_commits_only_when_the_coordinator_has_not_answered_lately() {
    let jobs = jobs();
    assign(&jobs, None);
    jobs.finish_now(TP, 7);
    assert_eq!(
        jobs.keep_alive_points(Duration::from_secs(3600)),
        None,
        "just assigned: answered now"
    );
    assert_eq!(jobs.keep_alive_points(Duration::ZERO), Some(vec![(TP, 8, None)]));
}

/// A record to stage, told apart by its topic.
fn rec(name: &str) -> OwnedRecord {
    OwnedRecord {
        topic: name.into(),
        key: Vec::new(),
        value: None,
        headers: Default::default(),
    }
}

fn topics(round: &Round) -> Vec<(i64, String)> {
    let recs = round.records.iter();
    recs.flat_map(|(_, o, rs)| rs.iter().map(move |r| (*o, r.topic.clone())))
        .collect()
}

#[test]
fn staged_writes_go_with_the_commit_point_past_them_and_not_before() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 3).expect("owned");
    jobs.track_read([(TP, 4), (TP, 5)]);
    // 5 finishes first: its writes wait for 4.
    assert!(jobs.stage(TP, generation, 5, vec![rec("five-a"), rec("five-b")]));
    jobs.lock().finish(TP, 5, Some(generation));
    jobs.write_done(TP, 3, generation, Some(vec![rec("three")]));
    let round = jobs.take_round(None);
    assert_eq!(round.points, vec![(TP, 4, None)]);
    assert_eq!(
        topics(&round),
        vec![(3, "three".to_string())],
        "not 5's: 4 is unfinished"
    );
    assert!(jobs.stage(TP, generation, 4, Vec::new()));
    jobs.lock().finish(TP, 4, Some(generation));
    let round = jobs.take_round(None);
    assert_eq!(round.points, vec![(TP, 6, None)]);
    assert_eq!(round.record_count(), 2);
    assert_eq!(
        topics(&round),
        vec![(5, "five-a".to_string()), (5, "five-b".to_string())],
        "in the order staged"
    );
    assert_eq!(jobs.take_round(None).record_count(), 0, "taken once");
}

#[test]
fn an_aborted_round_is_taken_again_by_the_next() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 0).expect("owned");
    jobs.write_done(TP, 0, generation, Some(vec![rec("zero")]));
    let round = jobs.take_round(None);
    jobs.put_back(round);
    let (_, generation) = jobs.begin_write(TP, 1).expect("owned");
    jobs.write_done(TP, 1, generation, Some(vec![rec("one")]));
    let again = jobs.take_round(None);
    assert_eq!(again.points, vec![(TP, 2, None)], "the point moved on since");
    assert_eq!(
        topics(&again),
        vec![(0, "zero".to_string()), (1, "one".to_string())]
    );
}

#[test]
fn a_release_commits_the_writes_below_its_point_and_drops_the_rest() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 0).expect("owned");
    jobs.track_read([(TP, 1), (TP, 2)]);
    jobs.write_done(TP, 0, generation, Some(vec![rec("zero")]));
    assert!(jobs.stage(TP, generation, 2, vec![rec("two")]));
    jobs.lock().finish(TP, 2, Some(generation));
    let round = jobs.let_go(&[TP]);
    assert_eq!(round.points, vec![(TP, 1, None)]);
    assert_eq!(
        topics(&round),
        vec![(0, "zero".to_string())],
        "2 runs again elsewhere"
    );
    assert!(
        !jobs.stage(TP, generation, 3, vec![rec("late")]),
        "a partition let go takes nothing more"
    );
    assign(&jobs, None);
    assert!(
        !jobs.stage(TP, generation, 3, vec![rec("late")]),
        "nor does its next ownership from the earlier one"
    );
    assert_eq!(
        jobs.take_round(None).record_count(),
        0,
        "nothing of the first ownership is left"
    );
}

#[test]
fn exactly_once_a_holdable_partition_commits_finished_jobs_above_its_point_with_its_progress() {
    let jobs = eos_jobs();
    assign(&jobs, Some(7));
    jobs.track_read([(TP, 10), (TP, 11), (TP, 12)]);
    let generation = jobs.lock().owned[&TP].generation;
    assert!(jobs.stage(TP, generation, 11, vec![rec("follow-up 11")]));
    assert!(jobs.take_round(None).is_empty(), "staged, not finished: nothing");
    jobs.lock().finish(TP, 11, Some(generation));
    let round = jobs.take_round(None);
    assert_eq!(round.points, vec![(TP, 10, Some(7))], "under the claim");
    assert_eq!(round.records, vec![(TP, 11, vec![rec("follow-up 11")])]);
    assert_eq!(
        progress_of(&round),
        Some(Done {
            to: 13,
            open: vec![10, 12]
        })
    );
    assert!(jobs.take_round(None).is_empty(), "taken once");
}

#[test]
fn exactly_once_a_changed_hold_goes_with_the_next_round_and_again_after_an_abort() {
    let jobs = eos_jobs();
    assign(&jobs, Some(7));
    jobs.track_read([(TP, 10)]);
    jobs.lock().dirty.entry(TP).or_default().insert(b"k".to_vec());
    let round = jobs.take_round(None);
    let holds: Vec<&OwnedRecord> = round
        .pinned
        .iter()
        .map(|(_, r)| r)
        .filter(|r| {
            record::split_key(&r.key).is_some_and(|(c, t, k)| (c, t, k) == (Some(7), "work", b"k".as_slice()))
        })
        .collect();
    assert_eq!(holds.len(), 1);
    assert_eq!(holds[0].value, None, "not held any more: let go");
    assert_eq!(round.points, vec![(TP, 10, Some(7))]);
    assert_eq!(
        progress_of(&round),
        Some(Done {
            to: 11,
            open: vec![10]
        })
    );
    jobs.put_back(round);
    let again = jobs.take_round(None);
    assert_eq!(again.dirty, vec![(TP, b"k".to_vec())], "aborted: taken again");
    assert!(jobs.take_round(None).is_empty());
}

#[test]
fn records_the_last_owner_did_are_skipped_and_move_no_point_past_one_not_done() {
    let jobs = eos_jobs();
    assign(&jobs, Some(7));
    jobs.lock().done_above.insert(
        TP,
        Done {
            to: 14,
            open: vec![11, 13],
        },
    );
    // 12 comes first: finished alone, it would move the point past 11.
    let left = jobs.skip_done(vec![12, 11, 10, 13], |o: &i64| (TP, *o));
    assert_eq!(left, vec![11, 13]);
    assert_eq!(jobs.lock().tracker.commit_point(TP), Some(11));
    // What this owner commits counts what the last one did beyond what it
    // read so far.
    jobs.lock().done_above.insert(
        TP,
        Done {
            to: 20,
            open: vec![11, 13, 17],
        },
    );
    let generation = jobs.lock().owned[&TP].generation;
    assert!(jobs.stage(TP, generation, 13, vec![rec("follow-up 13")]));
    jobs.lock().finish(TP, 13, Some(generation));
    let round = jobs.take_round(None);
    assert_eq!(
        progress_of(&round),
        Some(Done {
            to: 20,
            open: vec![11, 17]
        })
    );
}
