//! Partition moves: the consumer context's rebalance callbacks (a revoked
//! partition is drained, see [`super::draining`]; an assigned one catches up
//! with its changelog first) and where reading starts.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tracing::{info, warn};

use super::draining::Draining;
use super::upkeep::cascade_until;
use super::{SchedulerError, Shared};

use crate::kafka;
use crate::scheduler::changelog;

/// The consumer context: the rebalance callbacks.
pub(super) struct SchedulerContext {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for SchedulerContext {}

impl ConsumerContext for SchedulerContext {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        kafka::log_commit("scheduler", &result, offsets);
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Revoke(tpl) = rebalance else { return };
        let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
        // The rebalance may have moved the group to a new generation
        // already (cooperative assignment revokes after joining it): the
        // transactions that finish the partitions' work commit with it.
        // Ingest, which otherwise keeps it current, waits for this callback.
        // A lost assignment (the session expired) may be another member's
        // already: nothing more commits for it.
        if let Some(t) = &self.shared.kafka.txn {
            match consumer.assignment_lost() {
                true => {
                    warn!(partitions = ?parts, "schedule partitions lost with the group session; their work in flight is not committed");
                    t.lost(&parts);
                }
                false => t.set_group(consumer.group_metadata()),
            }
        }
        self.shared.schedules.revoke(&parts);
        Draining::revoke(&self.shared, parts, consumer);
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
                let started = Instant::now();
                self.shared.reads.owned.assign(&parts);
                let stale = stale_partitions(&self.shared, &parts);
                // Place the cascade points before the rebuild, so that the
                // replayed jobs land at their final level at once.
                let cascade_to = cascade_until(&self.shared);
                for p in &parts {
                    if let Err(e) = self.shared.store.cascade(*p, cascade_to) {
                        self.shared.fail(format!("preparing partition {p}: {e}"));
                        return;
                    }
                }
                let read = match changelog::catch_up(
                    &self.shared.kafka.reader_config,
                    &self.shared.cfg.topics.changelog,
                    &parts,
                    &self.shared.store,
                    cascade_to,
                    &stale,
                    self.shared.cfg.scheduler.rebuild_timeout,
                ) {
                    Ok(read) => read,
                    Err(e) => {
                        self.shared.fail(format!("rebuilding partitions {parts:?}: {e}"));
                        return;
                    }
                };
                self.shared.stats.catch_up.observe(started.elapsed());
                self.shared.stats.assigned.fetch_add(1, Ordering::Relaxed);
                info!(partitions = ?parts, elapsed = ?started.elapsed(), "schedule partitions caught up");
                let starts = match reading_from(&self.shared, consumer, &parts) {
                    Ok(starts) => starts,
                    Err(e) => {
                        self.shared
                            .fail(format!("reading committed offsets of {parts:?}: {e}"));
                        return;
                    }
                };
                for (p, (next, skip_below)) in parts.iter().zip(starts) {
                    // Jobs fire only once the partition is read up to their run-at.
                    self.shared.reads.caught_up().assign(*p, next, skip_below);
                    let records = read.get(p).copied().unwrap_or(0);
                    self.shared.stats.replayed.fetch_add(records, Ordering::Relaxed);
                    let pending = self.shared.store.checkpoint(*p).map(|c| c.pending).unwrap_or(0);
                    info!(
                        partition = p,
                        changelog_records = records,
                        pending,
                        reading_from = next.max(skip_below),
                        handled_below = skip_below,
                        "schedule partition assigned"
                    );
                    if let Some(t) = &self.shared.kafka.txn {
                        t.assigned(*p, next.max(skip_below));
                    }
                    self.shared.jobs.assign(*p);
                }
                if let Some(t) = &self.shared.kafka.txn {
                    t.set_group(consumer.group_metadata());
                }
                self.shared.schedules.assign(&parts);
                self.shared.signals.wake.notify_one();
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

/// For each of `parts` (just assigned), where ingest starts reading and
/// below which records were handled before: the committed offset (or where
/// `auto.offset.reset` starts, when none is) and the store's checkpoint,
/// whichever is further.
pub(super) fn reading_from(
    shared: &Shared,
    consumer: &BaseConsumer<SchedulerContext>,
    parts: &[i32],
) -> Result<Vec<(i64, i64)>, SchedulerError> {
    let topic = &shared.cfg.topics.schedule;
    let timeout = shared.cfg.kafka.produce_timeout;
    let deadline = Instant::now() + shared.cfg.scheduler.rebuild_timeout;
    let mut tpl = TopicPartitionList::new();
    for p in parts {
        tpl.add_partition(topic, *p);
    }
    let committed = kafka::retry_until("committed offsets", deadline, || {
        consumer.committed_offsets(tpl.clone(), timeout)
    })?;
    // Kairos's default is "earliest"; a user may choose the end.
    let resets_to_end = shared
        .cfg
        .kafka
        .consumer
        .get("auto.offset.reset")
        .is_some_and(|v| matches!(v.0.as_str(), "latest" | "end" | "largest"));
    parts
        .iter()
        .map(|p| {
            let handled = shared.store.checkpoint(*p)?.schedule_next;
            let from = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                // Nothing committed: where `auto.offset.reset` starts.
                _ => {
                    let (low, high) = kafka::retry_until("schedule watermarks", deadline, || {
                        consumer.fetch_watermarks(topic, *p, timeout)
                    })?;
                    if resets_to_end {
                        high
                    } else {
                        low
                    }
                }
            };
            Ok((from.max(handled), handled))
        })
        .collect()
}

/// The partitions among `parts` whose store copy was last written longer
/// ago than the changelog keeps tombstones (see
/// [`changelog::away_too_long`]). Read before the cascade that precedes the
/// catch-up, which writes the checkpoint anew. Asks the broker for the
/// changelog's retention only when a copy is over a minute old.
fn stale_partitions(shared: &Shared, parts: &[i32]) -> Vec<i32> {
    let now = shared.clock.now().timestamp_millis();
    let written: Vec<(i32, i64)> = parts
        .iter()
        .filter_map(|p| shared.store.checkpoint(*p).ok().map(|c| (*p, c.written_ms)))
        .collect();
    if !written.iter().any(|(_, w)| *w > 0 && now - w > 60_000) {
        return Vec::new();
    }
    let topic = &shared.cfg.topics.changelog;
    let retention = changelog::tombstone_retention(&shared.cfg, topic)
        .unwrap_or_else(crate::topics::changelog_tombstone_retention);
    written
        .into_iter()
        .filter(|(_, w)| changelog::away_too_long(*w, now, retention))
        .map(|(p, _)| p)
        .collect()
}
