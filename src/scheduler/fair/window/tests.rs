//! The fair window against an in-memory stand-in for the store's
//! `scan_due` (a sorted map; pure logic, no sled).

use std::collections::BTreeMap;

use super::*;
use crate::job::{Job, Priority};

const TOPIC: &str = "fair.jobs";

/// The pending jobs, as the store would return them.
#[derive(Default)]
struct FakeStore {
    jobs: BTreeMap<DueKey, StoredJob>,
    seq: u64,
}

impl FakeStore {
    fn put(&mut self, tenant: &str, key: &str, run_at_ms: i64, priority: Priority) -> DueKey {
        self.seq += 1;
        let mut job = Job::new(TOPIC, key, b"x".to_vec())
            .tenant(tenant)
            .priority(priority);
        job.run_at = chrono::DateTime::from_timestamp_millis(run_at_ms).unwrap();
        let k = DueKey {
            run_at_ms,
            partition: 0,
            seq: self.seq,
        };
        self.jobs.insert(k, StoredJob { job, seq: self.seq });
        k
    }

    fn scan(&self, p: i32, after: Option<DueKey>, until_ms: i64, limit: usize) -> Vec<(DueKey, StoredJob)> {
        self.jobs
            .iter()
            .filter(|(k, _)| k.partition == p && k.run_at_ms <= until_ms && after.is_none_or(|a| **k > a))
            .take(limit)
            .map(|(k, j)| (*k, j.clone()))
            .collect()
    }
}

fn window(capacity: usize) -> FairWindow {
    let mut w = FairWindow::new(&[TOPIC.to_string()], Weights::default(), 60_000, capacity, 0);
    w.add_partition(0);
    w
}

fn until_now() -> HashMap<i32, i64> {
    [(0, i64::MAX)].into_iter().collect()
}

/// Discover and release up to `n`, as the dispatcher does; the released
/// jobs are fired (gone from the store).
fn round(w: &mut FairWindow, store: &mut FakeStore, now_ms: i64, n: usize) -> Vec<StoredJob> {
    let inflight = InFlight::default();
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    loop {
        let found = w.discover(now_ms, &until_now(), &inflight, &mut read).unwrap();
        if !found.more {
            break;
        }
    }
    let out = w
        .release(TOPIC, n, now_ms, &inflight, &|_, _| false, &mut read)
        .unwrap();
    for (k, _) in &out {
        store.jobs.remove(k);
        w.removed(k);
    }
    out.into_iter().map(|(_, j)| j).collect()
}

fn tenant(j: &StoredJob) -> &str {
    j.job.tenant.as_deref().unwrap()
}

#[test]
fn a_flooding_tenant_does_not_hold_back_the_others_and_memory_stays_bounded() {
    let mut store = FakeStore::default();
    for i in 0..20_000 {
        store.put("flood", &format!("k{}", i % 100), 1_000, Priority::Normal);
    }
    for t in 0..20 {
        for i in 0..3 {
            store.put(&format!("t{t}"), &format!("t{t}-{i}"), 1_000, Priority::Normal);
        }
    }
    let mut w = window(256);
    // The newcomers come first (nothing served yet, ties alternate).
    let first = round(&mut w, &mut store, 2_000, 120);
    let small = first.iter().filter(|j| tenant(j) != "flood").count();
    assert_eq!(small, 60, "all 60 jobs of the 20 small tenants in the first 120");
    assert!(w.buffered() <= 256 + 21, "buffered {}", w.buffered());
    // The rest is the flood's, in key order, and nothing is lost.
    let mut left = 0;
    loop {
        let got = round(&mut w, &mut store, 2_000, 1_000);
        assert!(w.buffered() <= 256 + 21);
        if got.is_empty() {
            break;
        }
        left += got.len();
    }
    assert_eq!(left + 120, 20_060);
    assert!(store.jobs.is_empty());
}

#[test]
fn a_tenants_jobs_leave_in_key_order_across_refills() {
    let mut store = FakeStore::default();
    let mut expected = Vec::new();
    for i in 0..500 {
        let k = store.put("a", "same-key", 1_000 + i % 7, Priority::Normal);
        expected.push(k);
        store.put("b", "other", 1_000, Priority::Normal);
    }
    expected.sort();
    let mut w = window(8);
    let mut seen = Vec::new();
    loop {
        let got = round(&mut w, &mut store, 5_000, 37);
        if got.is_empty() {
            break;
        }
        seen.extend(
            got.iter()
                .filter(|j| tenant(j) == "a")
                .map(|j| (j.job.run_at.timestamp_millis(), j.seq)),
        );
    }
    let want: Vec<(i64, u64)> = expected.iter().map(|k| (k.run_at_ms, k.seq)).collect();
    assert_eq!(seen, want);
}

#[test]
fn jobs_not_due_or_not_read_up_to_wait_and_higher_classes_go_first() {
    let mut store = FakeStore::default();
    store.put("a", "k1", 1_000, Priority::Low);
    store.put("a", "k2", 1_000, Priority::High);
    store.put("a", "k3", 9_000, Priority::High);
    let mut w = window(64);
    let inflight = InFlight::default();
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    // Read only up to 500: both due jobs are held.
    let until: HashMap<i32, i64> = [(0, 500)].into_iter().collect();
    let found = w.discover(2_000, &until, &inflight, &mut read).unwrap();
    assert_eq!(found.held.get(&0), Some(&1_000));
    assert!(!w.is_waiting(TOPIC));
    let found = w.discover(2_000, &until_now(), &inflight, &mut read).unwrap();
    assert!(found.held.is_empty());
    let got = w
        .release(TOPIC, 10, 2_000, &inflight, &|_, _| false, &mut read)
        .unwrap();
    let keys: Vec<&[u8]> = got.iter().map(|(_, j)| j.job.key.as_slice()).collect();
    assert_eq!(
        keys,
        vec![b"k2".as_slice(), b"k1".as_slice()],
        "high first; k3 not due"
    );
}

#[test]
fn a_job_added_behind_the_cursor_joins_and_a_removed_one_is_not_released() {
    let mut store = FakeStore::default();
    let gone = store.put("a", "k1", 1_000, Priority::Normal);
    let mut w = window(64);
    let inflight = InFlight::default();
    {
        let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
        w.discover(2_000, &until_now(), &inflight, &mut read).unwrap();
    }
    // Cancelled after it was looked at.
    store.jobs.remove(&gone);
    w.removed(&gone);
    // A job due before the cursor arrives late (ingest behind).
    let late = store.put("b", "k2", 1_500, Priority::Normal);
    let job = store.jobs[&late].clone();
    w.added(late, &job, &inflight);
    // One being fired is not added again.
    let mut firing = InFlight::default();
    let dup = store.put("c", "k3", 1_500, Priority::Normal);
    firing.insert(dup);
    w.added(dup, &store.jobs[&dup].clone(), &firing);
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    let got = w
        .release(TOPIC, 10, 2_000, &firing, &|_, _| false, &mut read)
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, late);
    // A failed fire puts it back.
    w.put_back(late, got[0].1.clone());
    let again = w
        .release(TOPIC, 10, 2_000, &firing, &|_, _| false, &mut read)
        .unwrap();
    assert_eq!(again.len(), 1);
}

#[test]
fn weights_share_the_releases_and_a_partition_let_go_drops_its_lanes() {
    let mut store = FakeStore::default();
    for i in 0..4_000 {
        store.put("big", &format!("b{i}"), 1_000, Priority::Normal);
        store.put("small", &format!("s{i}"), 1_000, Priority::Normal);
    }
    let weights = Weights {
        default: 1.0,
        tenants: [("big".to_string(), 3.0)].into_iter().collect(),
    };
    let mut w = FairWindow::new(&[TOPIC.to_string()], weights, 60_000, 512, 0);
    w.add_partition(0);
    let got = round(&mut w, &mut store, 2_000, 4_000);
    let big = got.iter().filter(|j| tenant(j) == "big").count();
    assert!((2_950..=3_050).contains(&big), "3:1 of 4,000: {big}");
    w.remove_partition(0);
    assert_eq!(w.buffered(), 0);
    assert!(!w.is_waiting(TOPIC));
}

#[test]
fn idle_workers_get_jobs_within_their_early_allowance_one_per_key_and_only_when_nothing_waits() {
    let mut store = FakeStore::default();
    let early = |store: &mut FakeStore, key: &str, run_at_ms: i64, allowance_ms: Option<u64>| {
        let k = store.put("a", key, run_at_ms, Priority::Normal);
        store.jobs.get_mut(&k).unwrap().job.early = allowance_ms.map(std::time::Duration::from_millis);
        k
    };
    let first = early(&mut store, "k1", 10_000, Some(9_000)); // may start from 1,000
    early(&mut store, "k1", 10_500, Some(9_500)); // same key: waits for the first
    let too_soon = early(&mut store, "k2", 10_000, Some(5_000)); // may start from 5,000
    early(&mut store, "k3", 10_000, None); // never early
    let mut w = window(64);
    let inflight = InFlight::default();
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    w.discover(2_000, &until_now(), &inflight, &mut read).unwrap();
    let got = w
        .release_early(
            TOPIC,
            10,
            2_000,
            60_000,
            &until_now(),
            &inflight,
            &|_, _| false,
            &mut read,
        )
        .unwrap()
        .0;
    let keys: Vec<DueKey> = got.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, vec![first], "only k1's first job: k2 not yet, k3 never");
    // Not read up to now: nothing early, the partition is to be read further.
    let behind: HashMap<i32, i64> = [(0, 1_500)].into_iter().collect();
    let (none, probe) = w
        .release_early(
            TOPIC,
            10,
            2_000,
            60_000,
            &behind,
            &inflight,
            &|_, _| false,
            &mut read,
        )
        .unwrap();
    assert!(none.is_empty());
    assert_eq!(probe, vec![0]);
    // While it is being fired, the key's next job stays.
    let mut firing = InFlight::default();
    firing.insert(got[0].0);
    w.discover(6_000, &until_now(), &firing, &mut read).unwrap();
    let got = w
        .release_early(
            TOPIC,
            10,
            6_000,
            60_000,
            &until_now(),
            &firing,
            &|_, _| false,
            &mut read,
        )
        .unwrap()
        .0;
    assert_eq!(got.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![too_soon]);
    // Something due waiting: nothing goes early.
    store.put("b", "due", 1_000, Priority::Normal);
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    w.add_partition(0);
    w.discover(6_000, &until_now(), &firing, &mut read).unwrap();
    assert!(w.is_waiting(TOPIC));
    let got = w
        .release_early(
            TOPIC,
            10,
            6_000,
            60_000,
            &until_now(),
            &firing,
            &|_, _| false,
            &mut read,
        )
        .unwrap()
        .0;
    assert!(got.is_empty());
}

#[test]
fn a_job_put_again_under_the_id_of_one_being_fired_is_released_in_its_turn() {
    let mut store = FakeStore::default();
    let mut w = window(100);
    let first = store.put("a", "k", 1_000, Priority::Normal);
    let mut firing = InFlight::default();
    {
        let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
        w.discover(2_000, &until_now(), &firing, &mut read).unwrap();
        let got = w
            .release(TOPIC, 10, 2_000, &firing, &|_, _| false, &mut read)
            .unwrap();
        assert_eq!(got.len(), 1);
    }
    firing.insert(first);
    // Its retry (same id) is stored while the first fire is under way.
    let id = store.jobs[&first].job.id;
    let retry = store.put("a", "k", 1_500, Priority::Normal);
    store.jobs.get_mut(&retry).unwrap().job.id = id;
    let job = store.jobs[&retry].clone();
    w.added(retry, &job, &firing);
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    let got = w
        .release(TOPIC, 10, 2_000, &firing, &|_, _| false, &mut read)
        .unwrap();
    assert_eq!(got.iter().map(|(k, _)| *k).collect::<Vec<_>>(), vec![retry]);
}

#[test]
fn interleaved_tenants_are_read_back_from_the_store_about_once_each() {
    // 100 tenants' jobs interleaved in run-at order, more than their lanes
    // buffer: refilling one lane at a time would read the store about a
    // hundred times per job released (each lane's jobs sit among the
    // others'); one read refills every lane missing from there on.
    let mut store = FakeStore::default();
    let (tenants, per_tenant) = (100, 200);
    for i in 0..per_tenant {
        for t in 0..tenants {
            store.put(
                &format!("t{t}"),
                &format!("t{t}-k{}", i % 3),
                1_000 + i,
                Priority::Normal,
            );
        }
    }
    let jobs = (tenants * per_tenant) as usize;
    let scanned = std::cell::Cell::new(0usize);
    let mut w = window(100_000);
    let inflight = InFlight::default();
    let mut released = Vec::new();
    loop {
        let mut read = |p, a, u, l| {
            let got = store.scan(p, a, u, l);
            scanned.set(scanned.get() + got.len());
            Ok(got)
        };
        while w
            .discover(5_000, &until_now(), &inflight, &mut read)
            .unwrap()
            .more
        {}
        let out = w
            .release(TOPIC, 1_000, 5_000, &inflight, &|_, _| false, &mut read)
            .unwrap();
        if out.is_empty() {
            break;
        }
        for (k, j) in out {
            store.jobs.remove(&k);
            w.removed(&k);
            released.push(j);
        }
    }
    assert_eq!(released.len(), jobs, "every job released once");
    assert!(
        scanned.get() <= 3 * jobs,
        "{} jobs read from the store to release {jobs}",
        scanned.get()
    );
    // Each tenant's jobs in key order.
    for t in 0..tenants {
        let name = format!("t{t}");
        let seqs: Vec<u64> = released
            .iter()
            .filter(|j| tenant(j) == name)
            .map(|j| j.seq)
            .collect();
        assert!(seqs.windows(2).all(|p| p[0] < p[1]), "tenant {name} out of order");
    }
}

/// Discover everything due by `now_ms` (as many reads as it takes).
fn discover_all(w: &mut FairWindow, store: &FakeStore, now_ms: i64) {
    let inflight = InFlight::default();
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    while w
        .discover(now_ms, &until_now(), &inflight, &mut read)
        .unwrap()
        .more
    {}
}

#[test]
fn a_job_handed_over_twice_while_its_lane_is_full_is_released_once() {
    let mut store = FakeStore::default();
    let keys: Vec<DueKey> = (0..LANE_JOBS + 6)
        .map(|i| store.put("a", &format!("k{i}"), 1_000, Priority::Normal))
        .collect();
    let mut w = window(1_000);
    discover_all(&mut w, &store, 2_000);
    // The store's change for the first job is followed after a read found
    // it (the ingest's write, then its follow): the lane is full.
    w.added(keys[0], &store.jobs[&keys[0]], &InFlight::default());
    // One round: the released jobs are still in the store, not yet in flight.
    let inflight = InFlight::default();
    let mut read = |p, a, u, l| Ok(store.scan(p, a, u, l));
    let out = w
        .release(TOPIC, 10, 2_000, &inflight, &|_, _| false, &mut read)
        .unwrap();
    let released: Vec<DueKey> = out.iter().map(|(k, _)| *k).collect();
    assert_eq!(released, keys[..10], "each once, in key order");
}

#[test]
fn a_lane_whose_buffered_jobs_follow_a_missing_one_is_not_stalled_by_a_full_window() {
    let mut store = FakeStore::default();
    for i in 0..LANE_JOBS {
        store.put("a", &format!("k{i}"), 1_000, Priority::Normal);
    }
    // Every buffer full: the window's capacity is the lane's 64 jobs.
    let mut w = window(LANE_JOBS);
    discover_all(&mut w, &store, 2_000);
    assert_eq!(w.buffered(), LANE_JOBS);
    // A job due earlier arrives late, behind the cursor, with no room: the
    // lane is missing it, before every job it buffers.
    let late = store.put("a", "late", 500, Priority::Normal);
    w.added(late, &store.jobs[&late], &InFlight::default());
    let mut released = Vec::new();
    for _ in 0..LANE_JOBS + 1 {
        let got = round(&mut w, &mut store, 2_000, 1);
        assert_eq!(got.len(), 1, "a round released nothing: the lane stalled");
        released.extend(got.into_iter().map(|j| j.seq));
    }
    assert_eq!(released[0], late.seq, "the job due first goes first");
    assert!(store.jobs.is_empty());
}
