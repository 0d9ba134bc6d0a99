use super::*;
use crate::job::Job;
use crate::scheduler::store::{Change, Store};
use chrono::{TimeZone, Utc};

fn put(key: &str, ms: i64, seq: u64) -> Change {
    let job = Job::new("jobs", key, b"p".to_vec()).at(Utc.timestamp_millis_opt(ms).unwrap());
    Change::Put(StoredJob { job, seq })
}

/// Take due jobs with every partition read to its end.
fn take(w: &mut TimerWheel, now_ms: i64, max: usize) -> Vec<(DueKey, StoredJob)> {
    let until = w.partitions().into_iter().map(|p| (p, i64::MAX)).collect();
    w.take_due(now_ms, max, &until).jobs
}

/// A refill as the scheduler does it: the cascader keeps the store's
/// cascade point ahead, the window plans each read, the store is read, the
/// window merges it.
fn refill(w: &mut TimerWheel, s: &Store, now_ms: i64) {
    for p in w.partitions() {
        s.cascade(p, now_ms + 2 * w.span_ms()).unwrap();
        let cascaded_to = s.checkpoint(p).unwrap().cascaded_to;
        if let Some(read) = w.begin_refill(p, now_ms, cascaded_to) {
            let got = s.scan_due(p, read.after, read.until_ms, read.room).unwrap();
            assert!(w.finish_refill(read, got));
        }
    }
}

fn store() -> (tempfile::TempDir, Store) {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path(), 1 << 20).unwrap();
    (d, s)
}

#[test]
fn holds_only_the_span_and_refills_as_time_moves() {
    let (_d, s) = store();
    let changes: Vec<Change> = (0..100).map(|i| put("k", i * 1000, i as u64)).collect();
    s.apply(0, &changes, None).unwrap();
    let mut w = TimerWheel::new(10_000, 1000);
    w.add_partition(0);
    refill(&mut w, &s, 0);
    assert_eq!(w.len(), 11, "run-at 0..=10s");
    assert_eq!(take(&mut w, 5_000, 100).len(), 6);
    assert_eq!(w.refill_due_ms(), Some(5_000));
    refill(&mut w, &s, 50_000);
    assert_eq!(w.next_after_ms(i64::MIN), Some(6_000));
    assert_eq!(w.len(), 55, "6s..=60s");
}

#[test]
fn capacity_bounds_memory_and_nothing_is_skipped() {
    let (_d, s) = store();
    let changes: Vec<Change> = (0..50).map(|i| put("k", 1000, i)).collect();
    s.apply(0, &changes, None).unwrap();
    let mut w = TimerWheel::new(60_000, 8);
    w.add_partition(0);
    let mut fired = Vec::new();
    for _ in 0..20 {
        refill(&mut w, &s, 1000);
        assert!(w.len() <= 8);
        let batch = take(&mut w, 1000, 3);
        for (k, _) in &batch {
            s.apply(0, &[Change::Delete(batch_id(&s, k, &batch))], None)
                .unwrap();
        }
        fired.extend(batch.into_iter().map(|(k, _)| k.seq));
    }
    assert_eq!(
        fired,
        (0..50).collect::<Vec<u64>>(),
        "every job once, in arrival order"
    );
}

fn batch_id(_s: &Store, k: &DueKey, batch: &[(DueKey, StoredJob)]) -> crate::JobId {
    batch.iter().find(|(kk, _)| kk == k).unwrap().1.job.id
}

#[test]
fn new_jobs_inside_the_horizon_enter_at_once_later_ones_wait() {
    let (_d, s) = store();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    refill(&mut w, &s, 0);
    let applied = s
        .apply(0, &[put("soon", 5_000, 1), put("late", 60_000, 2)], None)
        .unwrap();
    w.follow(&applied);
    assert_eq!(w.len(), 1);
    assert_eq!(w.next_after_ms(i64::MIN), Some(5_000));
    take(&mut w, 5_000, 10);
    refill(&mut w, &s, 55_000);
    assert_eq!(w.next_after_ms(i64::MIN), Some(60_000));
}

fn key(ms: i64, seq: u64) -> DueKey {
    DueKey {
        run_at_ms: ms,
        partition: 0,
        seq,
    }
}

fn sj(ms: i64, seq: u64) -> StoredJob {
    match put("d", ms, seq) {
        Change::Put(s) => s,
        _ => unreachable!(),
    }
}

#[test]
fn direct_jobs_enter_only_where_mirrored_and_are_never_dropped_for_room() {
    let (_d, s) = store();
    let mut w = TimerWheel::new(10_000, 4);
    w.add_partition(0);
    let first = sj(0, 1);
    assert_eq!(
        w.add_direct(key(0, 1), first.clone(), 0),
        Some(first),
        "nothing mirrored yet"
    );
    refill(&mut w, &s, 0);
    assert!(
        w.add_direct(key(20_000, 2), sj(20_000, 2), 0).is_some(),
        "beyond the horizon"
    );
    assert!(w.add_direct(key(0, 3), sj(0, 3), 0).is_none());
    assert!(w.add_direct(key(5, 4), sj(5, 4), 0).is_none());
    assert!(
        w.add_direct(key(6, 5), sj(6, 5), 0).is_some(),
        "at most half the capacity"
    );
    // Stored jobs fill the rest; over capacity, stored ones make room.
    let applied = s
        .apply(0, &[put("a", 1, 10), put("b", 2, 11), put("c", 3, 12)], None)
        .unwrap();
    w.follow(&applied);
    assert_eq!(w.len(), 4);
    assert_eq!(w.direct_len(), 2);
    // Room was made by dropping stored job c (3 ms): the direct job at
    // 5 ms waits until c is back, so they fire in run-at order.
    let seqs = |due: &[(DueKey, StoredJob)]| due.iter().map(|(k, _)| k.seq).collect::<Vec<_>>();
    let first = take(&mut w, 10, 10);
    assert_eq!(seqs(&first), vec![3, 10, 11]);
    refill(&mut w, &s, 10);
    let second = take(&mut w, 10, 10);
    assert_eq!(seqs(&second), vec![12, 4]);
    let due: Vec<(DueKey, StoredJob)> = first.into_iter().chain(second).collect();
    let direct = w.take_direct(&due);
    assert_eq!(direct, HashMap::from_iter([(key(0, 3), 0), (key(5, 4), 0)]));
    assert_eq!(w.direct_len(), 0);
    // A failed fire puts them back, direct again.
    w.put_back(due, &direct);
    assert_eq!(w.direct_len(), 2);
    w.remove_partition(0);
    assert_eq!((w.len(), w.direct_len()), (0, 0));
}

#[test]
fn removing_a_partition_drops_its_jobs() {
    let (_d, s) = store();
    s.apply(0, &[put("a", 0, 1)], None).unwrap();
    s.apply(1, &[put("b", 0, 1)], None).unwrap();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    w.add_partition(1);
    refill(&mut w, &s, 0);
    assert_eq!(w.len(), 2);
    w.remove_partition(0);
    assert_eq!(w.len(), 1);
    assert_eq!(w.partitions(), vec![1]);
    let applied = s.apply(0, &[put("c", 0, 2)], None).unwrap();
    w.follow(&applied);
    assert_eq!(w.len(), 1, "jobs of partitions not owned stay out");
}

#[test]
fn jobs_wait_for_their_partition_to_be_read_up_to_their_run_at() {
    let (_d, s) = store();
    s.apply(0, &[put("a", 100, 1), put("b", 300, 2)], None).unwrap();
    s.apply(1, &[put("c", 200, 1)], None).unwrap();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    w.add_partition(1);
    refill(&mut w, &s, 0);
    let until: HashMap<i32, i64> = [(0, 150)].into_iter().collect();
    let due = w.take_due(1_000, 10, &until);
    assert_eq!(due.jobs.len(), 1, "only a: b waits for partition 0, c for 1");
    assert_eq!(due.held, [(0, 300), (1, 200)].into_iter().collect());
    assert_eq!(w.next_after_ms(1_000), None, "nothing new comes due");
    assert_eq!(w.next_after_ms(250), Some(300));
    assert!(w.is_firing(0, &due.jobs[0].1.job.id));
    w.fired(&due.jobs);
    assert!(!w.is_firing(0, &due.jobs[0].1.job.id));
    let until: HashMap<i32, i64> = [(0, 1_000), (1, 1_000)].into_iter().collect();
    assert_eq!(w.take_due(1_000, 10, &until).jobs.len(), 2);
}

#[test]
fn a_job_being_changed_is_not_taken_and_a_direct_job_can_be_taken_out() {
    let (_d, s) = store();
    s.apply(0, &[put("a", 100, 1)], None).unwrap();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    refill(&mut w, &s, 0);
    let stored = w.entries.values().next().unwrap().job.id;
    w.changing(0, stored);
    let d = sj(50, 7);
    assert!(w.add_direct(key(50, 7), d.clone(), 0).is_none());
    let taken = w.take_direct_job(0, &d.job.id).expect("direct job taken out");
    assert_eq!(taken, (key(50, 7), d.clone()));
    assert!(w.take_direct_job(0, &d.job.id).is_none());
    assert!(take(&mut w, 1_000, 10).is_empty(), "a is being changed");
    w.changed([(0, stored)]);
    assert_eq!(take(&mut w, 1_000, 10).len(), 1);
}

/// Jobs a (1 s) and b (2 s) stored in partition 0, cascaded past them, and
/// a window of 10 s owning the partition, not refilled yet.
fn a_and_b_stored() -> (tempfile::TempDir, Store, TimerWheel) {
    let (d, s) = store();
    s.apply(0, &[put("a", 1_000, 1), put("b", 2_000, 2)], None)
        .unwrap();
    s.cascade(0, 100_000).unwrap();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    (d, s, w)
}

#[test]
fn changes_applied_while_the_store_is_read_are_not_lost() {
    let (_d, s, mut w) = a_and_b_stored();
    let read = w.begin_refill(0, 0, 100_000).expect("a read");
    let got = s.scan_due(0, read.after, read.until_ms, read.room).unwrap();
    // Meanwhile (window unlocked): b is cancelled, c arrives, both inside
    // the range just read; d arrives beyond it.
    let b = got[1].1.job.id;
    let mut applied = s
        .apply(0, &[Change::Delete(b), put("c", 3_000, 3)], None)
        .unwrap();
    applied.extend(s.apply(0, &[put("d", 50_000, 4)], None).unwrap());
    w.follow(&applied);
    assert_eq!(w.len(), 0, "nothing is mirrored yet");
    assert!(w.finish_refill(read, got));
    let keys: Vec<String> = take(&mut w, 100_000, 10)
        .into_iter()
        .map(|(_, j)| j.job.key_lossy().into_owned())
        .collect();
    assert_eq!(keys, ["a", "c"], "b cancelled, c added, d beyond the span");
}

#[test]
fn a_refill_of_a_partition_let_go_or_cut_back_meanwhile_is_dropped() {
    let (_d, s, mut w) = a_and_b_stored();
    let read = w.begin_refill(0, 0, 100_000).unwrap();
    let got = s.scan_due(0, read.after, read.until_ms, read.room).unwrap();
    w.remove_partition(0);
    w.add_partition(0);
    assert!(!w.finish_refill(read, got), "taken again meanwhile");
    assert_eq!(w.len(), 0);
    refill(&mut w, &s, 0);
    assert_eq!(w.len(), 2, "a new refill reads it all");

    // Direct jobs squeeze the latest stored job out, pulling the horizon
    // back while a refill of the partition is read: that refill is dropped.
    let mut w = TimerWheel::new(10_000, 4);
    w.add_partition(0);
    refill(&mut w, &s, 0);
    w.follow(&s.apply(0, &[put("e", 5_000, 5)], None).unwrap());
    assert_eq!(w.len(), 3);
    let read = w.begin_refill(0, 5_000, 100_000).expect("room for one");
    let got = s.scan_due(0, read.after, read.until_ms, read.room).unwrap();
    assert_eq!(w.add_direct(key(500, 9), sj(500, 9), 0), None);
    assert_eq!(w.add_direct(key(600, 10), sj(600, 10), 0), None);
    assert_eq!(w.len(), 4, "e dropped for room");
    assert!(!w.finish_refill(read, got), "the horizon moved back meanwhile");
    assert_eq!(w.len(), 4);
    refill(&mut w, &s, 5_000);
    assert_eq!(w.len(), 4, "still full, nothing lost: e waits on disk");
}

#[test]
fn the_window_stops_before_the_cascade_point() {
    let (_d, s) = store();
    s.cascade(0, 1_000).unwrap();
    let cascaded_to = s.checkpoint(0).unwrap().cascaded_to;
    let mut w = TimerWheel::new(i64::MAX / 4, 100);
    w.add_partition(0);
    let read = w.begin_refill(0, 0, cascaded_to).unwrap();
    assert_eq!(
        read.until_ms,
        cascaded_to - 1,
        "jobs at or after it are not in the near range yet"
    );
}

#[test]
fn direct_jobs_held_too_long_are_handed_over_and_hold_their_partition_meanwhile() {
    let (_d, s) = store();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    w.add_partition(1);
    refill(&mut w, &s, 0);
    assert!(w.add_direct(key(1, 1), sj(1, 1), 100).is_none());
    assert!(w.add_direct(key(2, 2), sj(2, 2), 900).is_none());
    let other = DueKey {
        partition: 1,
        ..key(3, 3)
    };
    assert!(w.add_direct(other, sj(3, 3), 100).is_none());
    // Partition 1's job is taken for firing: not handed over.
    let until = HashMap::from_iter([(1, i64::MAX)]);
    let taken = w.take_due(10, 10, &until).jobs;
    assert_eq!(taken.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![other]);
    assert_eq!(w.take_direct(&taken).len(), 1);
    assert!(
        w.persist_direct_older(500, |p| p == 1).is_empty(),
        "only the partitions chosen"
    );
    let older = w.persist_direct_older(500, |p| p == 0);
    assert_eq!(older.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![key(1, 1)]);
    // Meanwhile none of partition 0's jobs is taken: the one entered at
    // 900 ms would otherwise fire before the one being persisted.
    assert!(take(&mut w, 10, 10).is_empty(), "partition 0 is held");
    w.persisted(&older);
    assert_eq!(w.direct_len(), 1, "only the job entered at 900 ms is direct");
    assert!(w.persist_direct_older(500, |_| true).is_empty());
    let due = take(&mut w, 10, 10);
    assert_eq!(due.iter().map(|(k, _)| k.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(
        w.take_direct(&due).len(),
        1,
        "the persisted job fires as a stored one"
    );
}

/// A worker's retry put again while the job's earlier run fires, taken
/// itself, and its fire's write failed (its round finishes, and it is put
/// back): the earlier run's fire must still leave the retry's put in the
/// changelog. (Seen in a soak: the retry's round ended the id's firing and
/// cleared the mark, the earlier fire tombstoned the retry, and the
/// partition's next owner lost it.)
#[test]
fn a_retry_whose_fire_failed_keeps_the_earlier_fire_off_its_put() {
    let (_d, s) = store();
    s.apply(0, &[put("k", 100, 10)], None).unwrap();
    let mut w = TimerWheel::new(10_000, 100);
    w.add_partition(0);
    refill(&mut w, &s, 0);
    let first = take(&mut w, 1_000, 10);
    assert_eq!(first.len(), 1);
    let id = first[0].1.job.id;
    // The retry's record (offset 20) is read while the first run fires.
    w.put_again(0, id, 20);
    let retry = StoredJob {
        seq: 20,
        ..first[0].1.clone()
    };
    let applied = s.apply(0, &[Change::Put(retry)], None).unwrap();
    w.follow(&applied);
    let second = take(&mut w, 1_000, 10);
    assert_eq!(second.len(), 1, "the retry is due too");
    // Its round finishes as `finish` does: every job's firing ends, the
    // failed ones go back.
    w.fired(&second);
    w.put_back(second, &HashMap::default());
    assert!(w.is_firing(0, &id), "the first run still fires");
    assert!(
        w.was_put_again(0, &id, 10),
        "the first run's fire must not tombstone the retry"
    );
    assert!(!w.was_put_again(0, &id, 20), "the retry itself was not put again");
    w.fired(&first);
    assert!(!w.is_firing(0, &id));
}
