//! The scheduler's changelog: a compacted topic keyed by job id, partition N
//! mirroring schedule partition N. A pending job is a record whose value is
//! its [`StoredJob`] bytes; a fired or cancelled job is a tombstone (null
//! value). Replaying a partition's changelog from the start (or from a
//! store's checkpoint) rebuilds its pending jobs.
//!
//! One more key per partition, [`SCHEDULE_NEXT_KEY`], holds how far the
//! schedule partition has been handled (see
//! [`Checkpoint::schedule_next`](crate::scheduler::store::Checkpoint)), so
//! that a new owner does not act again on records whose jobs already fired.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};
use tracing::{debug, info, warn};

use crate::job::JobId;
use crate::scheduler::store::{Change, PartitionWrite, Store};
use crate::scheduler::stored::StoredJob;
use crate::wire::OwnedRecord;

/// The changelog record for a pending job.
pub fn put_record(topic: &str, job: &StoredJob) -> OwnedRecord {
    OwnedRecord {
        topic: topic.to_string(),
        key: job.job.stored_id().as_bytes().to_vec(),
        value: Some(job.encode()),
        headers: Vec::new(),
    }
}

/// The changelog tombstone for a job that fired or was cancelled.
pub fn tombstone(topic: &str, id: &JobId) -> OwnedRecord {
    OwnedRecord {
        topic: topic.to_string(),
        key: id.as_bytes().to_vec(),
        value: None,
        headers: Vec::new(),
    }
}

/// The changelog key of a partition's schedule frontier (not 16 bytes
/// long, so it is never a job id).
pub const SCHEDULE_NEXT_KEY: &[u8] = b"kairos:schedule-next";

/// The record saying that every schedule record of its partition before
/// offset `next` has been handled.
pub fn schedule_next_record(topic: &str, next: i64) -> OwnedRecord {
    OwnedRecord {
        topic: topic.to_string(),
        key: SCHEDULE_NEXT_KEY.to_vec(),
        value: Some(next.to_be_bytes().to_vec()),
        headers: Vec::new(),
    }
}

/// How far each partition's changelog was written: records were sent to
/// `partitions` (in this order) and `acks` are their acknowledgements (each
/// the record's offset, in the same order). Returns, per partition, the
/// offset after its last acknowledged record, and the failed writes with
/// their index. Each acknowledgement counts for the partition its record
/// was sent to, never for another.
pub fn written_up_to<E>(
    partitions: &[i32],
    acks: impl IntoIterator<Item = Result<i64, E>>,
) -> (HashMap<i32, i64>, Vec<(usize, E)>) {
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut failed = Vec::new();
    let mut acks = acks.into_iter();
    for (i, p) in partitions.iter().enumerate() {
        match acks.next() {
            Some(Ok(offset)) => {
                let e = next.entry(*p).or_insert(0);
                *e = (*e).max(offset + 1);
            }
            Some(Err(e)) => failed.push((i, e)),
            None => break,
        }
    }
    (next, failed)
}

/// Why a rebuild failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RebuildError {
    /// Reading the changelog failed.
    #[error("reading changelog partition {partition}: {source}")]
    Kafka {
        /// The partition.
        partition: i32,
        /// The error.
        source: KafkaError,
    },
    /// Writing the store failed.
    #[error(transparent)]
    Store(#[from] crate::scheduler::store::StoreError),
    /// The changelog did not reach its end in time.
    #[error("changelog partition {partition} not read to offset {end} within {timeout:?} (at {at})")]
    Timeout {
        /// The partition.
        partition: i32,
        /// Where reading stood.
        at: i64,
        /// The end it had to reach.
        end: i64,
        /// The limit.
        timeout: Duration,
    },
}

/// Bring `store`'s copy of each of `partitions` up to the end of the
/// changelog, each from the store's checkpoint, reading committed records
/// only and waiting out any transaction open at the start. Returns the
/// number of job records read per partition.
///
/// When the changelog's start has moved past the checkpoint (records were
/// deleted: retention on a `compact,delete` changelog, or DeleteRecords),
/// or the partition is among `stale` (its store was away longer than the
/// changelog keeps tombstones: see [`away_too_long`]), the store's copy
/// cannot be trusted: a job that fired or was cancelled elsewhere
/// meanwhile would come back. The partition is then cleared, its cascade
/// point placed again at `cascade_to`, and read from the changelog's start.
///
/// `client` holds the connection settings (bootstrap servers, TLS, SASL); one
/// private consumer with no group reads every partition at once.
pub fn catch_up(
    client: &ClientConfig,
    topic: &str,
    partitions: &[i32],
    store: &Store,
    cascade_to: i64,
    stale: &[i32],
    timeout: Duration,
) -> Result<HashMap<i32, u64>, RebuildError> {
    let kafka = |partition, source| RebuildError::Kafka { partition, source };
    let first = partitions.first().copied().unwrap_or(0);
    let mut cfg = client.clone();
    // An offset gone meanwhile (the log start moved past it) restarts at
    // the new start, never at the end (librdkafka's default), which would
    // skip every record left.
    cfg.set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.offset.store", "false")
        .set("group.id", "kairos-changelog-reader")
        .set("enable.partition.eof", "false")
        .set("isolation.level", "read_committed");
    let consumer: BaseConsumer = cfg.create().map_err(|e| kafka(first, e))?;
    // The end to reach is the log's end, transactions still open included
    // (a read_committed client is told the last stable offset instead):
    // a partition's previous owner may be committing a round of fires and
    // their tombstones right now, and an owner that stopped reading before
    // them would fire those jobs again. Reading on waits the transaction
    // out (committed, aborted, or timed out by the broker).
    let ends: BaseConsumer = cfg
        .clone()
        .set("isolation.level", "read_uncommitted")
        .create()
        .map_err(|e| kafka(first, e))?;
    let mut read: HashMap<i32, u64> = partitions.iter().map(|p| (*p, 0)).collect();
    // Per partition still to read: (next offset, end).
    let mut todo: HashMap<i32, (i64, i64)> = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    let deadline = Instant::now() + timeout;
    let ask = timeout.min(Duration::from_secs(10));
    for &p in partitions {
        let (low, high) = crate::kafka::retry_until("changelog watermarks", deadline, || {
            ends.fetch_watermarks(topic, p, ask)
        })
        .map_err(|e| kafka(p, e))?;
        let mut checkpoint = store.checkpoint(p)?.changelog_next;
        // 0: the store never applied a changelog record of `p` (whatever
        // it holds came with one), so it has nothing to distrust.
        if checkpoint > high {
            // The broker acknowledged records up to the checkpoint to this
            // store, so it lost acknowledged records since (outside what
            // Kairos promises: acks=all on a broker that keeps them). The
            // store is the better copy: kept as it is, and said.
            warn!(
                partition = p,
                checkpoint,
                end = high,
                "the changelog ends before this store's checkpoint"
            );
        }
        if checkpoint > 0 && (checkpoint < low || stale.contains(&p)) {
            let why = if checkpoint < low {
                "the changelog's records after this store's checkpoint were deleted"
            } else {
                "this store was away longer than the changelog keeps tombstones"
            };
            forget(store, p, cascade_to, why)?;
            checkpoint = 0;
        }
        let start = checkpoint.max(low);
        if start >= high {
            store.apply(p, &[], Some(high))?;
            debug!(partition = p, high, "changelog: nothing to catch up");
            continue;
        }
        tpl.add_partition_offset(topic, p, Offset::Offset(start))
            .map_err(|e| kafka(p, e))?;
        todo.insert(p, (start, high));
    }
    drop(ends);
    if todo.is_empty() {
        return Ok(read);
    }
    consumer.assign(&tpl).map_err(|e| kafka(first, e))?;
    let started: HashMap<i32, i64> = todo.iter().map(|(p, (at, _))| (*p, *at)).collect();
    let mut parts: HashMap<i32, Replayed> = HashMap::new();
    while let Some((&p, &(at, end))) = todo.iter().find(|(_, (at, end))| at < end) {
        if Instant::now() > deadline {
            return Err(RebuildError::Timeout {
                partition: p,
                at,
                end,
                timeout,
            });
        }
        let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
            // Nothing handed over: the position may have moved past what
            // never is (the markers ending Kafka transactions, the records
            // of aborted ones); every record below it was handled.
            if let Ok(pos) = consumer.position() {
                for e in pos.elements() {
                    if let (Some((at, _)), Offset::Offset(next)) = (todo.get_mut(&e.partition()), e.offset())
                    {
                        *at = (*at).max(next);
                    }
                }
            }
            continue;
        };
        let msg = match msg {
            Ok(m) => m,
            // A broker lost meanwhile: librdkafka reads on from the
            // partition's next leader; the deadline bounds the wait.
            Err(e) if crate::kafka::transient(&e) => {
                debug!(partition = p, error = %e, "changelog catch-up");
                continue;
            }
            Err(e) => return Err(kafka(p, e)),
        };
        let p = msg.partition();
        let Some((at, _)) = todo.get_mut(&p) else {
            continue; // not assigned here
        };
        *at = msg.offset() + 1;
        let next = *at;
        let part = parts.entry(p).or_default();
        if msg.key() == Some(SCHEDULE_NEXT_KEY) {
            if let Some(v) = msg.payload().and_then(|v| <[u8; 8]>::try_from(v).ok()) {
                part.schedule_next = part.schedule_next.max(i64::from_be_bytes(v));
            }
            continue;
        }
        let Some(key) = msg.key().and_then(|k| <[u8; 16]>::try_from(k).ok()) else {
            continue; // not ours; a changelog only holds 16-byte job ids
        };
        *read.entry(p).or_default() += 1;
        let id = JobId::from_bytes(key);
        match msg.payload() {
            None => part.changes.push(Change::Delete(id)),
            Some(v) => match StoredJob::decode(v) {
                Ok(s) if s.job.stored_id() == id => part.changes.push(Change::Put(s)),
                // A value that does not decode was not written by this
                // version; dropping it would lose a job, so stop loudly.
                Ok(_) | Err(_) => {
                    return Err(RebuildError::Store(crate::scheduler::store::StoreError::Corrupt(
                        crate::scheduler::stored::CorruptJob("changelog record does not decode"),
                    )))
                }
            },
        }
        if part.changes.len() >= 1000 {
            part.apply(store, p, next)?;
        }
    }
    for (p, (at, _)) in todo {
        parts.entry(p).or_default().apply(store, p, at)?;
        info!(
            partition = p,
            from = started[&p],
            to = at,
            records = read[&p],
            "changelog: caught up"
        );
    }
    Ok(read)
}

/// How long the changelog keeps a tombstone after compaction (its
/// `delete.retention.ms`), as the broker says; `None` if it cannot say.
/// Blocks (called on the poll thread, in the assignment callback).
pub fn tombstone_retention(cfg: &crate::config::Config, topic: &str) -> Option<Duration> {
    let ms = futures::executor::block_on(crate::topics::setting(cfg, topic, "delete.retention.ms"))?;
    Some(Duration::from_millis(ms.parse().ok()?))
}

/// Whether a store whose checkpoint of a partition was last written at
/// `written_ms` may have missed tombstones by `now_ms`: the changelog keeps
/// a tombstone at least `retention` after it was written, so a store away
/// for less than that (with half of it to spare for clock differences and
/// compaction timing) has missed none. `written_ms` 0: unknown, trusted.
pub fn away_too_long(written_ms: i64, now_ms: i64, retention: Duration) -> bool {
    written_ms > 0 && now_ms.saturating_sub(written_ms) > (retention.as_millis() / 2) as i64
}

/// Drop the store's copy of `partition` (its records from `checkpoint` on
/// are gone from the changelog, tombstones perhaps among them, so a job
/// that fired or was cancelled elsewhere could come back) and place its
/// cascade point again, before a rebuild from the changelog's start.
fn forget(store: &Store, partition: i32, cascade_to: i64, why: &str) -> Result<(), RebuildError> {
    warn!(
        partition,
        reason = why,
        "rebuilding the partition from the changelog instead of trusting this store's copy"
    );
    // How far the schedule partition was handled stays true: records read
    // again below it must still be skipped.
    let handled = store.checkpoint(partition)?.schedule_next;
    store.clear_partition(partition)?;
    store.cascade(partition, cascade_to)?;
    store.apply_all(&[PartitionWrite {
        schedule_next: Some(handled),
        ..PartitionWrite::new(partition, &[])
    }])?;
    Ok(())
}

/// What a partition's changelog records read so far do, not yet applied.
#[derive(Default)]
struct Replayed {
    changes: Vec<Change>,
    schedule_next: i64,
}

impl Replayed {
    /// Apply to the store, up to changelog offset `next`.
    fn apply(&mut self, store: &Store, partition: i32, next: i64) -> Result<(), RebuildError> {
        let changes = std::mem::take(&mut self.changes);
        store.apply_all(&[PartitionWrite {
            changelog_next: Some(next),
            schedule_next: Some(self.schedule_next),
            ..PartitionWrite::new(partition, &changes)
        }])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_acknowledgement_counts_for_its_own_partition() {
        // Partition 0 wrote 10 and 11, partition 1 wrote 5 and failed one,
        // partition 2 wrote 700: no partition's end takes another's offset
        // (a skew here once set a store's checkpoint past records it had
        // never applied, and a catch-up from there skipped them).
        let parts = [0, 0, 1, 1, 2];
        let acks = vec![Ok(10), Ok(11), Ok(5), Err("timed out"), Ok(700)];
        let (next, failed) = written_up_to(&parts, acks);
        assert_eq!(next, HashMap::from([(0, 12), (1, 6), (2, 701)]));
        assert_eq!(failed, vec![(3, "timed out")]);
        let (next, failed) = written_up_to::<()>(&[], Vec::new());
        assert!(next.is_empty() && failed.is_empty());
    }

    #[test]
    fn a_store_is_distrusted_after_half_the_tombstone_retention() {
        let day = Duration::from_secs(86_400);
        let hour = 3_600_000;
        assert!(!away_too_long(0, 100 * 24 * hour, day), "unknown: trusted");
        assert!(!away_too_long(hour, 12 * hour, day));
        assert!(away_too_long(hour, 14 * hour, day));
    }
}
