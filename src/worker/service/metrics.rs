//! What a worker shows on its admin endpoint ([`crate::admin`]).

use serde_json::json;

use std::sync::atomic::Ordering;

use super::{stats, WorkerHandle};
use crate::admin::{Metrics, Source};

/// Per work topic and outcome (`started`, `succeeded`, `retried`,
/// `dead_lettered`), the count.
fn by_topic(h: &WorkerHandle) -> Vec<(Vec<String>, u64)> {
    let s = &h.shared;
    s.topics
        .names
        .iter()
        .zip(&s.stats.by_topic)
        .flat_map(|(topic, c)| {
            [
                ("started", &c.started),
                ("succeeded", &c.succeeded),
                ("retried", &c.retried),
                ("dead_lettered", &c.dead_lettered),
                ("deferred", &c.deferred),
            ]
            .map(|(outcome, n)| {
                (
                    vec![topic.clone(), outcome.to_string()],
                    n.load(Ordering::Relaxed),
                )
            })
        })
        .collect()
}

/// Handler runs of one topic going on now: started, not yet ended.
fn running(c: &super::TopicCounts) -> u64 {
    let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
    let ended = load(&c.succeeded)
        + load(&c.retried)
        + load(&c.dead_lettered)
        + load(&c.deferred)
        + load(&c.unsettled);
    load(&c.started).saturating_sub(ended)
}

/// Per work topic: runs started, how they settled, and how many run now.
fn topics(h: &WorkerHandle) -> Vec<serde_json::Value> {
    let s = &h.shared;
    s.topics
        .names
        .iter()
        .zip(&s.stats.by_topic)
        .map(|(topic, c)| {
            let load = |n: &std::sync::atomic::AtomicU64| n.load(Ordering::Relaxed);
            json!({
                "topic": topic,
                "started": load(&c.started),
                "succeeded": load(&c.succeeded),
                "retried": load(&c.retried),
                "dead_lettered": load(&c.dead_lettered),
                "running": running(c),
            })
        })
        .collect()
}

/// How long the longest-held key has been held, in seconds.
fn held_oldest_seconds(h: &WorkerHandle) -> i64 {
    let oldest = h.shared.jobs.oldest_hold_ms();
    let now = h.shared.clock.now().timestamp_millis();
    oldest.map_or(0, |since| (now - since).max(0) / 1000)
}

/// Records read and not yet below the commit point, over owned partitions.
fn uncommitted(h: &WorkerHandle) -> i64 {
    h.shared.jobs.uncommitted() as i64
}

impl Source for WorkerHandle {
    fn metrics(&self) -> Metrics {
        let s = stats(&self.shared);
        let mut m = Metrics::default();
        m.gauge(
            "kairos_worker_partitions_owned",
            "Work-topic partitions this worker owns.",
            s.owned as i64,
        )
        .gauge(
            "kairos_worker_open_jobs",
            "Jobs read and not yet settled (buffered or running).",
            s.open as i64,
        )
        .gauge(
            "kairos_worker_running_jobs",
            "Handler runs going on now (the rest of the open jobs wait in the buffer).",
            self.shared.stats.by_topic.iter().map(running).sum::<u64>() as i64,
        )
        .counter("kairos_worker_started", "Handler runs started.", s.started)
        .counter("kairos_worker_succeeded", "Jobs done.", s.succeeded)
        .counter(
            "kairos_worker_retried",
            "Jobs sent back through the scheduler for another attempt.",
            s.retried,
        )
        .counter(
            "kairos_worker_dead_lettered",
            "Records and jobs dead-lettered.",
            s.dead_lettered,
        )
        .counter(
            "kairos_worker_panicked",
            "Handler runs that panicked.",
            s.panicked,
        )
        .counter(
            "kairos_worker_handed_to_scheduler",
            "Jobs read before their run-at and handed to the scheduler.",
            s.handed_to_scheduler,
        )
        .counter(
            "kairos_worker_skipped",
            "Jobs not run because a job of their key was running or waiting (kairos-if-busy: skip).",
            s.skipped,
        )
        .counter(
            "kairos_worker_transactions",
            "Exactly-once mode: transactions committed (a commit round's writes and offsets).",
            s.transactions,
        )
        .counter(
            "kairos_worker_transactions_aborted",
            "Exactly-once mode: transactions aborted (their writes go into the next one).",
            s.transactions_aborted,
        )
        .counter(
            "kairos_worker_writes_refused",
            "Exactly-once mode: jobs whose writes Kafka refused for good (too large for their topic, \
                 not authorised, ...), dead-lettered instead.",
            s.refused,
        )
        .counter_by(
            "kairos_worker_topic_jobs",
            "Handler runs started, and jobs settled by outcome, per work topic.",
            &["topic", "outcome"],
            by_topic(self),
        )
        .rebalances(
            "worker",
            self.shared.stats.assigned.load(Ordering::Relaxed),
            self.shared.stats.revoked.load(Ordering::Relaxed),
        )
        .gauge(
            "kairos_worker_uncommitted_records",
            "Records read past each owned partition's commit point (the lowest unfinished \
                 offset), summed: what a crash now would run again at most.",
            uncommitted(self),
        )
        .gauge(
            "kairos_worker_out_of_touch",
            "1 while no job starts because the group coordinator has not taken a commit of this \
                 worker for half its session timeout (its partitions may have moved), else 0.",
            i64::from(s.out_of_touch),
        )
        .gauge(
            "kairos_worker_held_keys",
            "Keys held now (a failed job waiting for its retry on a hold_key topic, or a long \
                 pacing wait), over owned partitions.",
            s.held_keys as i64,
        )
        .gauge(
            "kairos_worker_held_key_oldest_seconds",
            "How long the longest-held key has been held (0: none held).",
            held_oldest_seconds(self),
        )
        .gauge(
            "kairos_worker_paced_waiting_jobs",
            "Jobs waiting in memory for their pacing turn (holding no concurrency slot).",
            self.shared.jobs.paced_waiting() as i64,
        )
        .counter(
            "kairos_worker_parked",
            "Jobs parked behind a held key (written to the scheduler, to come back in order).",
            s.parked,
        )
        .counter(
            "kairos_worker_deferred",
            "Jobs written again with the same attempt, due later (rate limited, or a pacing turn \
                 further ahead than the worker waits in memory).",
            s.deferred,
        )
        .counter(
            "kairos_worker_hold_overflow",
            "Failures whose key was not held because max_held_keys were (their retries overtook).",
            self.shared.stats.hold_overflow.load(Ordering::Relaxed),
        )
        .counter(
            "kairos_worker_hold_records_unreadable",
            "Held-topic records read back that did not decode (each logged as an error with its \
                 key: its order through the hand-over is not known).",
            self.shared.stats.holds_unreadable.load(Ordering::Relaxed),
        )
        .counter(
            "kairos_worker_released_keys",
            "Key releases read (kairos keys release).",
            self.shared.stats.released.load(Ordering::Relaxed),
        )
        .histogram(
            "kairos_worker_start_delay_seconds",
            "Handler start minus the job's run-at: how late jobs start.",
            &self.shared.stats.start_delay,
        )
        .histogram(
            "kairos_worker_job_duration_seconds",
            "How long handler runs take.",
            &self.shared.stats.duration,
        );
        m
    }

    fn status(&self) -> serde_json::Value {
        json!({
            "role": "worker",
            "group": self.shared.cfg.worker.group_id,
            "topics": self.shared.topics.names,
            "concurrency": self.shared.cfg.worker.concurrency,
            "ready": self.ready(),
            "stats": stats(&self.shared),
            "by_topic": topics(self),
            "stopping": self.shared.signals.stop.is_cancelled(),
        })
    }

    /// Ready while it owns a partition and is not stopping.
    fn ready(&self) -> bool {
        !self.shared.signals.stop.is_cancelled() && stats(&self.shared).owned > 0
    }
}
