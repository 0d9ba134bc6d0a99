//! The scheduler's changelog: a compacted topic keyed by job id, partition N
//! mirroring schedule partition N. A pending job is a record whose value is
//! its [`StoredJob`] bytes; a fired or cancelled job is a tombstone (null
//! value). Replaying a partition's changelog from the start (or from a
//! store's checkpoint) rebuilds its pending jobs.

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

/// Bring `store`'s copy of `partition` up to the end of the changelog,
/// starting at the store's checkpoint. Returns the number of records read.
///
/// `client` holds the connection settings (bootstrap servers, TLS, SASL); a
/// private consumer with no group reads the partition.
pub fn catch_up(
    client: &ClientConfig,
    topic: &str,
    partition: i32,
    store: &Store,
    timeout: Duration,
) -> Result<u64, RebuildError> {
    let kafka = |source| RebuildError::Kafka { partition, source };
    let mut cfg = client.clone();
    cfg.set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("group.id", "kairos-changelog-reader")
        .set("enable.partition.eof", "false");
    let consumer: BaseConsumer = cfg.create().map_err(kafka)?;
    let (low, high) = consumer
        .fetch_watermarks(topic, partition, timeout)
        .map_err(kafka)?;
    let start = store.checkpoint(partition)?.changelog_next.max(low);
    if start >= high {
        store.apply(partition, &[], Some(high))?;
        debug!(partition, high, "changelog: nothing to catch up");
        return Ok(0);
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))
        .map_err(kafka)?;
    consumer.assign(&tpl).map_err(kafka)?;
    let deadline = Instant::now() + timeout;
    let mut at = start;
    let mut read = 0u64;
    let mut batch: Vec<Change> = Vec::new();
    while at < high {
        if Instant::now() > deadline {
            return Err(RebuildError::Timeout {
                partition,
                at,
                end: high,
                timeout,
            });
        }
        let Some(msg) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let msg = msg.map_err(kafka)?;
        at = msg.offset() + 1;
        read += 1;
        let Some(key) = msg.key().and_then(|k| <[u8; 16]>::try_from(k).ok()) else {
            continue; // not ours; a changelog only holds 16-byte job ids
        };
        let id = JobId::from_bytes(key);
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
            store.apply(partition, &std::mem::take(&mut batch), Some(at))?;
        }
    }
    store.apply(partition, &batch, Some(at))?;
    info!(
        partition,
        from = start,
        to = at,
        records = read,
        "changelog: caught up"
    );
    Ok(read)
}
