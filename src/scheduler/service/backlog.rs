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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::BaseConsumer;
use tracing::{debug, warn};

use super::Shared;
use crate::hash::HashMap;
use crate::{kafka, overview};

/// One fair topic's backlog.
#[derive(Default)]
struct Topic {
    /// Jobs released since start.
    released: AtomicU64,
    /// The last read: the group's lag, and `released` when the read began.
    /// `None` until the first read succeeds.
    read: Mutex<Option<(i64, u64)>>,
}

/// Per fair topic, what was released and what the workers have not finished.
#[derive(Default)]
pub(super) struct Backlog {
    topics: HashMap<String, Topic>,
}

impl Backlog {
    pub(super) fn new(topics: &[String]) -> Self {
        Backlog {
            topics: topics.iter().map(|t| (t.clone(), Topic::default())).collect(),
        }
    }

    /// `n` jobs of `topic` were released.
    pub(super) fn released(&self, topic: &str, n: u64) {
        if let Some(t) = self.topics.get(topic) {
            t.released.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Jobs of each fair topic that may be released now to keep its
    /// backlog at `target` (none before the first read).
    pub(super) fn allowance(&self, target: u64) -> HashMap<String, usize> {
        self.topics
            .iter()
            .map(|(name, t)| (name.clone(), t.allowance(target)))
            .collect()
    }

    /// Each fair topic's backlog as last counted.
    pub(super) fn current(&self) -> Vec<(String, i64)> {
        let mut out: Vec<(String, i64)> = self
            .topics
            .iter()
            .filter_map(|(name, t)| t.backlog().map(|b| (name.clone(), b)))
            .collect();
        out.sort();
        out
    }

    /// Jobs released since start, per fair topic.
    pub(super) fn released_total(&self) -> Vec<(String, u64)> {
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
        let read = *self.read.lock().unwrap_or_else(|e| e.into_inner());
        read.map(|(lag, released_then)| {
            let since = self
                .released
                .load(Ordering::Relaxed)
                .saturating_sub(released_then);
            lag.saturating_add(since as i64)
        })
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
pub(super) fn backlog_loop(shared: &Shared, backlog: &Backlog) {
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
    while !shared.stop.is_cancelled() {
        let started = Instant::now();
        let mut failed = false;
        for (name, t) in &backlog.topics {
            let released_then = t.released.load(Ordering::Relaxed);
            match read_lag(&consumer, name, &mut partitions, timeout) {
                Ok(lag) => {
                    *t.read.lock().unwrap_or_else(|e| e.into_inner()) = Some((lag, released_then));
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
        shared.wake.notify_one();
        let left = every.saturating_sub(started.elapsed());
        if shared.stop.is_cancelled() {
            break;
        }
        std::thread::sleep(left.max(Duration::from_millis(1)));
    }
}

/// The group's lag on `topic` (0 when the topic does not exist: nothing
/// waits there). Partition lists are looked up again every 30 s.
fn read_lag(
    consumer: &BaseConsumer,
    topic: &str,
    partitions: &mut HashMap<String, (Vec<i32>, Instant)>,
    timeout: Duration,
) -> Result<i64, rdkafka::error::KafkaError> {
    let fresh = partitions
        .get(topic)
        .is_some_and(|(_, at)| at.elapsed() < Duration::from_secs(30));
    if !fresh {
        let parts = overview::partitions_of(consumer, topic, timeout)?.unwrap_or_default();
        debug!(topic, partitions = parts.len(), "fair topic partitions");
        partitions.insert(topic.to_string(), (parts, Instant::now()));
    }
    let parts = &partitions[topic].0;
    if parts.is_empty() {
        return Ok(0);
    }
    let ends = overview::watermarks(consumer, topic, parts, timeout)?;
    overview::group_lag(consumer, topic, &ends, timeout)
}
