//! The store's tests: its operations, model checks against a plain map, and
//! the value log's bookkeeping.

use std::collections::BTreeMap;

use super::value_log::Ptr;

use crate::job::Job;

use chrono::{TimeZone, Utc};
use rand::{Rng, SeedableRng};

use super::buckets::{align_down, bucket_for, candidate_buckets};
use super::*;

mod model;

impl Store {
    /// Entries of one kind for `partition` (tests).
    fn count(&self, kind: u8, partition: i32) -> usize {
        self.tree.scan_prefix(prefix(kind, partition)).count()
    }

    /// The value log's live counts match the pointers in sled, and every
    /// pointer's segment exists (tests).
    fn check_log(&self) {
        let mut sums: HashMap<u32, u64> = HashMap::default();
        for kind in [N, B, J] {
            for item in self.tree.scan_prefix([kind]) {
                let (_, v) = item.unwrap();
                let ptr = Ptr::decode(&v).unwrap();
                *sums.entry(ptr.segment()).or_default() += ptr.len();
            }
        }
        assert_eq!(sums, self.log.live(), "live counts against pointers");
        let files = self.log.segments();
        assert!(sums.keys().all(|id| files.contains(id)), "{sums:?} in {files:?}");
    }
}

fn job(key: &str, ms: i64) -> Job {
    Job::new("jobs", key, b"p".to_vec()).at(Utc.timestamp_millis_opt(ms).unwrap())
}

fn put(j: &Job, seq: u64) -> Change {
    Change::Put(StoredJob { job: j.clone(), seq })
}

fn open() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path(), 1 << 20).unwrap();
    (dir, s)
}

/// Open the store in `dir` again, once the dropped handle's file lock is
/// gone (sled lets it go from a background thread shortly after the drop;
/// the test failed once on a loaded machine opening too soon).
fn reopen(dir: &Path) -> Result<Store, StoreError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match Store::open(dir, 1 << 20) {
            Err(StoreError::Sled(sled::Error::Io(e)))
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r,
        }
    }
}

/// Cascade `p` until its cascade point reaches `until`.
fn cascade_to(s: &Store, p: i32, until: i64) {
    while s.cascade(p, until).unwrap() < until {}
}

fn near_ids(s: &Store, p: i32) -> Vec<JobId> {
    s.scan_due(p, None, i64::MAX, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|(_, sj)| sj.job.id)
        .collect()
}

#[test]
fn bucket_choice_starts_at_or_after_the_cascade_point_and_is_a_candidate() {
    let t = 1_000_448; // aligned to 1024
    for r in [
        t,
        t + 1,
        t + 5_000,
        t + 86_400_000,
        t + 2_592_000_000,
        253_402_300_799_999,
    ] {
        let b = bucket_for(r, t);
        assert!(b >= t && b <= r, "{r}: bucket {b}");
        assert!(candidate_buckets(r, t).contains(&b));
    }
    // A month ahead lands in a wide bucket, a second ahead in a narrow one.
    assert!(bucket_for(t + 2_592_000_000, t) < t + 2_592_000_000 - 86_400_000);
    assert_eq!(bucket_for(t + 1_500, t), align_down(t + 1_500, 1024));
}

#[test]
fn scans_in_run_at_then_arrival_order_per_partition() {
    let (_d, s) = open();
    let a = job("a", 2000);
    let b = job("b", 1000);
    let c = job("c", 2000);
    let neg = job("n", -5);
    let far = job("f", 253_402_300_799_999);
    s.apply(
        0,
        &[put(&a, 1), put(&b, 2), put(&c, 3), put(&neg, 4), put(&far, 5)],
        None,
    )
    .unwrap();
    s.apply(1, &[put(&job("other", 0), 1)], None).unwrap();
    assert_eq!(
        near_ids(&s, 0),
        vec![neg.id, b.id, a.id, c.id],
        "due before now: near at once"
    );
    cascade_to(&s, 0, i64::MAX / 2);
    assert_eq!(near_ids(&s, 0), vec![neg.id, b.id, a.id, c.id, far.id]);
    let upto: Vec<_> = s.scan_due(0, None, 1999, 100).unwrap();
    assert_eq!(upto.len(), 2);
    let after = s.scan_due(0, Some(upto[1].0), 2000, 100).unwrap();
    assert_eq!(
        after.iter().map(|(_, j)| j.job.id).collect::<Vec<_>>(),
        vec![a.id, c.id]
    );
    assert_eq!(s.scan_due(0, None, i64::MAX, 2).unwrap().len(), 2);
    assert_eq!(s.checkpoint(0).unwrap().pending, 5);
    assert_eq!(s.next_due(0).unwrap().unwrap().run_at_ms, -5);
}

#[test]
fn a_job_and_its_parks_are_kept_apart_under_their_stored_ids() {
    let (_d, s) = open();
    cascade_to(&s, 0, 10_000);
    let retry = job("a", 1000);
    let (mut park1, mut park2) = (
        retry.clone(),
        retry.clone().at(Utc.timestamp_millis_opt(50_000_000).unwrap()),
    );
    park1.parked = Some(1);
    park2.parked = Some(2); // far
    s.apply(0, &[put(&retry, 1), put(&park1, 2), put(&park2, 3)], None)
        .unwrap();
    assert_eq!(s.checkpoint(0).unwrap().pending, 3, "none replaced another");
    assert_eq!(s.current(0, &retry.id).unwrap().unwrap().job, retry);
    for p in [&park1, &park2] {
        let got = s.current(0, &p.stored_id()).unwrap().unwrap().job;
        assert_eq!(&got, p, "a park read back has its job's id and its number");
    }
    // A cancel names the job: its parks stay; a park goes by its own id.
    s.apply(0, &[Change::Delete(retry.id)], None).unwrap();
    assert_eq!(s.current(0, &retry.id).unwrap(), None);
    assert_eq!(s.checkpoint(0).unwrap().pending, 2);
    s.apply(0, &[Change::Delete(park2.stored_id())], None).unwrap();
    let left: Vec<Job> = s
        .scan_due(0, None, i64::MAX, usize::MAX)
        .unwrap()
        .into_iter()
        .map(|(_, sj)| sj.job)
        .collect();
    assert_eq!(left, vec![park1]);
    assert_eq!(s.checkpoint(0).unwrap().pending, 1);
}

#[test]
fn put_with_a_known_id_replaces_and_delete_removes_near_and_far() {
    let (_d, s) = open();
    cascade_to(&s, 0, 10_000);
    let a = job("a", 1000); // near
    s.apply(0, &[put(&a, 1)], Some(10)).unwrap();
    let moved = a.clone().at(Utc.timestamp_millis_opt(50_000_000).unwrap()); // far
    let applied = s.apply(0, &[put(&moved, 1)], Some(11)).unwrap();
    assert!(matches!(applied[..], [Applied::Removed(k, _)] if k.run_at_ms == 1000));
    let cp = s.checkpoint(0).unwrap();
    assert_eq!((cp.changelog_next, cp.pending), (11, 1));
    assert_eq!(s.current(0, &a.id).unwrap().unwrap().job, moved);
    assert!(near_ids(&s, 0).is_empty());
    // Back to near, then the same put again changes nothing.
    let applied = s.apply(0, &[put(&a, 1)], None).unwrap();
    assert!(matches!(applied[..], [Applied::Added(k, _)] if k.run_at_ms == 1000));
    assert!(s.apply(0, &[put(&a, 1)], None).unwrap().is_empty());
    assert_eq!(s.checkpoint(0).unwrap().pending, 1);
    assert_eq!(s.count(B, 0), 0, "the far copy was taken out of its chunk");
    let applied = s
        .apply(0, &[Change::Delete(a.id), Change::Delete(a.id)], None)
        .unwrap();
    assert_eq!(applied.len(), 1);
    assert!(near_ids(&s, 0).is_empty());
    assert_eq!(s.current(0, &a.id).unwrap(), None);
    assert_eq!(s.checkpoint(0).unwrap().pending, 0);
    // A far job is cancelled out of its chunk, leaving its neighbours.
    let f1 = job("f1", 90_000_000);
    let f2 = job("f2", 90_000_001);
    s.apply(0, &[put(&f1, 2), put(&f2, 3)], None).unwrap();
    s.apply(0, &[Change::Delete(f1.id)], None).unwrap();
    assert_eq!(s.current(0, &f1.id).unwrap(), None);
    assert_eq!(s.current(0, &f2.id).unwrap().unwrap().job, f2);
    cascade_to(&s, 0, 100_000_000);
    assert_eq!(near_ids(&s, 0), vec![f2.id]);
}

#[test]
fn a_fired_job_is_deleted_only_if_not_replaced_meanwhile() {
    let (_d, s) = open();
    cascade_to(&s, 0, 20_000);
    let a = job("a", 1000);
    s.apply(0, &[put(&a, 1)], None).unwrap();
    let fired_at = s.scan_due(0, None, i64::MAX, 1).unwrap()[0].0;
    let moved = a.clone().at(Utc.timestamp_millis_opt(9000).unwrap());
    s.apply(0, &[put(&moved, 1)], None).unwrap();
    assert!(s
        .apply(0, &[Change::Fired(a.id, fired_at)], None)
        .unwrap()
        .is_empty());
    let (now_at, now_job) = s.scan_due(0, None, i64::MAX, 1).unwrap().remove(0);
    assert_eq!((now_at.run_at_ms, now_job.job), (9000, moved));
    assert_eq!(s.apply(0, &[Change::Fired(a.id, now_at)], None).unwrap().len(), 1);
    assert_eq!(s.checkpoint(0).unwrap().pending, 0);
    assert_eq!(s.current(0, &a.id).unwrap(), None, "a stale hint is not believed");
}

#[test]
fn changes_within_one_batch_see_each_other() {
    let (_d, s) = open();
    cascade_to(&s, 0, 20_000);
    for ms in [1000, 80_000_000] {
        let a = job("a", ms);
        s.apply(0, &[put(&a, 1), Change::Delete(a.id), put(&a, 2)], None)
            .unwrap();
        assert_eq!(s.current(0, &a.id).unwrap().unwrap().seq, 2);
        assert_eq!(s.checkpoint(0).unwrap().pending, 1);
        s.apply(0, &[Change::Delete(a.id)], None).unwrap();
        assert_eq!(s.checkpoint(0).unwrap().pending, 0);
    }
    assert_eq!(s.count(N, 0) + s.count(B, 0), 0);
}

#[test]
fn survives_reopen_and_clears_one_partition() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = reopen(dir.path()).unwrap();
        s.apply(0, &[put(&job("a", 1), 1)], Some(7)).unwrap();
        s.apply(1, &[put(&job("b", 1), 1)], Some(3)).unwrap();
        s.flush().unwrap();
    }
    let s = reopen(dir.path()).unwrap();
    let cp = s.checkpoint(0).unwrap();
    assert_eq!((cp.changelog_next, cp.pending), (7, 1));
    s.clear_partition(0).unwrap();
    assert!(!s.knows(0).unwrap());
    cascade_to(&s, 0, 10_000);
    cascade_to(&s, 1, 10_000);
    assert!(s.scan_due(0, None, i64::MAX, 10).unwrap().is_empty());
    assert_eq!(s.scan_due(1, None, i64::MAX, 10).unwrap().len(), 1);
}

/// Emptied segments are deleted after a flush; segments kept alive by a
/// few far jobs are compacted away; orphan segment files go on open; a
/// damaged chunk is an error, never a wrong job.
#[test]
fn value_log_segments_are_deleted_compacted_and_checked() {
    let (d, s) = open();
    s.log.set_segment_bytes(16 << 10);
    let now = 1_700_000_000_000i64;
    let year = 365 * 86_400_000i64;
    cascade_to(&s, 0, now);
    let mut far_ids = Vec::new();
    for b in 0..20u64 {
        let mut changes: Vec<Change> = (0..100u64)
            .map(|i| put(&job("n", now + 5_000 + i as i64), b * 1000 + i))
            .collect();
        let far = job("f", now + year + b as i64);
        far_ids.push(far.id);
        changes.push(put(&far, b * 1000 + 999));
        s.apply(0, &changes, None).unwrap();
        s.flush().unwrap();
    }
    let segments_before = s.log.segments().len();
    assert!(segments_before >= 5, "{segments_before} segments");
    cascade_to(&s, 0, now + 10_000);
    let due = s.scan_due(0, None, now + 10_000, usize::MAX).unwrap();
    assert_eq!(due.len(), 2000);
    let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
    s.apply(0, &fires, None).unwrap();
    s.flush().unwrap();
    s.check_log();
    while s.compact(1 << 20).unwrap() > 0 {
        s.flush().unwrap();
    }
    s.flush().unwrap();
    s.check_log();
    let value_log::Usage { written, live } = s.log.usage();
    assert!(
        s.log.segments().len() <= 3 && written < 4 * live.max(16 << 10),
        "{:?} segments, {written} bytes written for {live} live",
        s.log.segments()
    );
    for id in &far_ids {
        assert!(s.current(0, id).unwrap().is_some(), "far job {id} kept");
    }
    let dir = s.log.dir().to_path_buf();
    drop(s);

    // An orphan (a batch cut off by a crash) goes on open.
    std::fs::write(dir.join("0000999999.seg"), b"orphan").unwrap();
    let s = reopen(d.path()).unwrap();
    assert!(!dir.join("0000999999.seg").exists());
    s.check_log();
    for id in &far_ids {
        assert!(
            s.current(0, id).unwrap().is_some(),
            "far job {id} kept after reopen"
        );
    }
    // A damaged byte in a live segment: reads fail with a checksum error.
    let live_segment = *s.log.live().keys().next().unwrap();
    let path = dir.join(format!("{live_segment:010}.seg"));
    let mut bytes = std::fs::read(&path).unwrap();
    for b in bytes.iter_mut() {
        *b ^= 0x5a;
    }
    std::fs::write(&path, bytes).unwrap();
    let errors = far_ids.iter().filter(|id| s.current(0, id).is_err()).count();
    assert!(errors > 0, "a damaged segment was read without error");
    drop(s);
    // A segment the store points into, gone: the store does not open.
    std::fs::remove_file(&path).unwrap();
    assert!(reopen(d.path()).is_err());
}

#[test]
fn pending_jobs_are_counted_by_when_they_come_due_without_reading_them() {
    let (_d, s) = open();
    let now = 10_000_000_000;
    cascade_to(&s, 0, now + 60_000);
    let at = [
        (now - 5_000, 3),           // due
        (now + 30_000, 200),        // within a minute: near runs
        (now + 1_800_000, 300),     // within an hour: a far bucket
        (now + 40_000_000, 7),      // within a day
        (now + 30 * 86_400_000, 2), // later
    ];
    let mut seq = 0;
    let mut changes = Vec::new();
    for (ms, n) in at {
        for _ in 0..n {
            seq += 1;
            changes.push(put(&job(&format!("k{seq}"), ms), seq));
        }
    }
    s.apply(0, &changes, None).unwrap();
    s.apply(1, &[put(&job("other", now), 1)], None).unwrap();
    let edges = [now + 1, now + 60_000, now + 3_600_000, now + 86_400_000];
    let counts = s.pending_by_due(0, &edges).unwrap();
    assert_eq!(counts, vec![3, 200, 300, 7, 2]);
    assert_eq!(counts.iter().sum::<u64>(), s.checkpoint(0).unwrap().pending);
    // A far bucket counts at its start: never in a later span than its jobs.
    let coarse = s.pending_by_due(0, &[now + 60_000]).unwrap();
    assert_eq!(coarse, vec![203, 309]);
    // By topic, every job read: exact.
    let other =
        Job::new("reports", "r", b"p".to_vec()).at(Utc.timestamp_millis_opt(now + 1_800_000).unwrap());
    s.apply(0, &[put(&other, 9_999)], None).unwrap();
    let by_topic = s.pending_by_topic(0, &edges).unwrap();
    assert_eq!(by_topic["jobs"], vec![3, 200, 300, 7, 2]);
    assert_eq!(by_topic["reports"], vec![0, 0, 1, 0, 0]);
}
