//! A topic's partitions, their watermarks and a consumer group's lag on
//! them: what `kairos stats` shows and what fair dispatch reads of the
//! workers' backlog.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};

/// The partitions of `topic` (`None` when it does not exist or has none).
pub(crate) fn partitions_of<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<Vec<i32>>, KafkaError> {
    let meta = consumer.fetch_metadata(Some(topic), timeout)?;
    let Some(m) = meta
        .topics()
        .iter()
        .find(|m| m.name() == topic && m.error().is_none())
    else {
        return Ok(None);
    };
    let partitions: Vec<i32> = m.partitions().iter().map(|p| p.id()).collect();
    Ok((!partitions.is_empty()).then_some(partitions))
}

/// A partition and its (low, high) watermarks.
pub(crate) type Watermarks = (i32, (i64, i64));

/// Each of `partitions`' (low, high) watermarks.
pub(crate) fn watermarks<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partitions: &[i32],
    timeout: Duration,
) -> Result<Vec<Watermarks>, KafkaError> {
    partitions
        .iter()
        .map(|p| Ok((*p, consumer.fetch_watermarks(topic, *p, timeout)?)))
        .collect()
}

/// Records of `topic` that `consumer`'s group has not committed yet, summed
/// over the partitions of `ends` (their watermarks); a partition never
/// committed counts from its start.
pub(crate) fn group_lag<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    ends: &[Watermarks],
    timeout: Duration,
) -> Result<i64, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for (p, _) in ends {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    Ok(ends
        .iter()
        .map(|(p, (low, high))| {
            let at = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o.max(*low),
                _ => *low,
            };
            (high - at).max(0)
        })
        .sum())
}
