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
    jobs.write_done(TP, 5, generation, true);
    assert_eq!(jobs.take_commit_points(), vec![(TP, 6, None)]);
    assert!(jobs.take_commit_points().is_empty(), "taken once");
}

#[test]
fn a_write_given_up_leaves_its_record_to_be_read_again() {
    let jobs = jobs();
    assign(&jobs, None);
    let (_, generation) = jobs.begin_write(TP, 5).expect("owned");
    jobs.write_done(TP, 5, generation, false);
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
    jobs.write_done(TP, 5, old, true);
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
        s.spawn(|| jobs.write_done(TP, 3, generation, true));
        assert!(jobs
            .wait_idle(&[TP], Instant::now() + Duration::from_secs(10))
            .is_empty());
    });
    assert_eq!(
        jobs.let_go(&[TP]),
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
