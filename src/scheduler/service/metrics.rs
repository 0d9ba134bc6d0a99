//! What a scheduler shows on its admin endpoint ([`crate::admin`]).

use std::sync::atomic::Ordering;

use serde_json::json;

use super::{fair_status, stats, FairStatus, SchedulerHandle};
use crate::admin::{Metrics, Page, Source};
use crate::job::JobId;
use crate::sync::Lock;

/// The spans pending jobs are counted in by when they come due: already due
/// (`now`), within a minute, an hour, a day, `later` (the keys of `/status`
/// `pending_by_due`, `/pending` and the `due` label).
pub const DUE_SPANS: [&str; 5] = ["now", "1m", "1h", "1d", "later"];

/// Where each span but the last ends, in ms from now.
const DUE_SPAN_ENDS_MS: [i64; 4] = [1, 60_000, 3_600_000, 86_400_000];

/// The edges of [`DUE_SPANS`] at `now_ms`.
fn due_edges(now_ms: i64) -> Vec<i64> {
    DUE_SPAN_ENDS_MS
        .iter()
        .map(|ms| now_ms.saturating_add(*ms))
        .collect()
}

/// Jobs pending in owned partitions between `edges` (as
/// [`crate::scheduler::store::Store::pending_by_due`]), summed.
fn pending_over(h: &SchedulerHandle, edges: &[i64]) -> Vec<u64> {
    let shared = &h.shared;
    let mut total = vec![0u64; edges.len() + 1];
    for p in shared.jobs.partitions() {
        if let Ok(counts) = shared.store.pending_by_due(p, edges) {
            total.iter_mut().zip(counts).for_each(|(t, c)| *t += c);
        }
    }
    total
}

/// Jobs pending in owned partitions by [`DUE_SPANS`] (see
/// [`crate::scheduler::store::Store::pending_by_due`] for how exact).
pub(super) fn pending_by_due(h: &SchedulerHandle) -> Vec<(&'static str, u64)> {
    let now = h.shared.clock.now().timestamp_millis();
    DUE_SPANS
        .into_iter()
        .zip(pending_over(h, &due_edges(now)))
        .collect()
}

/// Per owned partition: (partition, jobs pending, ms the partition's read
/// position is behind the clock: jobs due later than that wait for it;
/// `None` before its first read).
fn partitions(h: &SchedulerHandle) -> Vec<(i32, u64, Option<i64>)> {
    let shared = &h.shared;
    let owned = shared.jobs.partitions();
    let read = shared.reads.caught_up().snapshot();
    let now = shared.clock.now().timestamp_millis();
    let mut out: Vec<(i32, u64, Option<i64>)> = owned
        .into_iter()
        .map(|p| {
            let pending = shared.store.checkpoint(p).map(|c| c.pending).unwrap_or(0);
            let behind = read
                .get(&p)
                .filter(|until| **until > 0)
                .map(|until| now.saturating_sub(*until).max(0));
            (p, pending, behind)
        })
        .collect();
    out.sort_unstable();
    out
}

/// Width and number of the spans of the dashboard's timeline.
const TIMELINE_STEP_MS: i64 = 30 * 60_000;
const TIMELINE_STEPS: i64 = 24;

/// Jobs pending by when they come due over the next 12 hours, in 30-minute
/// spans (the first includes jobs already due), then the rest.
fn due_timeline(h: &SchedulerHandle) -> serde_json::Value {
    let now = h.shared.clock.now().timestamp_millis();
    let edges: Vec<i64> = (1..=TIMELINE_STEPS).map(|i| now + i * TIMELINE_STEP_MS).collect();
    json!({"from_ms": now, "step_ms": TIMELINE_STEP_MS, "jobs": pending_over(h, &edges)})
}

/// The scheduler's dashboard (a static page whose script reads `/status`
/// and `/dlq`).
const DASHBOARD: Page = Page {
    html: include_str!("dashboard.html"),
    script: include_str!("dashboard.js"),
    style: include_str!("dashboard.css"),
};

impl Source for SchedulerHandle {
    fn metrics(&self) -> Metrics {
        let s = stats(&self.shared);
        let fair = fair_status(&self.shared);
        let parts = partitions(self);
        let mut m = Metrics::default();
        m.gauge(
            "kairos_scheduler_partitions_owned",
            "Schedule partitions this instance owns.",
            s.owned.len() as i64,
        )
        .gauge_by(
            "kairos_scheduler_pending_jobs",
            "Jobs pending in the store, per owned schedule partition.",
            "partition",
            parts.iter().map(|(p, n, _)| (p.to_string(), *n as i64)),
        )
        .gauge_by(
            "kairos_scheduler_read_behind_ms",
            "How far (ms) each owned schedule partition's reading is behind the clock; \
                 jobs due within it wait for the partition to be read (a cancel written before \
                 their run-at wins).",
            "partition",
            parts.iter().filter_map(|(p, _, b)| Some((p.to_string(), (*b)?))),
        )
        .gauge_by(
            "kairos_scheduler_pending_due_jobs",
            "Jobs pending in owned partitions by when they come due: already due (now), \
                 within a minute, an hour, a day, or later.",
            "due",
            pending_by_due(self)
                .into_iter()
                .map(|(d, n)| (d.to_string(), n as i64)),
        )
        .gauge(
            "kairos_scheduler_window_jobs",
            "Jobs held in memory, due soon.",
            s.in_memory as i64,
        )
        .counter(
            "kairos_scheduler_ingested",
            "Schedule records ingested.",
            s.ingested,
        )
        .counter(
            "kairos_scheduler_fired",
            "Jobs fired to their work topics.",
            s.fired,
        )
        .counter(
            "kairos_scheduler_fired_direct",
            "Jobs fired straight from memory (due on arrival).",
            s.fired_direct,
        )
        .counter("kairos_scheduler_cancelled", "Cancels applied.", s.cancelled)
        .counter(
            "kairos_scheduler_too_late",
            "Cancels and reschedules that met their job being fired.",
            s.too_late,
        )
        .counter(
            "kairos_scheduler_skipped",
            "Schedule records read again that were handled before.",
            s.skipped,
        )
        .counter(
            "kairos_scheduler_dead_lettered",
            "Records dead-lettered.",
            s.dead_lettered,
        )
        .counter(
            "kairos_scheduler_replayed",
            "Changelog records read to catch partitions up.",
            s.replayed,
        )
        .counter(
            "kairos_schedule_occurrences",
            "Occurrences of recurring schedules enqueued.",
            s.occurrences,
        )
        .counter(
            "kairos_schedule_occurrences_late",
            "Occurrences of recurring schedules enqueued after they were missed.",
            s.occurrences_late,
        )
        .counter(
            "kairos_schedule_occurrences_dropped",
            "Occurrences of recurring schedules missed and dropped by their misfire policy.",
            s.occurrences_dropped,
        )
        .counter(
            "kairos_schedule_updates",
            "Recurring schedule definitions read that changed a schedule (new, changed, deleted, refused).",
            s.schedule_updates,
        )
        .gauge(
            "kairos_schedules",
            "Recurring schedules held (defined, in owned partitions).",
            s.schedules as i64,
        )
        .counter(
            "kairos_schedule_occurrences_backfilled",
            "Occurrences of recurring schedules enqueued again by backfills.",
            s.occurrences_backfilled,
        )
        .gauge_by(
            "kairos_scheduler_schedule_lag_records",
            "Records of each owned schedule partition not read yet (end offset less position), \
                 measured every 5 s.",
            "partition",
            self.shared
                .stats
                .schedule_lag
                .locked()
                .iter()
                .map(|(p, n)| (p.to_string(), *n)),
        )
        .gauge(
            "kairos_scheduler_store_bytes",
            "Bytes the store takes on disk (sled and its value log).",
            self.shared.store.size_on_disk().map_or(-1, |b| b as i64),
        )
        .rebalances(
            "scheduler",
            self.shared.stats.assigned.load(Ordering::Relaxed),
            self.shared.stats.revoked.load(Ordering::Relaxed),
        )
        .gauge_by(
            "kairos_scheduler_fair_backlog_jobs",
            "Per fair topic, jobs released and not yet committed by the worker group (kept near \
                 [fair] backlog_target).",
            "topic",
            fair.backlog,
        )
        .gauge_by(
            "kairos_scheduler_fair_backlog_target",
            "Per fair topic, the backlog aimed at: [fair] backlog_target, or what the workers \
                 finished in [fair] backlog_time at their recent pace when that is more.",
            "topic",
            fair.target,
        )
        .counter_by(
            "kairos_scheduler_fair_released",
            "Per fair topic, jobs released in fair order.",
            &["topic"],
            fair.released.into_iter().map(|(t, n)| (vec![t], n)),
        )
        .gauge_by(
            "kairos_scheduler_fair_tenants_waiting",
            "Per fair topic, tenants with due jobs waiting to be released.",
            "topic",
            fair.tenants_waiting.into_iter().map(|(t, n)| (t, n as i64)),
        )
        .gauge_by(
            "kairos_scheduler_fair_tenants",
            "Per fair topic, tenants held in memory: with jobs waiting, or served within about \
                 ten [fair] half_life (then forgotten).",
            "topic",
            fair.tenants_known.into_iter().map(|(t, n)| (t, n as i64)),
        )
        .histogram(
            "kairos_scheduler_catch_up_seconds",
            "How long each assignment's changelog catch-up took.",
            &self.shared.stats.catch_up,
        )
        .histogram(
            "kairos_scheduler_fire_lateness_seconds",
            "Fire time (acknowledged by the work topic) minus run-at.",
            &self.shared.stats.fire_lateness,
        );
        m
    }

    fn status(&self) -> serde_json::Value {
        let parts: Vec<serde_json::Value> = partitions(self)
            .into_iter()
            .map(|(p, pending, behind)| json!({"partition": p, "pending": pending, "read_behind_ms": behind}))
            .collect();
        let late = self.shared.stats.fire_lateness.summary_ms();
        let fair = fair_status(&self.shared);
        json!({
            "role": "scheduler",
            "instance_id": self.shared.kafka.instance_id,
            "ready": self.ready(),
            "stats": stats(&self.shared),
            "partitions": parts,
            "pending_by_due": pending_by_due(self).into_iter().map(|(d, n)| (d.to_string(), json!(n))).collect::<serde_json::Map<_, _>>(),
            "due_timeline": due_timeline(self),
            "fire_lateness_ms": {"count": late.0, "p50_at_most": late.1, "p99_at_most": late.2},
            "features": {"fair_topics": self.shared.cfg.fair.topics, "hold_key": false},
            "fair": fair.tenants_waiting.iter().map(|(t, n)| {
                let backlog = FairStatus::of(&fair.backlog, t);
                (t.clone(), json!({"tenants_waiting": n, "backlog": backlog}))
            }).collect::<serde_json::Map<_, _>>(),
            "stopping": self.shared.signals.stop.is_cancelled(),
        })
    }

    /// Per work topic, jobs pending by when they come due (the spans of
    /// `pending_by_due`, exact: every job is read).
    fn pending_by_topic(&self) -> Result<serde_json::Value, String> {
        let shared = &self.shared;
        let now = shared.clock.now().timestamp_millis();
        let edges = due_edges(now);
        let mut total: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        for p in shared.jobs.partitions() {
            for (topic, counts) in shared
                .store
                .pending_by_topic(p, &edges)
                .map_err(|e| e.to_string())?
            {
                let t = total.entry(topic).or_insert_with(|| vec![0; DUE_SPANS.len()]);
                t.iter_mut().zip(counts).for_each(|(t, c)| *t += c);
            }
        }
        let topics: serde_json::Map<String, serde_json::Value> = total
            .into_iter()
            .map(|(topic, counts)| {
                let spans: serde_json::Map<String, serde_json::Value> = DUE_SPANS
                    .iter()
                    .map(|l| l.to_string())
                    .zip(counts.into_iter().map(|c| json!(c)))
                    .collect();
                (topic, serde_json::Value::Object(spans))
            })
            .collect();
        Ok(serde_json::Value::Object(topics))
    }

    fn page(&self) -> Option<Page> {
        Some(DASHBOARD)
    }

    /// The first 500 recurring schedules of the partitions running here.
    fn schedules(&self) -> Result<serde_json::Value, String> {
        super::recurring::view(&self.shared, 500)
    }

    /// The newest 200 dead letters (read from the partitions' ends, their
    /// payloads dropped), and how many there are.
    fn dead_letters(&self) -> Result<serde_json::Value, String> {
        let cfg = &self.shared.cfg;
        let newest = crate::dlq::newest(cfg, 200).map_err(|e| e.to_string())?;
        Ok(json!({
            "total": newest.total,
            "read": newest.read,
            "topic": cfg.topics.dead_letter,
            "entries": newest.entries,
        }))
    }

    /// Replay the dead jobs written since the last replay (as `kairos dlq
    /// replay`), from the blocking pool.
    fn replay_dead_letters(&self) -> Result<serde_json::Value, String> {
        let cfg = self.shared.cfg.clone();
        let report = tokio::runtime::Handle::current()
            .block_on(crate::dlq::replay(
                &cfg,
                &crate::dlq::Filter::default(),
                false,
                |_, _| {},
            ))
            .map_err(|e| e.to_string())?;
        serde_json::to_value(report).map_err(|e| e.to_string())
    }

    /// A pending job of an owned partition, as stored.
    fn job(&self, id: &str) -> Result<Option<serde_json::Value>, String> {
        let id: JobId = id.parse().map_err(|e| format!("{e}"))?;
        let shared = &self.shared;
        for p in shared.jobs.partitions() {
            let found = shared.store.current(p, &id).map_err(|e| e.to_string())?;
            if let Some(s) = found {
                let j = &s.job;
                return Ok(Some(json!({
                    "id": j.id.to_string(),
                    "schedule_partition": p,
                    "schedule_offset": s.seq,
                    "run_at": crate::wire::format_time(j.run_at),
                    "topic": j.topic,
                    "key": j.key_lossy(),
                    "tenant": j.tenant,
                    "attempt": j.attempt,
                    "max_attempts": j.max_attempts,
                    "payload_bytes": j.payload.len(),
                })));
            }
        }
        Ok(None)
    }

    /// Ready once it owns a partition (a partition is owned only after its
    /// store has caught up with the changelog) and is not stopping.
    fn ready(&self) -> bool {
        !self.shared.signals.stop.is_cancelled()
            && !self.shared.jobs.partitions().is_empty()
            && self
                .shared
                .signals
                .fatal
                .lock()
                .map(|f| f.is_none())
                .unwrap_or(false)
    }
}
