//! [`SchedulerJobs`]'s transitions, without a broker or a store: a job's way from
//! a read batch to its fire, and what a partition's move waits for.

use chrono::{TimeZone, Utc};

use super::*;
use crate::job::Job;
use crate::scheduler::service::batch::{Named, Record};

const NOW: i64 = 1_700_000_000_000;
const SPAN_MS: i64 = 60_000;

fn job(key: &str, run_at_ms: i64, seq: u64) -> StoredJob {
    let job = Job::new("emails", key, b"p".to_vec()).at(Utc.timestamp_millis_opt(run_at_ms).unwrap());
    StoredJob { job, seq }
}

/// Partitions 0 and 1 owned, their window loaded up to now + span with
/// `stored` (as a refill from the store would), room for `capacity` jobs.
fn jobs_with(capacity: usize, stored: &[(i32, StoredJob)]) -> SchedulerJobs {
    let jobs = SchedulerJobs::new(TimerWheel::new(SPAN_MS, capacity), None);
    for p in [0, 1] {
        jobs.assign(p);
        let got: Vec<(DueKey, StoredJob)> = stored
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, s)| (DueKey::of(p, s), s.clone()))
            .collect();
        jobs.with_window(|w| {
            let read = w.begin_refill(p, NOW, i64::MAX).expect("a refill is due");
            assert!(w.finish_refill(read, got));
        });
    }
    jobs
}

fn read_all() -> HashMap<i32, i64> {
    [(0, i64::MAX), (1, i64::MAX)].into_iter().collect()
}

fn take(jobs: &SchedulerJobs) -> Taken {
    jobs.take_round(NOW, 100, &read_all())
}

/// Claim a read batch of one record, `command` at `offset` of `p`; what
/// it names, and how each stood.
fn claim_one(jobs: &SchedulerJobs, p: i32, offset: i64, command: Command) -> HashMap<(i32, JobId), Claimed> {
    let mut read = [ReadBatch {
        records: vec![Record {
            partition: p,
            offset,
            command,
        }],
        ..ReadBatch::default()
    }];
    jobs.claim(&mut read);
    let [b] = read;
    b.named
}

/// An ingest batch of partition `p` that puts `s` (due now) at its offset,
/// claimed and taken as the apply thread does, with its direct candidates
/// moved to `direct`.
fn apply_put(
    jobs: &SchedulerJobs,
    p: i32,
    s: StoredJob,
) -> (HashMap<i32, PartitionBatch>, HashMap<(i32, JobId), Claimed>) {
    let offset = s.seq as i64;
    let named = claim_one(jobs, p, offset, Command::Schedule(s.job.clone()));
    let mut pb = PartitionBatch {
        last_offset: offset,
        ..PartitionBatch::default()
    };
    for ((_, id), claim) in jobs.take_named(&named) {
        pb.ids.insert(
            id,
            Named {
                claim,
                ..Named::default()
            },
        );
    }
    pb.named(s.job.stored_id()).now = Some(Some(0));
    pb.due_puts.push(0);
    pb.changes.push(Change::Put(s));
    if !jobs.direct_candidates(p, &pb).is_empty() {
        let Some(Change::Put(s)) = pb.changes.pop() else {
            unreachable!()
        };
        pb.direct.push(s);
    }
    let mut parts: HashMap<i32, PartitionBatch> = HashMap::default();
    parts.insert(p, pb);
    (parts, named)
}

#[test]
fn a_direct_job_holds_its_partitions_commit_from_admit_until_its_fire_is_released() {
    let jobs = jobs_with(100, &[]);
    let (mut parts, named) = apply_put(&jobs, 0, job("a", NOW - 5, 7));
    assert_eq!(
        parts[&0].direct.len(),
        1,
        "due on arrival, named once, window loaded: a direct job"
    );
    jobs.frontier(&mut parts);
    assert_eq!(
        parts[&0].schedule_next, None,
        "nothing stored moves the checkpoint"
    );
    let fallback = jobs.admit(&[], &mut parts, NOW, &named);
    assert!(fallback.is_empty());
    jobs.settle(&parts, &fallback);
    assert_eq!(
        jobs.offsets_to_store(),
        vec![(0, 6)],
        "committable up to just below the direct job"
    );
    assert_eq!(jobs.direct_in_flight(), 1);

    let t = take(&jobs);
    assert_eq!(t.due.len(), 1);
    assert!(t.direct.contains_key(&t.due[0].0), "taken as a direct job");
    assert_eq!(
        jobs.offsets_to_store(),
        vec![],
        "still held while it is being fired"
    );
    let mut done: Vec<&(DueKey, StoredJob)> = t.due.iter().collect();
    assert_eq!(jobs.release_direct(&mut done, &t.direct), 1);
    assert!(done.is_empty(), "nothing to tombstone or delete for a direct job");
    assert_eq!(jobs.offsets_to_store(), vec![(0, 7)]);
    assert_eq!(jobs.frontier_after_fires(0), Some(8));
    assert_eq!(jobs.frontier_after_fires(1), None, "nothing ingested from 1");
}

#[test]
fn a_park_of_a_job_is_named_apart_and_leaves_the_jobs_direct_retry_alone() {
    let jobs = jobs_with(100, &[]);
    let retry = job("a", NOW - 5, 7);
    let (mut parts, named) = apply_put(&jobs, 0, retry.clone());
    assert_eq!(parts[&0].direct.len(), 1);
    let fallback = jobs.admit(&[], &mut parts, NOW, &named);
    assert!(fallback.is_empty());
    jobs.settle(&parts, &fallback);
    // A copy of the same job a worker parked behind its key, read next.
    let mut park = retry.job.clone();
    park.parked = Some(1);
    let named = claim_one(&jobs, 0, 8, Command::Schedule(park.clone()));
    assert_eq!(
        named.keys().copied().collect::<Vec<_>>(),
        vec![(0, park.stored_id())]
    );
    let claims = jobs.take_named(&named);
    assert!(
        matches!(claims[..], [(_, Claim::Held)]),
        "the park takes nothing of the job's direct retry"
    );
    assert_eq!(jobs.direct_in_flight(), 1);
    let t = take(&jobs);
    assert_eq!(t.due.len(), 1, "the retry fires from memory");
    assert_eq!(t.due[0].1.job.id, retry.job.id);
}

#[test]
fn a_direct_job_is_picked_only_while_its_place_can_be_reserved() {
    // Direct jobs fill at most half the capacity: one here. The first
    // one's place is reserved at its pick; the second finds no room.
    let jobs = jobs_with(2, &[]);
    let (mut first, named_first) = apply_put(&jobs, 0, job("a", NOW - 5, 1));
    let (second, _) = apply_put(&jobs, 1, job("b", NOW - 5, 2));
    assert_eq!((first[&0].direct.len(), second[&1].direct.len()), (1, 0));
    assert_eq!(jobs.with_window(|w| w.reserved_len()), 1);
    assert!(jobs.admit(&[], &mut first, NOW, &named_first).is_empty());
    assert_eq!(jobs.with_window(|w| w.reserved_len()), 0, "taken by the job");
    jobs.settle(&first, &HashMap::default());
    let (third, _) = apply_put(&jobs, 1, job("c", NOW - 5, 3));
    assert!(third[&1].direct.is_empty(), "still no room: not picked");
}

#[test]
fn a_picked_direct_job_enters_whatever_the_window_took_in_since_its_pick() {
    // Picked; then stored jobs due before it fill the window past its
    // capacity (six). The window keeps them rather than pull the
    // partition's horizon back before the picked job; the batch that
    // admits it cancels two of them, and it enters.
    let jobs = jobs_with(6, &[]);
    let (mut parts, named) = apply_put(&jobs, 0, job("a", NOW - 5, 50));
    assert_eq!(parts[&0].direct.len(), 1);
    let stored: Vec<(DueKey, StoredJob)> = (0..7)
        .map(|i| {
            let s = job(&format!("s{i}"), NOW - 100 + i, 10 + i as u64);
            (DueKey::of(0, &s), s)
        })
        .collect();
    jobs.follow(
        &stored
            .iter()
            .map(|(k, s)| Applied::Added(*k, s.clone()))
            .collect::<Vec<_>>(),
    );
    let cancelled: Vec<Applied> = stored[5..]
        .iter()
        .map(|(k, s)| Applied::Removed(*k, s.job.id))
        .collect();
    assert!(
        jobs.admit(&cancelled, &mut parts, NOW, &named).is_empty(),
        "its place was kept: it enters"
    );
    let t = take(&jobs);
    let keys: Vec<String> = t
        .due
        .iter()
        .map(|(_, s)| s.job.key_lossy().into_owned())
        .collect();
    assert_eq!(keys, ["s0", "s1", "s2", "s3", "s4", "a"], "in run-at order");
    assert!(t.direct.contains_key(&t.due[5].0), "a fires from memory");
}

#[test]
fn a_direct_job_whose_partition_was_taken_again_since_its_pick_comes_back_to_be_persisted() {
    let jobs = jobs_with(100, &[]);
    let (mut parts, named) = apply_put(&jobs, 0, job("a", NOW - 5, 7));
    assert_eq!(parts[&0].direct.len(), 1);
    jobs.revoke(&[0]);
    jobs.assign(0);
    assert_eq!(
        jobs.with_window(|w| w.reserved_len()),
        0,
        "the reservation went with the partition"
    );
    let fallback = jobs.admit(&[], &mut parts, NOW, &named);
    assert_eq!(fallback[&0].changes.len(), 1, "comes back to go the durable way");
}

#[test]
fn a_job_named_by_a_batch_read_is_not_taken_until_the_batch_is_admitted() {
    let stored = job("a", NOW - 10, 3);
    let jobs = jobs_with(100, &[(0, stored.clone())]);
    let named = &claim_one(&jobs, 0, 9, Command::Cancel(stored.job.id));
    assert!(!named[&(0, stored.job.id)].firing);
    assert!(take(&jobs).due.is_empty(), "held while the batch is applied");
    let claims = jobs.take_named(named);
    assert!(
        matches!(claims[..], [(_, Claim::Held)]),
        "a stored job: held, not taken out"
    );
    jobs.admit(&[], &mut HashMap::default(), NOW, named);
    assert_eq!(
        take(&jobs).due.len(),
        1,
        "the batch did not change it after all: it fires"
    );
}

#[test]
fn a_job_named_while_it_is_fired_is_claimed_as_firing_until_the_round_is_finished() {
    let stored = job("a", NOW - 10, 3);
    let jobs = jobs_with(100, &[(0, stored.clone())]);
    let t = take(&jobs);
    assert_eq!(t.due.len(), 1);
    let cancel = |offset| claim_one(&jobs, 0, offset, Command::Cancel(stored.job.id));
    let named = cancel(9);
    assert!(named[&(0, stored.job.id)].firing, "a cancel now comes too late");
    assert!(matches!(jobs.take_named(&named)[..], [(_, Claim::Firing)]));
    jobs.finished(&[], &t.due, Vec::new(), &t.direct);
    assert!(
        !cancel(10)[&(0, stored.job.id)].firing,
        "fired: no longer being fired"
    );
}

#[test]
fn a_put_of_a_job_being_fired_keeps_the_changelog_from_its_tombstone() {
    let stored = job("a", NOW - 10, 3);
    let jobs = jobs_with(100, &[(0, stored.clone())]);
    let t = take(&jobs);
    let done: Vec<&(DueKey, StoredJob)> = t.due.iter().collect();
    assert!(jobs.put_again(&done).is_empty());
    claim_one(&jobs, 0, 9, Command::Schedule(stored.job.clone()));
    assert_eq!(jobs.put_again(&done), [(0, stored.job.id)].into_iter().collect());
}

#[test]
fn a_failed_fire_goes_back_into_the_window_and_fires_again() {
    let jobs = jobs_with(100, &[(0, job("a", NOW - 10, 3)), (1, job("b", NOW - 5, 4))]);
    let t = take(&jobs);
    assert_eq!(t.due.len(), 2);
    assert!(take(&jobs).due.is_empty(), "being fired");
    let retry = vec![t.due[1].clone()];
    jobs.finished(&[], &t.due, retry, &t.direct);
    jobs.rounds_done([&t.parts]);
    let again = take(&jobs);
    assert_eq!(again.due.len(), 1);
    assert_eq!(again.due[0].1.job.key_lossy(), "b");
}

#[test]
fn a_revocation_waits_for_the_rounds_taken_from_its_partitions() {
    let jobs = jobs_with(100, &[(0, job("a", NOW - 10, 3)), (1, job("b", NOW - 5, 4))]);
    let first = take(&jobs);
    let now = Instant::now;
    assert_eq!(first.parts.len(), 2);
    assert!(jobs.wait_idle(&[5], now()), "nothing taken from 5");
    assert!(!jobs.wait_idle(&[1], now()), "a round of 1 in flight");
    jobs.revoke(&[1]);
    assert_eq!(jobs.partitions(), vec![0]);
    std::thread::scope(|s| {
        s.spawn(|| jobs.rounds_done([&first.parts]));
        assert!(jobs.wait_idle(&[0, 1], now() + Duration::from_secs(10)));
    });
}

#[test]
fn a_direct_job_handed_over_to_the_store_stops_holding_the_commit() {
    let jobs = jobs_with(100, &[]);
    let (mut parts, named) = apply_put(&jobs, 0, job("a", NOW - 5, 7));
    let fallback = jobs.admit(&[], &mut parts, NOW - 3_000, &named);
    jobs.settle(&parts, &fallback);
    assert_eq!(jobs.offsets_to_store(), vec![(0, 6)]);
    let old = jobs.take_old_direct(NOW - 2_000, |_| true);
    assert_eq!(old.len(), 1);
    assert!(
        take(&jobs).due.is_empty(),
        "its partition fires nothing while it is persisted"
    );
    jobs.handed_over(&old, Some(&[]));
    assert_eq!(jobs.offsets_to_store(), vec![(0, 7)]);
    let t = take(&jobs);
    assert_eq!(t.due.len(), 1);
    assert!(t.direct.is_empty(), "a stored job now");
}

#[test]
fn a_partition_let_go_forgets_the_offsets_its_direct_jobs_held() {
    let jobs = jobs_with(100, &[]);
    let (mut parts, named) = apply_put(&jobs, 0, job("a", NOW - 5, 7));
    let fallback = jobs.admit(&[], &mut parts, NOW, &named);
    jobs.settle(&parts, &fallback);
    assert_eq!(jobs.direct_in_flight(), 1);
    jobs.revoke(&[0]);
    jobs.let_go(&[0]);
    assert_eq!(jobs.direct_in_flight(), 0);
    assert_eq!(
        jobs.offsets_to_store(),
        vec![],
        "nothing to commit for a partition let go"
    );
    assert_eq!(jobs.frontier_after_fires(0), None);
}

#[test]
fn a_revoked_partition_fires_nothing_more() {
    let jobs = jobs_with(100, &[(0, job("a", NOW - 10, 3)), (1, job("b", NOW - 5, 4))]);
    jobs.revoke(&[1]);
    let t = take(&jobs);
    assert_eq!(t.due.len(), 1);
    assert_eq!(t.due[0].1.job.key_lossy(), "a");
    assert_eq!(t.parts, [0].into_iter().collect(), "no round counted for 1");
}

mod fair;
