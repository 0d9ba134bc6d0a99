//! [`WorkerJobs`]'s transitions, without a broker: what holds a
//! partition's commit point, what a release waits for and returns, and
//! what an earlier ownership can no longer move.

use super::*;

const TP: Tp = (0, 3);

fn jobs() -> WorkerJobs {
    WorkerJobs::new(Holds::new(16))
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
