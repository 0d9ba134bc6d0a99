//! The scheduler's changelog: a compacted topic keyed by job id, partition N
//! mirroring schedule partition N. A pending job is a record whose value is
//! its [`StoredJob`] bytes; a fired or cancelled job is a tombstone (null
//! value). Replaying a partition's changelog from the start (or from a
//! store's checkpoint) rebuilds its pending jobs.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Message, Offset, TopicPartitionList};
use tracing::{debug, info};

use crate::job::JobId;
use crate::scheduler::store::{Change, Store};
use crate::scheduler::stored::StoredJob;
use crate::wire::OwnedRecord;

/// The changelog record for a pending job.
pub fn put_record(topic: &str, job: &StoredJob) -> OwnedRecord {
    OwnedRecord {
        topic: topic.to_string(),
        key: job.job.id.as_bytes().to_vec(),
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

/// Why a rebuild failed.
#[derive(Debug, thiserror::Error)]
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
/// changelog, each from the store's checkpoint. Returns the number of
/// records read per partition.
///
/// `client` holds the connection settings (bootstrap servers, TLS, SASL); one
/// private consumer with no group reads every partition at once.
pub fn catch_up(
    client: &ClientConfig,
    topic: &str,
    partitions: &[i32],
    store: &Store,
    timeout: Duration,
) -> Result<HashMap<i32, u64>, RebuildError> {
    let kafka = |partition, source| RebuildError::Kafka { partition, source };
    let first = partitions.first().copied().unwrap_or(0);
    let mut cfg = client.clone();
    cfg.set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("group.id", "kairos-changelog-reader")
        .set("enable.partition.eof", "false");
    let consumer: BaseConsumer = cfg.create().map_err(|e| kafka(first, e))?;
    let mut read: HashMap<i32, u64> = partitions.iter().map(|p| (*p, 0)).collect();
    // Per partition still to read: (next offset, end).
    let mut todo: HashMap<i32, (i64, i64)> = HashMap::new();
    let mut tpl = TopicPartitionList::new();
    for &p in partitions {
        let (low, high) = consumer
            .fetch_watermarks(topic, p, timeout)
            .map_err(|e| kafka(p, e))?;
        let start = store.checkpoint(p)?.changelog_next.max(low);
        if start >= high {
            store.apply(p, &[], Some(high))?;
            debug!(partition = p, high, "changelog: nothing to catch up");
            continue;
        }
        tpl.add_partition_offset(topic, p, Offset::Offset(start))
            .map_err(|e| kafka(p, e))?;
        todo.insert(p, (start, high));
    }
    if todo.is_empty() {
        return Ok(read);
    }
    consumer.assign(&tpl).map_err(|e| kafka(first, e))?;
    let started: HashMap<i32, i64> = todo.iter().map(|(p, (at, _))| (*p, *at)).collect();
    let deadline = Instant::now() + timeout;
    let mut batches: HashMap<i32, Vec<Change>> = HashMap::new();
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
            continue;
        };
        let msg = msg.map_err(|e| kafka(p, e))?;
        let p = msg.partition();
        let Some((at, _)) = todo.get_mut(&p) else {
            continue; // not assigned here
        };
        *at = msg.offset() + 1;
        let next = *at;
        *read.entry(p).or_default() += 1;
        let Some(key) = msg.key().and_then(|k| <[u8; 16]>::try_from(k).ok()) else {
            continue; // not ours; a changelog only holds 16-byte job ids
        };
        let id = JobId::from_bytes(key);
        let batch = batches.entry(p).or_default();
        match msg.payload() {
            None => batch.push(Change::Delete(id)),
            Some(v) => match StoredJob::decode(v) {
                Ok(s) if s.job.id == id => batch.push(Change::Put(s)),
                // A value that does not decode was not written by this
                // version; dropping it would lose a job, so stop loudly.
                Ok(_) | Err(_) => {
                    return Err(RebuildError::Store(crate::scheduler::store::StoreError::Corrupt(
                        crate::scheduler::stored::CorruptJob("changelog record does not decode"),
                    )))
                }
            },
        }
        if batch.len() >= 1000 {
            store.apply(p, &std::mem::take(batch), Some(next))?;
        }
    }
    for (p, (at, _)) in todo {
        store.apply(p, &batches.remove(&p).unwrap_or_default(), Some(at))?;
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
