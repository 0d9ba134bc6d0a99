//! The fair topics' backlog: jobs released to a fair topic and not yet
//! committed by the worker group, which the scheduler keeps near
//! `[fair] backlog_target`.
//!
//! The signal is the worker group's committed offsets against the topic's
//! end offsets, read every `[fair] poll_interval` by thread `kairos-backlog`
//! (workers commit every 100 ms, so it trails the workers by about that
//! plus the poll interval), plus the jobs released since the read began:
//! those may not be in the end offsets yet. A job counted twice (released
//! just before a read that already sees it) only holds the next release
//! back until the next read.
//!
//! The target follows the workers' pace: at least what the group finished
//! in `[fair] backlog_time`, measured from the same reads (the committed
//! offsets' progress over the last half second). With the target fixed, a
//! group able to run 50,000 jobs/s would get `backlog_target` jobs per
//! read-and-commit round trip (about 200 ms) and idle the rest; with it
//! following the pace, the backlog is about `backlog_time` of work, which
//! is also about how long a newly arriving tenant waits behind it. The
//! pace climbs slowly from the floor (it measures what was released), so
//! the target also doubles while the workers finish all of it ([`Grant`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::BaseConsumer;
use tracing::{debug, warn};

use super::Shared;
use crate::hash::HashMap;
use crate::kafka;
use crate::sync::Lock;

/// One fair topic's backlog.
#[derive(Default)]
struct Topic {
    /// Jobs released since start.
    released: AtomicU64,
    /// The last read: the group's lag, and `released` when the read began.
    /// `None` until the first read succeeds.
    read: Mutex<Option<(i64, u64)>>,
    /// Jobs per second the worker group finished lately (0 until measured).
    pace: AtomicU64,
    /// The backlog aimed at, as last set by [`Grant::next`] (0 until the
    /// first read: the floor).
    grant: AtomicU64,
    /// A dispatcher round released all this topic's allowance since the
    /// last read: the grant, not the jobs due, bounded the release.
    capped: std::sync::atomic::AtomicBool,
}

/// How the backlog aimed at moves from read to read: never below the floor
/// nor below what the workers finish in `backlog_time` at their pace; twice
/// as much when the last grant was used up (a round released all it allowed)
/// and the workers had finished nearly all of it by the read (a quarter or
/// less left); otherwise an eighth less. Only reads that saw a commit move it
/// while jobs are outstanding ([`Topic::regrant`]). The pace alone climbs
/// slowly: it measures what the workers finished, which is what was released,
/// so from the floor it took seconds to reach fast workers' rate (each pace
/// window lifting it by `backlog_time` over the read-and-commit round trip).
/// Doubling reaches it in a few reads, and only while the workers keep up. At
/// most four times the larger of the floor and the paced target: a flood is
/// never let out in one go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Grant {
    floor: u64,
    paced: u64,
}

impl Grant {
    fn next(self, grant: u64, capped: bool, lag: i64) -> u64 {
        let grant = grant.max(self.floor);
        let drained = lag <= (grant / 4) as i64;
        let next = if capped && drained {
            grant.saturating_mul(2)
        } else {
            grant - grant / 8
        };
        self.bound(next)
    }

    /// `grant` kept between the larger of the floor and the paced target
    /// and four times that.
    fn bound(self, grant: u64) -> u64 {
        let base = self.floor.max(self.paced);
        grant.clamp(base, base.saturating_mul(4))
    }
}

/// How far back the workers' pace is measured: a few of their commits.
const PACE_OVER: Duration = Duration::from_millis(500);

/// The worker group's progress on one topic, read after read: jobs
/// finished (committed) per second over the last [`PACE_OVER`].
#[derive(Default)]
struct Pace {
    /// (when, jobs finished in all) of the reads in the last `PACE_OVER`,
    /// and the one before them.
    reads: VecDeque<(Instant, i64)>,
}

impl Pace {
    /// Jobs finished in all at the last read.
    fn last(&self) -> Option<i64> {
        self.reads.back().map(|&(_, done)| done)
    }

    /// A read at `at` found `done` jobs finished in all; returns the pace.
    fn read(&mut self, at: Instant, done: i64) -> u64 {
        self.reads.push_back((at, done));
        while self.reads.len() > 2 && at.saturating_duration_since(self.reads[1].0) >= PACE_OVER {
            self.reads.pop_front();
        }
        let (t0, d0) = self.reads[0];
        let span = at.saturating_duration_since(t0).as_secs_f64();
        if span <= 0.0 {
            return 0;
        }
        // Committed offsets can go back (a reset group): that is no pace.
        ((done - d0).max(0) as f64 / span) as u64
    }
}

/// Per fair topic, what was released and what the workers have not finished.
#[derive(Default)]
pub(in crate::scheduler::service) struct Backlog {
    topics: HashMap<String, Topic>,
}

impl Backlog {
    pub(in crate::scheduler::service) fn new(topics: &[String]) -> Self {
        Backlog {
            topics: topics.iter().map(|t| (t.clone(), Topic::default())).collect(),
        }
    }

    /// `n` jobs of `topic` were released.
    pub(in crate::scheduler::service) fn released(&self, topic: &str, n: u64) {
        if let Some(t) = self.topics.get(topic) {
            t.released.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// A round released all of `topic`'s allowance.
    pub(in crate::scheduler::service) fn capped(&self, topic: &str) {
        if let Some(t) = self.topics.get(topic) {
            t.capped.store(true, Ordering::Relaxed);
        }
    }

    /// Jobs of each fair topic that may be released now (none before the
    /// first read): the topic's target ([`Backlog::targets`]) times `share`
    /// (of an instance that owns part of the schedule partitions), less the
    /// backlog.
    pub(in crate::scheduler::service) fn allowance(
        &self,
        floor: u64,
        time: Duration,
        share: f64,
    ) -> HashMap<String, usize> {
        self.topics
            .iter()
            .map(|(name, t)| {
                let target = (t.target(floor, time) as f64 * share).ceil() as u64;
                (name.clone(), t.allowance(target))
            })
            .collect()
    }

    /// Each fair topic's backlog target: `floor`, or what the workers
    /// finish in `time` at their recent pace when that is more.
    pub(in crate::scheduler::service) fn targets(&self, floor: u64, time: Duration) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = self
            .topics
            .iter()
            .map(|(name, t)| (name.clone(), t.target(floor, time) as i64))
            .collect();
        out.sort();
        out
    }

    /// Each fair topic's backlog as last counted.
    pub(in crate::scheduler::service) fn current(&self) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = self
            .topics
            .iter()
            .filter_map(|(name, t)| t.backlog().map(|b| (name.clone(), b)))
            .collect();
        out.sort();
        out
    }

    /// Jobs released since start, per fair topic.
    pub(in crate::scheduler::service) fn released_total(&self) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = self
            .topics
            .iter()
            .map(|(name, t)| (name.clone(), t.released.load(Ordering::Relaxed)))
            .collect();
        out.sort();
        out
    }
}

impl Topic {
    fn backlog(&self) -> Option<i64> {
        let read = *self.read.locked();
        read.map(|(lag, released_then)| {
            let since = self
                .released
                .load(Ordering::Relaxed)
                .saturating_sub(released_then);
            lag.saturating_add(since as i64)
        })
    }

    /// The grant's bounds now: the floor and the workers' pace over `time`.
    fn rule(&self, floor: u64, time: Duration) -> Grant {
        let paced = self.pace.load(Ordering::Relaxed) as f64 * time.as_secs_f64();
        Grant {
            floor,
            paced: paced as u64,
        }
    }

    /// The backlog aimed at: the grant (`backlog_time` 0: the floor only).
    fn target(&self, floor: u64, time: Duration) -> u64 {
        if time.is_zero() {
            return floor;
        }
        self.rule(floor, time).bound(self.grant.load(Ordering::Relaxed))
    }

    /// After a read that found `lag`: move the grant ([`Grant::next`]).
    /// `heard`: the read saw a commit the one before it had not. Reads come
    /// every `poll_interval` and commits every 100 ms, so most reads between
    /// two commits find the workers where the last commit left them: with
    /// work outstanding, such a read tells nothing about how much of it is
    /// done, and the grant stays (shrinking there had undone most of each
    /// doubling before the next commit could confirm it).
    fn regrant(&self, floor: u64, time: Duration, lag: i64, heard: bool) {
        if !heard && lag > 0 {
            return;
        }
        let capped = self.capped.swap(false, Ordering::Relaxed);
        let next = self
            .rule(floor, time)
            .next(self.grant.load(Ordering::Relaxed), capped, lag);
        self.grant.store(next, Ordering::Relaxed);
    }

    fn allowance(&self, target: u64) -> usize {
        match self.backlog() {
            Some(b) => (target as i64).saturating_sub(b).max(0) as usize,
            None => 0,
        }
    }
}

/// Read the worker group's lag on every fair topic each poll interval, and
/// wake the dispatcher after each read. Runs until the scheduler stops.
pub(in crate::scheduler::service) fn backlog_loop(shared: &Shared, backlog: &Backlog) {
    let cfg = &shared.cfg;
    let every = cfg.fair.poll_interval;
    let timeout = cfg.kafka.produce_timeout.min(Duration::from_secs(5));
    let consumer: BaseConsumer = {
        let mut rc = kafka::base_config(&cfg.kafka, "kairos-backlog");
        // Reads the worker group's committed offsets; never joins it.
        rc.set("group.id", &cfg.worker.group_id)
            .set("enable.auto.commit", "false");
        match rc.create() {
            Ok(c) => c,
            Err(e) => {
                shared.fail(format!("fair dispatch: cannot create the backlog reader: {e}"));
                return;
            }
        }
    };
    let mut partitions: HashMap<String, (Vec<i32>, Instant)> = HashMap::default();
    let mut failing_since: Option<Instant> = None;
    let mut paces: HashMap<&str, Pace> = HashMap::default();
    while !shared.signals.stop.is_cancelled() {
        let started = Instant::now();
        let mut failed = false;
        for (name, t) in &backlog.topics {
            let released_then = t.released.load(Ordering::Relaxed);
            match read_lag(&consumer, name, &mut partitions, timeout) {
                Ok((lag, ends)) => {
                    *t.read.locked() = Some((lag, released_then));
                    let pace = paces.entry(name).or_default();
                    let heard = pace.last() != Some(ends - lag);
                    t.pace
                        .store(pace.read(Instant::now(), ends - lag), Ordering::Relaxed);
                    t.regrant(cfg.fair.backlog_target, cfg.fair.backlog_time, lag, heard);
                }
                Err(e) => {
                    failed = true;
                    if failing_since.is_none_or(|s| s.elapsed() >= Duration::from_secs(30)) {
                        failing_since = Some(Instant::now());
                        warn!(topic = %name, error = %e, "fair dispatch: cannot read the worker group's progress; releasing no more than the last read allows");
                    }
                }
            }
        }
        if !failed {
            failing_since = None;
        }
        shared.signals.wake.notify_one();
        let left = every.saturating_sub(started.elapsed());
        if shared.signals.stop.is_cancelled() {
            break;
        }
        std::thread::sleep(left.max(Duration::from_millis(1)));
    }
}

/// The group's lag on `topic` and the sum of its end offsets (both 0 when
/// the topic does not exist: nothing waits there). Partition lists are
/// looked up again every 30 s.
fn read_lag(
    consumer: &BaseConsumer,
    topic: &str,
    partitions: &mut HashMap<String, (Vec<i32>, Instant)>,
    timeout: Duration,
) -> Result<(i64, i64), rdkafka::error::KafkaError> {
    let fresh = partitions
        .get(topic)
        .is_some_and(|(_, at)| at.elapsed() < Duration::from_secs(30));
    if !fresh {
        let parts = kafka::partitions_of(consumer, topic, timeout)?.unwrap_or_default();
        debug!(topic, partitions = parts.len(), "fair topic partitions");
        partitions.insert(topic.to_string(), (parts, Instant::now()));
    }
    let parts = &partitions[topic].0;
    if parts.is_empty() {
        return Ok((0, 0));
    }
    let ends = kafka::watermarks(consumer, topic, parts, timeout)?;
    let lag = kafka::group_lag(consumer, topic, &ends, timeout)?;
    Ok((lag, ends.iter().map(|(_, (_, high))| high).sum()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_is_what_was_finished_over_the_last_half_second() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut p = Pace::default();
        assert_eq!(p.read(t0, 0), 0, "one read is no pace");
        assert_eq!(p.read(ms(100), 1_000), 10_000);
        assert_eq!(p.read(ms(200), 1_000), 5_000, "a read between two commits");
        assert_eq!(p.read(ms(300), 3_000), 10_000);
        // Reads older than half a second drop out: the pace follows a slowdown.
        for i in 4..=10 {
            p.read(ms(i * 100), 3_000 + (i as i64 - 3) * 100);
        }
        assert_eq!(p.read(ms(1_100), 3_800), 1_000);
        assert!(p.reads.len() <= 7, "{} reads kept", p.reads.len());
        // A group reset (offsets back) is no pace, not a negative one.
        let mut p = Pace::default();
        p.read(t0, 5_000);
        assert_eq!(p.read(ms(100), 0), 0);
    }

    #[test]
    fn the_grant_doubles_while_used_up_and_drained_and_shrinks_back_to_the_pace() {
        let rule = Grant {
            floor: 1_000,
            paced: 0,
        };
        // Used up and drained: doubles, up to four times the floor.
        assert_eq!(rule.next(1_000, true, 0), 2_000);
        assert_eq!(rule.next(2_000, true, 500), 4_000);
        assert_eq!(rule.next(4_000, true, 0), 4_000, "at most 4x the floor");
        // Work left at the read (more than a quarter), or not used up: shrinks.
        assert_eq!(rule.next(4_000, true, 1_001), 3_500);
        assert_eq!(rule.next(4_000, false, 0), 3_500);
        assert_eq!(rule.next(1_000, false, 0), 1_000, "never below the floor");
        // The paced target lifts both bounds.
        let fast = Grant {
            floor: 1_000,
            paced: 10_000,
        };
        assert_eq!(fast.next(1_000, false, 0), 10_000);
        assert_eq!(fast.next(10_000, true, 2_000), 20_000);
        assert_eq!(fast.next(40_000, true, 0), 40_000);
    }

    #[test]
    fn the_target_is_the_grant_between_the_paced_target_and_four_times_it() {
        let b = Backlog::new(&["t".to_string()]);
        let t = &b.topics["t"];
        let half = Duration::from_millis(500);
        t.regrant(1_000, half, 0, true);
        assert_eq!(
            b.targets(1_000, half),
            vec![("t".to_string(), 1_000)],
            "not used up"
        );
        b.capped("t");
        t.regrant(1_000, half, 100, true);
        assert_eq!(b.targets(1_000, half), vec![("t".to_string(), 2_000)]);
        assert_eq!(
            b.targets(1_000, Duration::ZERO),
            vec![("t".to_string(), 1_000)],
            "backlog_time 0: the floor"
        );
        b.capped("t");
        t.regrant(1_000, half, 2_000, false);
        assert_eq!(
            b.targets(1_000, half),
            vec![("t".to_string(), 2_000)],
            "no commit since the last read, work outstanding: the grant stays"
        );
        t.regrant(1_000, half, 2_000, true);
        assert_eq!(
            b.targets(1_000, half),
            vec![("t".to_string(), 1_750)],
            "work left at a commit: an eighth less"
        );
        t.regrant(1_000, half, 0, false);
        assert_eq!(
            b.targets(1_000, half),
            vec![("t".to_string(), 1_532)],
            "nothing outstanding: shrinks without a commit too"
        );
    }

    #[test]
    fn the_target_is_the_floor_or_the_pace_over_the_backlog_time() {
        let b = Backlog::new(&["t".to_string()]);
        let t = &b.topics["t"];
        let half = Duration::from_millis(500);
        assert_eq!(b.targets(1_000, half), vec![("t".to_string(), 1_000)]);
        t.pace.store(40_000, Ordering::Relaxed);
        assert_eq!(b.targets(1_000, half), vec![("t".to_string(), 20_000)]);
        assert_eq!(b.targets(1_000, Duration::ZERO), vec![("t".to_string(), 1_000)]);
        // No read yet: nothing may be released.
        assert_eq!(b.allowance(1_000, half, 1.0)["t"], 0);
        *t.read.lock().unwrap() = Some((5_000, 0));
        b.released("t", 1_000);
        assert_eq!(b.allowance(1_000, half, 1.0)["t"], 14_000);
        // An instance owning a third of the schedule partitions.
        assert_eq!(b.allowance(1_000, half, 1.0 / 3.0)["t"], 667);
    }
}
