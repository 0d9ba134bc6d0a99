//! Ingest, the read side: schedule records from the consumer into batches
//! for the apply thread.
//!
//! Reading never waits for a batch to be persisted: the read thread
//! (`kairos-ingest`, the consumer's thread, where the rebalance callbacks
//! run) polls a batch, decodes it, skips records handled before,
//! dead-letters malformed ones and claims the jobs the batch names (a job
//! being fired makes a cancel or reschedule of it too late; any other is
//! held in the window until the batch is applied). The batch's partitions
//! then count as read this far (see
//! [`CaughtUp`](crate::scheduler::caught_up::CaughtUp)), and it goes through
//! [`Lanes`](super::lanes::Lanes) to the apply thread of its partitions
//! ([`apply`](super::apply)), which persists it and only then lets its
//! offsets be committed (this thread hands them to the consumer).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Message, Offset};
use tracing::{debug, error, info, warn};

use super::apply::apply_loop;
use super::batch::{ReadBatch, Record, BATCH_BYTES};
use super::{fair_status, stats, SchedulerContext, SchedulerError, Shared};

use crate::hash::HashMap;
use crate::sync::Lock;
use crate::wire::{Context, DeadLetter, RecordView};
use crate::{kafka, wire};

/// A consumer error is logged; a fatal one (librdkafka gave up on the
/// client) ends the read loop.
fn consumer_error(consumer: &BaseConsumer<SchedulerContext>, e: &KafkaError) -> Result<(), Ended> {
    failed_for_good(consumer)?;
    warn!(error = %e, "schedule topic consumer");
    Ok(())
}

/// Whether librdkafka gave up on the consumer (its fatal error is not
/// always handed out by a poll: it is asked for whenever a poll is idle).
fn failed_for_good(consumer: &BaseConsumer<SchedulerContext>) -> Result<(), Ended> {
    match consumer.client().fatal_error() {
        None => Ok(()),
        Some((code, reason)) => {
            let reason = format!("{code:?}: {reason}");
            Err(match code {
                RDKafkaErrorCode::FencedInstanceId => Ended::Fenced(reason),
                RDKafkaErrorCode::UnreleasedInstanceId => Ended::Unreleased(reason),
                _ => Ended::Failed(fatal(&reason)),
            })
        }
    }
}

pub(super) fn ingest_loop(shared: &Arc<Shared>) -> Result<(), SchedulerError> {
    let appliers = (0..shared.reads.lanes.len())
        .map(|lane| {
            let apply_shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("kairos-lane-{lane}"))
                .spawn(move || apply_loop(&apply_shared, lane))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
    let mut fences = Fences::default();
    let mut unreleased = 0u32;
    let ended = loop {
        let consumer = match subscribed(shared) {
            Ok(c) => c,
            Err(e) => break Err(e),
        };
        match read_loop(shared, &consumer) {
            Ok(()) => break Ok(Some(consumer)),
            Err(Ended::Fenced(reason)) => {
                // The group fenced this member out: after a session timeout
                // (a broker that stalled or restarted) the member rejoined
                // as itself and a request of its old membership was refused.
                // librdkafka gives up on such a client for good; a new one
                // under the same instance id takes the partitions back.
                let wait = fences.next();
                if wait.is_zero() {
                    warn!(reason = %reason, "fenced out of the schedule topic's group; joining again with a new consumer");
                } else {
                    error!(reason = %reason, wait = ?wait, hint = TWIN_HINT,
                        "fenced out of the schedule topic's group again soon; joining again after a pause");
                }
                if out_of_the_group(shared, consumer, wait) {
                    break Ok(None);
                }
            }
            Err(Ended::Unreleased(reason)) => {
                // Under the consumer protocol (KIP-848) the broker keeps an
                // instance id for the member that had it until its session
                // expires: after a kill -9, this instance's own previous
                // process. Ask again each second.
                if unreleased == 0 {
                    warn!(reason = %reason, hint = TWIN_HINT,
                        "the instance id is still held by this instance's previous session (a process that ended \
                         without leaving the group); joining again each second until the broker lets it go, after \
                         the group's session timeout");
                } else {
                    debug!(reason = %reason, tries = unreleased, "instance id still held; joining again");
                }
                unreleased += 1;
                if out_of_the_group(shared, consumer, Duration::from_secs(1)) {
                    break Ok(None);
                }
            }
            Err(Ended::Failed(e)) => break Err(e),
        }
    };
    // The batches read are applied before the last commit.
    shared.reads.lanes.close();
    for applier in appliers {
        applier
            .join()
            .map_err(|_| SchedulerError::Fatal("apply thread panicked".into()))?;
    }
    let Some(consumer) = ended? else {
        return Ok(());
    };
    shared.store_offsets(&consumer);
    shared.commit_stored(&consumer, "at the end");
    consumer.unsubscribe();
    // Serve the revocation callback so the group moves our partitions now.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !consumer.assignment().map(|a| a.count() == 0).unwrap_or(true) && Instant::now() < deadline {
        consumer.poll(Duration::from_millis(50));
    }
    Ok(())
}

/// Let go of what `consumer` owned and drop it, then wait `wait` before
/// joining again; true if the scheduler was stopped meanwhile (the
/// partitions are let go already, and there is no consumer left to commit
/// with).
fn out_of_the_group(shared: &Arc<Shared>, consumer: BaseConsumer<SchedulerContext>, wait: Duration) -> bool {
    let owned: Vec<i32> = shared.reads.owned.read().iter().copied().collect();
    if !owned.is_empty() {
        super::draining::Draining::revoke(shared, owned, &consumer);
    }
    drop(consumer);
    let until = Instant::now() + wait;
    while Instant::now() < until && !shared.signals.stop.is_cancelled() {
        std::thread::sleep(Duration::from_millis(100).min(until.saturating_duration_since(Instant::now())));
    }
    shared.signals.stop.is_cancelled()
}

/// Fences of this member: the first joins again at once; each one soon
/// after the last (a broker still unsettled, or a twin: another process
/// with this instance id) waits twice as long, up to 30 s.
#[derive(Default)]
struct Fences {
    last: Option<Instant>,
    wait: Duration,
}

impl Fences {
    /// How long to wait before joining again after a fence now.
    fn next(&mut self) -> Duration {
        let soon = self.last.is_some_and(|t| t.elapsed() < Duration::from_secs(60));
        self.wait = if soon {
            (self.wait * 2).clamp(Duration::from_secs(1), Duration::from_secs(30))
        } else {
            Duration::ZERO
        };
        self.last = Some(Instant::now());
        self.wait
    }
}

/// The schedule topic's consumer, subscribed.
fn subscribed(shared: &Arc<Shared>) -> Result<BaseConsumer<SchedulerContext>, SchedulerError> {
    let cfg = &shared.cfg;
    let member = kafka::Membership {
        group: &cfg.scheduler.group_id,
        session_timeout: cfg.scheduler.session_timeout,
        instance_id: shared.kafka.instance_id.clone(),
        // What a crash re-reads is what was stored since the last commit.
        // In exactly-once mode only transactions commit (a plain commit
        // racing one could move the offset back below fired jobs).
        auto_commit_every: shared.kafka.txn.is_none().then_some(Duration::from_millis(100)),
    };
    let consumer: BaseConsumer<SchedulerContext> = kafka::consumer(
        &cfg.kafka,
        &member,
        "kairos-scheduler",
        SchedulerContext {
            shared: shared.clone(),
        },
    )?;
    consumer.subscribe(&[&cfg.topics.schedule])?;
    Ok(consumer)
}

/// Why [`read_loop`] ended before the scheduler stopped.
enum Ended {
    /// librdkafka gave up on the consumer: the group fenced it out.
    Fenced(String),
    /// librdkafka gave up on the consumer: the broker refused its instance
    /// id, still held by the member that had it before (consumer protocol).
    Unreleased(String),
    /// Any other failure.
    Failed(SchedulerError),
}

/// What a fence may mean, for the logs and the error.
const TWIN_HINT: &str =
    "if another instance runs with this instance's id, give each its own data_dir or instance_id";

fn fatal(reason: &str) -> SchedulerError {
    SchedulerError::Fatal(format!(
        "the schedule topic consumer failed for good ({reason}); {TWIN_HINT}"
    ))
}

/// Read batches and hand them to the apply threads until the scheduler stops
/// or the consumer fails for good.
fn read_loop(shared: &Arc<Shared>, consumer: &BaseConsumer<SchedulerContext>) -> Result<(), Ended> {
    let cfg = &shared.cfg;
    // Most records read and waiting to be applied: beyond it reading waits.
    let most = 2 * cfg.scheduler.ingest_batch.max(1);
    let mut last_report = Instant::now();
    let mut last_lag = Instant::now();
    let mut last_position = Instant::now();
    // Kept from batch to batch: growing it anew each time showed in profiles.
    let mut msgs: Vec<BorrowedMessage<'_>> = Vec::with_capacity(cfg.scheduler.ingest_batch);
    while !shared.signals.stop.is_cancelled() {
        match consumer.poll(Duration::from_millis(100)) {
            None => failed_for_good(consumer)?,
            Some(Err(e)) => consumer_error(consumer, &e)?,
            Some(Ok(m)) => msgs.push(m),
        }
        // At most the one record just polled (each batch is taken below).
        let mut bytes: usize = msgs.iter().map(record_bytes).sum();
        while !msgs.is_empty() && msgs.len() < cfg.scheduler.ingest_batch && bytes < BATCH_BYTES {
            match consumer.poll(Duration::ZERO) {
                Some(Ok(m)) => {
                    bytes += record_bytes(&m);
                    msgs.push(m);
                }
                Some(Err(e)) => {
                    consumer_error(consumer, &e)?;
                    break;
                }
                None => break,
            }
        }
        if !msgs.is_empty() {
            if shared.signals.stop.is_cancelled() {
                break; // do not half-process a batch on the way out
            }
            let batches = read_batch(shared, &msgs);
            msgs.clear();
            shared.reads.lanes.push(batches, most);
        }
        // Every record handed over is claimed by now.
        if last_position.elapsed() >= POSITION_EVERY {
            last_position = Instant::now();
            read_to_position(shared, consumer);
            // The group generation the next transactions commit offsets in
            // (a rebalance that only took partitions away moves it too).
            // librdkafka marks the assignment lost (the session expired)
            // before it forgets the member and the generation, and before the
            // rebalance callback tells the fence: metadata taken before the
            // mark is still the membership's; after it, it may name no
            // member, which the broker does not check for a member without
            // an instance id.
            if let Some(t) = &shared.kafka.txn {
                let group = consumer.group_metadata();
                if !consumer.assignment_lost() {
                    t.refresh_group(group);
                }
            }
        }
        // Batches applied and direct jobs fired meanwhile may let offsets move.
        shared.store_offsets(consumer);
        if last_lag.elapsed() >= LAG_EVERY {
            last_lag = Instant::now();
            measure_lag(shared, consumer);
        }
        if last_report.elapsed() >= cfg.scheduler.report_interval {
            last_report = Instant::now();
            report(shared, consumer);
        }
    }
    Ok(())
}

/// How often ingest counts its partitions as read up to the consumer's
/// position ([`read_to_position`]).
const POSITION_EVERY: Duration = Duration::from_millis(100);

/// Every owned partition counts as read up to the consumer's position: the
/// records handed over below it (all claimed when this is called), and what
/// is never handed over, the markers that end Kafka transactions (a
/// transactional producer's commit marker is often a partition's last
/// offset) and the records of aborted ones. Called every
/// [`POSITION_EVERY`], whether or not other partitions are busy.
fn read_to_position(shared: &Shared, consumer: &BaseConsumer<SchedulerContext>) {
    let Ok(pos) = consumer.position() else {
        return;
    };
    let moved = {
        let mut gate = shared.reads.caught_up();
        pos.elements().iter().fold(false, |moved, e| match e.offset() {
            Offset::Offset(next) => gate.ingested(e.partition(), next, None) || moved,
            _ => moved,
        })
    };
    if moved {
        shared.signals.wake.notify_one();
    }
}

fn record_bytes(m: &BorrowedMessage<'_>) -> usize {
    m.payload_len() + m.key_len()
}

/// How often the ingest thread measures the schedule topic's lag.
const LAG_EVERY: Duration = Duration::from_secs(5);

/// Per owned partition, records not yet read: the broker's end offset less
/// the consumer's position (one request per partition).
fn measure_lag(shared: &Shared, consumer: &BaseConsumer<SchedulerContext>) {
    let mut lag = HashMap::default();
    if let Ok(pos) = consumer.position() {
        for e in pos.elements() {
            if let (Ok((_, high)), Some(at)) = (
                consumer.fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(1)),
                e.offset().to_raw(),
            ) {
                if at >= 0 {
                    lag.insert(e.partition(), (high - at).max(0));
                }
            }
        }
    }
    *shared.stats.schedule_lag.locked() = lag;
}

fn report(shared: &Shared, consumer: &BaseConsumer<SchedulerContext>) {
    let st = stats(shared);
    let direct = shared.jobs.direct_in_flight();
    measure_lag(shared, consumer);
    let lag: i64 = shared.stats.schedule_lag.locked().values().sum();
    info!(owned = ?st.owned, pending = st.pending, in_memory = st.in_memory, direct, ingested = st.ingested,
        fired = st.fired, skipped = st.skipped, dead_lettered = st.dead_lettered, lag, "scheduler status");
    if !shared.cfg.fair.topics.is_empty() {
        let f = fair_status(shared);
        info!(backlog = ?f.backlog, target = ?f.target, released = ?f.released, buffered = f.buffered,
            tenants_waiting = ?f.tenants_waiting, "fair dispatch status");
    }
}

/// Read a batch: decode it, skip the records handled before (read again
/// after a crash, their offsets not committed: their jobs may have fired),
/// and claim the jobs it names. From then on no job the batch changes can
/// fire unchanged, so the partitions count as read this far and jobs due up
/// to here may fire, without waiting for the batch to be persisted. Returns
/// one batch per apply lane (see [`Lanes`](super::lanes::Lanes)).
pub(super) fn read_batch(shared: &Shared, msgs: &[BorrowedMessage<'_>]) -> Vec<ReadBatch> {
    let cfg = &shared.cfg;
    let lanes = &shared.reads.lanes;
    let mut out: Vec<ReadBatch> = (0..lanes.len())
        .map(|_| ReadBatch {
            records: Vec::with_capacity(msgs.len() / lanes.len() + 1),
            ..ReadBatch::default()
        })
        .collect();
    let mut created: HashMap<i32, i64> = HashMap::default();
    // Copied, so that decoding does not hold the lock the dispatcher reads.
    let handled_below = shared.reads.caught_up().handled_below();
    for m in msgs {
        let (p, offset) = (m.partition(), m.offset());
        let b = &mut out[lanes.of(p)];
        b.read += 1;
        b.bytes += record_bytes(m);
        let last = b.last.entry(p).or_insert(offset);
        *last = (*last).max(offset);
        // Only a time the broker set counts: a producer's CreateTime can be
        // anything (one record stamped an hour ahead would let due jobs
        // fire before cancels written before their run-at).
        if let rdkafka::Timestamp::LogAppendTime(t) = m.timestamp() {
            let c = created.entry(p).or_insert(t);
            *c = (*c).max(t);
        }
        if handled_below.get(&p).is_some_and(|h| offset < *h) {
            debug!(partition = p, offset, "handled before; skipped");
            shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let view = RecordView::from_message(m);
        match wire::decode(&view, Context::Schedule, &cfg.limits) {
            Ok(command) => b.records.push(Record {
                partition: p,
                offset,
                command,
            }),
            Err(e) => {
                warn!(partition = p, offset, reason = %e, "schedule record dead-lettered");
                let d = DeadLetter {
                    reason: e.to_string(),
                    origin_topic: m.topic().to_string(),
                    origin_partition: p,
                    origin_offset: offset,
                };
                // On the partition's lane: written before its offset may be
                // committed.
                b.dead.push(wire::dead_letter_record(
                    &view,
                    &d,
                    &cfg.topics.dead_letter,
                    &cfg.limits,
                ));
            }
        }
    }
    shared.jobs.claim(&mut out);
    let moved = {
        let mut gate = shared.reads.caught_up();
        out.iter().flat_map(|b| &b.last).fold(false, |moved, (p, last)| {
            gate.ingested(*p, last + 1, created.get(p).copied()) || moved
        })
    };
    if moved {
        shared.signals.wake.notify_one();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_fence_joins_again_at_once_and_repeated_ones_back_off_up_to_30_s() {
        let mut f = Fences::default();
        let waits: Vec<u64> = (0..8).map(|_| f.next().as_secs()).collect();
        assert_eq!(waits, [0, 1, 2, 4, 8, 16, 30, 30]);
    }
}
