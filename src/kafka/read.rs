//! Reading partitions of a topic from their start to their end as of the
//! call: the dead-letter listing, held keys read back on assignment and by
//! `kairos keys`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::KafkaConfig;

/// Why a read to the end stopped short.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// A Kafka request failed.
    #[error(transparent)]
    Kafka(#[from] KafkaError),
    /// These partitions were not read to their end in time.
    #[error("partitions {partitions:?} of `{topic}` were not read to their end within {timeout:?}")]
    Unfinished {
        /// The topic.
        topic: String,
        /// The partitions left.
        partitions: Vec<i32>,
        /// How long the read had.
        timeout: Duration,
    },
}

/// Call `each` with every record of `partitions` of `topic` (all of them
/// when `None`), from each partition's start to its end as of the call, in
/// order per partition; fail after `timeout`.
pub fn read_to_end(
    cfg: &KafkaConfig,
    client_id: &str,
    topic: &str,
    partitions: Option<&[i32]>,
    timeout: Duration,
    mut each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<(), ReadError> {
    let mut rc = super::base_config(cfg, client_id);
    rc.set("enable.auto.commit", "false")
        .set("group.id", client_id)
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "true");
    let consumer: BaseConsumer = rc.create()?;
    let deadline = Instant::now() + timeout;
    let meta_timeout = timeout.min(Duration::from_secs(10));
    let all: Vec<i32> = match partitions {
        Some(ps) => ps.to_vec(),
        None => super::retry_until("metadata", deadline, || {
            consumer.fetch_metadata(Some(topic), meta_timeout)
        })?
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect(),
    };
    let mut tpl = TopicPartitionList::new();
    let mut left = HashMap::new();
    for p in all {
        let (low, high) = super::retry_until("watermarks", deadline, || {
            consumer.fetch_watermarks(topic, p, meta_timeout)
        })?;
        if high > low {
            tpl.add_partition_offset(topic, p, Offset::Offset(low))?;
            left.insert(p, high);
        }
    }
    if left.is_empty() {
        return Ok(());
    }
    consumer.assign(&tpl)?;
    while !left.is_empty() {
        if Instant::now() > deadline {
            // A partial read would pass for the whole: say so instead.
            let mut partitions: Vec<i32> = left.into_keys().collect();
            partitions.sort_unstable();
            return Err(ReadError::Unfinished {
                topic: topic.to_string(),
                partitions,
                timeout,
            });
        }
        let Some(msg) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let msg = match msg {
            Ok(m) => m,
            // The end of a partition (its last offset may be a marker that
            // is never delivered as a record).
            Err(KafkaError::PartitionEOF(p)) => {
                left.remove(&p);
                continue;
            }
            // A broker lost meanwhile: librdkafka reads on from the
            // partition's next leader; the deadline bounds the wait.
            Err(e) if super::transient(&e) => {
                tracing::debug!(topic, error = %e, "reading to the end");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        use rdkafka::Message as _;
        let (p, offset) = (msg.partition(), msg.offset());
        if left.get(&p).is_some_and(|end| offset + 1 >= *end) {
            left.remove(&p);
        }
        each(&msg);
    }
    Ok(())
}
