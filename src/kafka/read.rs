//! Reading partitions of a topic up to their end as of the call, from their
//! start, their newest records or a group's committed position: the
//! dead-letter listing and replay, held keys read back on assignment and by
//! `kairos keys`; and records at their offsets (jobs whose writes Kafka
//! refused, read back to be dead-lettered).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::BorrowedMessage;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::KafkaConfig;

/// Why a read to the end stopped short.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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

/// Where a read starts in each partition.
#[derive(Clone, Copy, Debug)]
pub enum ReadFrom<'a> {
    /// Its first record.
    Start,
    /// At most this many records before its end.
    Newest(i64),
    /// Where the consumer group named here last committed (its first
    /// record if it never did).
    Committed(&'a str),
}

/// What a read covered in one partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The partition.
    pub partition: i32,
    /// Its first offset (records below are gone).
    pub low: i64,
    /// Where the read started.
    pub from: i64,
    /// Its end as of the call: the read stopped below it.
    pub end: i64,
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
    each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<(), ReadError> {
    read_range(cfg, client_id, topic, partitions, ReadFrom::Start, timeout, each).map(|_| ())
}

/// [`read_to_end`] up to each partition's end in the log, transactions
/// still open there included: a read_committed reader is told the last
/// stable offset as the end, and would stop before the records committed
/// after a transaction left open (by a writer killed in it, until the
/// broker aborts it). Reading on waits such a transaction out.
pub fn read_to_log_end(
    cfg: &KafkaConfig,
    client_id: &str,
    topic: &str,
    partitions: Option<&[i32]>,
    timeout: Duration,
    each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<(), ReadError> {
    let to = ReadTo::LogEnd;
    read_spans(
        cfg,
        client_id,
        topic,
        partitions,
        ReadFrom::Start,
        to,
        timeout,
        each,
    )
    .map(|_| ())
}

/// Where a read ends in each partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadTo {
    /// The last stable offset (what a read_committed reader is told).
    Stable,
    /// The log's end: open transactions are waited out.
    LogEnd,
}

/// [`read_to_end`], each partition from where `from` says; returns what
/// was read of each partition.
pub fn read_range(
    cfg: &KafkaConfig,
    client_id: &str,
    topic: &str,
    partitions: Option<&[i32]>,
    from: ReadFrom<'_>,
    timeout: Duration,
    each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<Vec<Span>, ReadError> {
    read_spans(
        cfg,
        client_id,
        topic,
        partitions,
        from,
        ReadTo::Stable,
        timeout,
        each,
    )
}

#[allow(clippy::too_many_arguments)]
fn read_spans(
    cfg: &KafkaConfig,
    client_id: &str,
    topic: &str,
    partitions: Option<&[i32]>,
    from: ReadFrom<'_>,
    to: ReadTo,
    timeout: Duration,
    mut each: impl FnMut(&BorrowedMessage<'_>),
) -> Result<Vec<Span>, ReadError> {
    let group = match from {
        ReadFrom::Committed(group) => group,
        _ => client_id,
    };
    let consumer = reader(cfg, client_id, group)?;
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
    let committed: HashMap<i32, i64> = match from {
        ReadFrom::Committed(_) => {
            let mut tpl = TopicPartitionList::new();
            for p in &all {
                tpl.add_partition(topic, *p);
            }
            super::retry_until("committed offsets", deadline, || {
                consumer.committed_offsets(tpl.clone(), meta_timeout)
            })?
            .elements()
            .iter()
            .filter_map(|e| Some((e.partition(), e.offset().to_raw().filter(|o| *o >= 0)?)))
            .collect()
        }
        _ => HashMap::new(),
    };
    // The log's end is asked of a read_uncommitted client.
    let ends = match to {
        ReadTo::Stable => None,
        ReadTo::LogEnd => {
            let mut rc = super::base_config(cfg, client_id);
            rc.set("group.id", group)
                .set("isolation.level", "read_uncommitted");
            Some(rc.create::<BaseConsumer>()?)
        }
    };
    let mut tpl = TopicPartitionList::new();
    let mut left = HashMap::new();
    let mut spans = Vec::new();
    for p in all {
        let (low, high) = super::retry_until("watermarks", deadline, || match &ends {
            Some(ends) => ends.fetch_watermarks(topic, p, meta_timeout),
            None => consumer.fetch_watermarks(topic, p, meta_timeout),
        })?;
        let start = match from {
            ReadFrom::Start => low,
            ReadFrom::Newest(n) => (high - n.max(0)).max(low),
            ReadFrom::Committed(_) => committed.get(&p).copied().unwrap_or(low).clamp(low, high),
        };
        spans.push(Span {
            partition: p,
            low,
            from: start,
            end: high,
        });
        if high > start {
            tpl.add_partition_offset(topic, p, Offset::Offset(start))?;
            left.insert(p, high);
        }
    }
    if left.is_empty() {
        return Ok(spans);
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
        let msg = match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => m,
            // The end of a partition as read_committed readers see it (its
            // last offset may be a marker that is never delivered as a
            // record).
            Some(Err(KafkaError::PartitionEOF(p))) if to == ReadTo::Stable => {
                left.remove(&p);
                continue;
            }
            // Reading to the log's end: done where the position passed it
            // (past markers and aborted records, never delivered), else a
            // transaction is still open there.
            None | Some(Err(KafkaError::PartitionEOF(_))) if to == ReadTo::LogEnd => {
                let at = consumer.position()?;
                left.retain(|p, end| {
                    let pos = at.find_partition(topic, *p).and_then(|e| e.offset().to_raw());
                    pos.is_none_or(|pos| pos < *end)
                });
                continue;
            }
            None | Some(Err(KafkaError::PartitionEOF(_))) => continue,
            // A broker lost meanwhile: librdkafka reads on from the
            // partition's next leader; the deadline bounds the wait.
            Some(Err(e)) if super::transient(&e) => {
                tracing::debug!(topic, error = %e, "reading to the end");
                continue;
            }
            Some(Err(e)) => return Err(e.into()),
        };
        use rdkafka::Message as _;
        let (p, offset) = (msg.partition(), msg.offset());
        if left.get(&p).is_some_and(|end| offset + 1 >= *end) {
            left.remove(&p);
        }
        each(&msg);
    }
    Ok(spans)
}

/// A reader's context: librdkafka's global errors are logged as by
/// default, but for a partition's end, which a reader asks to be told of
/// (one still queued when the reader closes arrives as a global error).
struct ReaderContext;

impl ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::PartitionEOF) {
            tracing::error!("librdkafka: {error}: {reason}");
        }
    }
}

impl ConsumerContext for ReaderContext {}

/// A consumer of committed records that reads where it is told (group
/// `group`, nothing committed), noting each partition's end.
fn reader(
    cfg: &KafkaConfig,
    client_id: &str,
    group: &str,
) -> Result<BaseConsumer<ReaderContext>, KafkaError> {
    let mut rc = super::base_config(cfg, client_id);
    rc.set("enable.auto.commit", "false")
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed");
    rc.create_with_context(ReaderContext)
}

/// `with` the record at each of `positions` (topic, partition, offset),
/// in their order; `None` where the partition holds none there (removed, or
/// a transaction marker). One consumer reads them all: each partition from
/// the lowest offset asked of it, up to the highest. Fails after `timeout`.
pub fn read_each<T>(
    cfg: &KafkaConfig,
    client_id: &str,
    positions: &[(&str, i32, i64)],
    timeout: Duration,
    mut with: impl FnMut(&BorrowedMessage<'_>) -> T,
) -> Result<Vec<Option<T>>, ReadError> {
    use rdkafka::Message as _;
    let mut out: Vec<Option<T>> = positions.iter().map(|_| None).collect();
    // Per partition, the offsets still to read and where each answer goes.
    let mut wanted: HashMap<(&str, i32), std::collections::BTreeMap<i64, Vec<usize>>> = HashMap::new();
    for (i, (topic, partition, offset)) in positions.iter().enumerate() {
        let at = wanted.entry((*topic, *partition)).or_default();
        at.entry(*offset).or_default().push(i);
    }
    if wanted.is_empty() {
        return Ok(out);
    }
    let consumer = reader(cfg, client_id, client_id)?;
    let mut tpl = TopicPartitionList::new();
    for ((topic, partition), offsets) in &wanted {
        let first = offsets.keys().next().copied().unwrap_or_default();
        tpl.add_partition_offset(topic, *partition, Offset::Offset(first))?;
    }
    consumer.assign(&tpl)?;
    // Offsets below `to` not met on the way are not there.
    let pass = |offsets: &mut std::collections::BTreeMap<i64, Vec<usize>>, to: i64| {
        let rest = offsets.split_off(&to);
        std::mem::replace(offsets, rest)
    };
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let at = (m.topic(), m.partition());
                let Some(offsets) = wanted
                    .iter_mut()
                    .find_map(|(k, offsets)| (*k == at).then_some(offsets))
                else {
                    continue;
                };
                pass(offsets, m.offset());
                if let Some(at) = offsets.remove(&m.offset()) {
                    for i in at {
                        out[i] = Some(with(&m));
                    }
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                // The end of partition `p` of one of the topics: whatever
                // is asked below where each stands now is not there.
                let at = consumer.position()?;
                for ((topic, partition), offsets) in wanted.iter_mut().filter(|((_, q), _)| *q == p) {
                    let end = at
                        .find_partition(topic, *partition)
                        .and_then(|e| e.offset().to_raw())
                        .filter(|o| *o >= 0);
                    if let Some(end) = end {
                        pass(offsets, end);
                    }
                }
            }
            Some(Err(e)) if !super::transient(&e) => return Err(e.into()),
            _ => {}
        }
        wanted.retain(|_, offsets| !offsets.is_empty());
        if wanted.is_empty() {
            return Ok(out);
        }
    }
    let left: Vec<(&str, i32)> = wanted.keys().copied().collect();
    let topic = left.first().map_or("", |(t, _)| *t);
    Err(ReadError::Unfinished {
        topic: topic.to_string(),
        partitions: left
            .iter()
            .filter(|(t, _)| *t == topic)
            .map(|(_, p)| *p)
            .collect(),
        timeout,
    })
}

/// Commit `spans`' ends as the group `group`'s positions in `topic` (a
/// group with no members: a reader's own bookmark, read back with
/// [`ReadFrom::Committed`]).
pub fn commit_ends(cfg: &KafkaConfig, group: &str, topic: &str, spans: &[Span]) -> Result<(), ReadError> {
    let mut rc = super::base_config(cfg, group);
    rc.set("enable.auto.commit", "false").set("group.id", group);
    let consumer: BaseConsumer = rc.create()?;
    let mut tpl = TopicPartitionList::new();
    for s in spans {
        tpl.add_partition_offset(topic, s.partition, Offset::Offset(s.end))?;
    }
    consumer.commit(&tpl, rdkafka::consumer::CommitMode::Sync)?;
    Ok(())
}

/// The metadata group `group` committed with its offsets of `partitions`
/// (topic and partition), for those that have one.
pub fn committed_metadata(
    cfg: &KafkaConfig,
    group: &str,
    partitions: &[(String, i32)],
    timeout: Duration,
) -> Result<HashMap<(String, i32), String>, ReadError> {
    if partitions.is_empty() {
        return Ok(HashMap::new());
    }
    let mut rc = super::base_config(cfg, group);
    rc.set("enable.auto.commit", "false").set("group.id", group);
    let consumer: BaseConsumer = rc.create()?;
    let mut tpl = TopicPartitionList::new();
    for (topic, p) in partitions {
        tpl.add_partition(topic, *p);
    }
    let deadline = Instant::now() + timeout;
    let got = super::retry_until("committed offsets", deadline, || {
        consumer.committed_offsets(tpl.clone(), timeout.min(Duration::from_secs(10)))
    })?;
    Ok(got
        .elements()
        .iter()
        .filter(|e| !e.metadata().is_empty())
        .map(|e| ((e.topic().to_string(), e.partition()), e.metadata().to_string()))
        .collect())
}
