//! The dispatcher's rounds against a real store on disk, driven by a
//! manual clock: nothing fires before its run-at, the dispatcher wakes when
//! the next job comes due, the window refills from the store as time moves,
//! and a partition not read up to a job's run-at holds it.

use chrono::{DateTime, TimeZone, Utc};

use super::*;
use crate::clock::ManualClock;
use crate::job::Job;
use crate::scheduler::service::jobs::SchedulerJobs;
use crate::scheduler::store::Change;
use crate::scheduler::timer_wheel::TimerWheel;

const SPAN_MS: i64 = 60_000;

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).unwrap()
}

fn job(key: &str, run_at_ms: i64, seq: u64) -> Change {
    let job = Job::new("emails", key, b"p".to_vec()).at(at(run_at_ms));
    Change::Put(StoredJob { job, seq })
}

struct Setup {
    _dir: tempfile::TempDir,
    store: Store,
    jobs: SchedulerJobs,
    clock: ManualClock,
}

/// Partitions 0 and 1 owned, jobs stored at the given run-ats (ms after
/// the start), the clock at the start.
fn set_up(jobs: &[(i32, &str, i64)]) -> Setup {
    set_up_with(jobs, false)
}

/// As [`set_up`], with topic `emails` dispatched fairly when `fair`.
fn set_up_with(jobs: &[(i32, &str, i64)], fair: bool) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let start = 1_700_000_000_000;
    let clock = ManualClock::new(at(start));
    let store = Store::open_with_clock(dir.path(), 1 << 20, std::sync::Arc::new(clock.clone())).unwrap();
    for (seq, (p, key, ms)) in jobs.iter().enumerate() {
        store
            .apply(*p, &[job(key, start + ms, seq as u64)], None)
            .unwrap();
    }
    let fair = fair.then(|| {
        let topics = ["emails".to_string()];
        let weights = crate::scheduler::fair::Weights::default();
        crate::scheduler::fair::FairWindow::new(&topics, weights, 60_000, 1000, start)
    });
    let jobs = SchedulerJobs::new(TimerWheel::new(SPAN_MS, 1000), fair);
    for p in [0, 1] {
        // As on assignment: the cascade point three windows ahead.
        cascade(&store, p, start + 3 * SPAN_MS);
        jobs.assign(p);
    }
    Setup {
        _dir: dir,
        store,
        jobs,
        clock,
    }
}

/// What the cascader does.
fn cascade(store: &Store, p: i32, until: i64) {
    while store.cascade(p, until).unwrap() < until {}
}

fn read_to_the_end() -> HashMap<i32, i64> {
    [(0, i64::MAX), (1, i64::MAX)].into_iter().collect()
}

impl Setup {
    fn round(&mut self, max: usize, until: &HashMap<i32, i64>) -> Round {
        self.round_allowing(max, until, &HashMap::default())
    }

    /// A round with fair topics allowed to release `allowance` jobs.
    fn round_allowing(
        &mut self,
        max: usize,
        until: &HashMap<i32, i64>,
        allowance: &HashMap<String, usize>,
    ) -> Round {
        let r = Round::take(&self.jobs, &self.store, &self.clock, max, until, allowance).unwrap();
        self.jobs.finished(&[], &r.due, Vec::new(), &HashMap::default());
        self.jobs.rounds_done([&r.parts]);
        r
    }

    fn in_memory(&self) -> usize {
        self.jobs.owned_and_in_memory().1
    }

    fn keys(r: &Round) -> Vec<String> {
        r.due
            .iter()
            .map(|(_, s)| s.job.key_lossy().into_owned())
            .collect()
    }

    fn advance_ms(&self, ms: i64) {
        self.clock.advance(chrono::Duration::milliseconds(ms));
    }
}

#[test]
fn nothing_fires_before_its_run_at_and_the_dispatcher_wakes_when_the_next_comes_due() {
    let mut s = set_up(&[(0, "a", 10_000), (1, "b", 30_000), (0, "c", 30_001)]);
    let start = s.clock.now().timestamp_millis();
    let r = s.round(100, &read_to_the_end());
    assert!(r.due.is_empty());
    assert_eq!(r.wake_at, Some(start + 10_000), "asleep until a is due");

    s.advance_ms(9_999);
    assert!(s.round(100, &read_to_the_end()).due.is_empty(), "1 ms early");
    s.advance_ms(1);
    let r = s.round(100, &read_to_the_end());
    assert_eq!(Setup::keys(&r), ["a"]);
    assert_eq!(r.parts, [0].into_iter().collect());
    assert_eq!(r.wake_at, Some(start + 30_000));

    // Late (the clock jumped): both due jobs, in run-at order, capped by the batch.
    s.advance_ms(60_000);
    let r = s.round(1, &read_to_the_end());
    assert_eq!(Setup::keys(&r), ["b"]);
    let r = s.round(1, &read_to_the_end());
    assert_eq!(Setup::keys(&r), ["c"]);
    assert!(s.round(1, &read_to_the_end()).due.is_empty());
}

#[test]
fn the_window_refills_from_the_store_as_time_moves() {
    // Beyond the first window: on disk only until the clock gets near.
    let mut s = set_up(&[(0, "soon", 1_000), (1, "in-an-hour", 3_600_000)]);
    let start = s.clock.now().timestamp_millis();
    let r = s.round(100, &read_to_the_end());
    assert!(r.due.is_empty());
    assert_eq!(s.in_memory(), 1, "only the job within the span is in memory");
    assert!(r.wake_at.unwrap() <= start + 1_000);

    s.advance_ms(1_000);
    assert_eq!(Setup::keys(&s.round(100, &read_to_the_end())), ["soon"]);
    // Nothing in memory; the dispatcher still wakes to refill the window.
    let r = s.round(100, &read_to_the_end());
    let refill = r.wake_at.expect("a refill is planned");
    assert!(refill <= start + SPAN_MS, "{refill}");

    // An hour later: the cascade point is far behind. The round says so
    // (the dispatcher then asks the cascader) instead of cascading itself.
    s.clock.set(at(start + 3_600_000 - 1));
    let r = s.round(100, &read_to_the_end());
    assert!(r.due.is_empty());
    assert!(r.behind_cascade);
    assert_eq!(s.in_memory(), 0, "the hour's job is still a far job");
    cascade(&s.store, 1, start + 3_600_000 + 3 * SPAN_MS);
    cascade(&s.store, 0, start + 3_600_000 + 3 * SPAN_MS);
    let r = s.round(100, &read_to_the_end());
    assert!(!r.behind_cascade);
    assert!(r.due.is_empty());
    assert_eq!(s.in_memory(), 1, "refilled: the hour's job is in memory");
    assert_eq!(r.wake_at, Some(start + 3_600_000));
    s.advance_ms(1);
    assert_eq!(Setup::keys(&s.round(100, &read_to_the_end())), ["in-an-hour"]);
}

#[test]
fn a_job_waits_until_its_partition_is_read_up_to_its_run_at() {
    let mut s = set_up(&[(0, "a", 1_000), (1, "b", 1_000)]);
    let start = s.clock.now().timestamp_millis();
    s.advance_ms(5_000);
    // Partition 0 is read to records created just before a's run-at.
    let until: HashMap<i32, i64> = [(0, start + 999), (1, i64::MAX)].into_iter().collect();
    let r = s.round(100, &until);
    assert_eq!(Setup::keys(&r), ["b"]);
    assert_eq!(r.held, [(0, start + 1_000)].into_iter().collect());
    let until: HashMap<i32, i64> = [(0, start + 1_000), (1, i64::MAX)].into_iter().collect();
    let r = s.round(100, &until);
    assert_eq!(Setup::keys(&r), ["a"]);
    assert!(r.held.is_empty());
}

#[test]
fn a_fair_job_still_in_a_far_bucket_when_due_is_released_once_the_cascade_brings_it_near() {
    // Past the cascade point (three spans ahead): in a far bucket.
    let mut s = set_up_with(&[(0, "far", 10 * SPAN_MS), (1, "near", 1_000)], true);
    let start = s.clock.now().timestamp_millis();
    let allow: HashMap<String, usize> = [("emails".to_string(), 100)].into_iter().collect();
    // The clock passes the far job's run-at while the cascader lags behind
    // (as after a take-over or an outage).
    s.advance_ms(11 * SPAN_MS);
    let r = s.round_allowing(100, &read_to_the_end(), &allow);
    assert_eq!(
        Setup::keys(&r),
        ["near"],
        "the near job goes; the far one is not in the near range yet"
    );
    assert!(r.behind_cascade, "the cascader is asked to catch up");
    cascade(&s.store, 0, start + 14 * SPAN_MS);
    let r = s.round_allowing(100, &read_to_the_end(), &allow);
    assert_eq!(
        Setup::keys(&r),
        ["far"],
        "brought near by the cascade, it is released"
    );
}
