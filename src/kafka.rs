//! The one place where rdkafka clients are built from [`KafkaConfig`].
//!
//! Kairos's defaults go in first, then the user's pass-through maps
//! (`[kafka.client]`, then `[kafka.producer]` or `[kafka.consumer]`), so any
//! librdkafka setting, TLS and SASL included, can be set or overridden from
//! configuration.

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::{ClientConfig, FromClientConfig, FromClientConfigAndContext};
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use rdkafka::producer::future_producer::Delivery;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::config::{GroupProtocol, KafkaConfig, PassThrough};
use crate::sync::Lock;
use crate::wire::OwnedRecord;

mod lag;
mod reach;
mod read;
mod transient;
mod txn;

pub(crate) use lag::{group_lag, partitions_of, watermarks};
pub use reach::{reach, Unreachable};
pub use read::{
    commit_ends, committed_metadata, read_each, read_range, read_to_end, read_to_log_end, ReadError,
    ReadFrom, Span,
};
pub use transient::{refused_for_good, retry_until, transient};
pub use txn::{Transactional, TxnError};

/// Settings shared by every client: bootstrap servers, a client id, and the
/// `[kafka.client]` map.
pub fn base_config(cfg: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut c = connection(cfg, client_id);
    apply(&mut c, cfg.client.iter());
    c
}

/// Where to connect and who we are; every client starts from this.
fn connection(cfg: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &cfg.brokers);
    c.set("client.id", client_id);
    c
}

fn apply<'a>(c: &mut ClientConfig, map: impl Iterator<Item = (&'a String, &'a PassThrough)>) {
    for (k, v) in map {
        c.set(k, &v.0);
    }
}

/// Producer settings: idempotent (no duplicates or reordering from the
/// producer's own retries), acknowledged by all in-sync replicas, the Java
/// client's partitioner (murmur2) so that a key lands on the same partition
/// whichever client wrote it.
pub fn producer_config(cfg: &KafkaConfig, client_id: &str) -> ClientConfig {
    let mut c = connection(cfg, client_id);
    c.set("enable.idempotence", "true");
    c.set("acks", "all");
    c.set("partitioner", "murmur2_random");
    c.set("linger.ms", "5");
    // Kafka's default broker limit (librdkafka's own default is lower), so a
    // record at the payload limit plus its key and headers fits, dead letters too.
    c.set("message.max.bytes", "1048588");
    c.set("message.timeout.ms", cfg.produce_timeout.as_millis().to_string());
    apply(&mut c, cfg.client.iter());
    apply(&mut c, cfg.producer.iter());
    c
}

/// How a consumer is a member of its group.
#[derive(Clone, Debug)]
pub struct Membership<'a> {
    /// The consumer group.
    pub group: &'a str,
    /// How long the member keeps its partitions without heartbeating.
    pub session_timeout: std::time::Duration,
    /// `group.instance.id` for static membership; `None`: dynamic.
    pub instance_id: Option<String>,
    /// How often librdkafka commits the stored offsets by itself
    /// (`auto.commit.interval.ms`). Every commit is a write of the group on
    /// the coordinator: a member that commits on its own cadence keeps this
    /// long, as a backstop for a commit of its own that failed. `None`: the
    /// member's offsets commit only in its transactions, and librdkafka
    /// commits nothing by itself (a user's `enable.auto.commit` is
    /// overridden). Kafka's rule for offsets sent to a transaction: a
    /// plain commit of the same group's offset may land after the
    /// transaction's, or before it with a newer offset, and the committed
    /// offset then moves back once the transaction commits.
    pub auto_commit_every: Option<std::time::Duration>,
}

/// Consumer settings for a member of a group: offsets are stored by Kairos
/// only once a record's effect is durable (`enable.auto.offset.store=false`)
/// and committed in the background; under the classic protocol,
/// cooperative-sticky assignment so that a rebalance moves only the
/// partitions that must move (the consumer protocol is incremental itself).
pub fn consumer_config(cfg: &KafkaConfig, member: &Membership<'_>, client_id: &str) -> ClientConfig {
    let mut c = connection(cfg, client_id);
    c.set("group.id", member.group);
    match cfg.group_protocol {
        GroupProtocol::Classic => {
            c.set(
                "session.timeout.ms",
                member.session_timeout.as_millis().to_string(),
            );
            c.set("partition.assignment.strategy", "cooperative-sticky");
        }
        // The broker assigns partitions (incrementally) and keeps the
        // session timeout; librdkafka refuses both settings here.
        GroupProtocol::Consumer => {
            c.set("group.protocol", "consumer");
        }
    }
    if let Some(id) = &member.instance_id {
        c.set("group.instance.id", id);
    }
    if let Some(every) = member.auto_commit_every {
        c.set("enable.auto.commit", "true");
        // librdkafka sends nothing when no stored offset moved.
        c.set("auto.commit.interval.ms", every.as_millis().to_string());
    }
    c.set("enable.auto.offset.store", "false");
    c.set("auto.offset.reset", "earliest");
    c.set("enable.partition.eof", "false");
    // librdkafka's default, said here: records of aborted transactions
    // are never read, nor anything after a transaction still open.
    c.set("isolation.level", "read_committed");
    // When its prefetch queue is full (`queued.max.messages.kbytes`, 64 MiB
    // by default: about 100,000 jobs), librdkafka looks again only after
    // this long (1 s by default). A backlog read faster than it is handled
    // then stalls: the scheduler draining 200,000 due jobs sat idle for a
    // third of a second with an empty queue. Looking every 10 ms costs nothing.
    c.set("fetch.queue.backoff.ms", "10");
    apply(&mut c, cfg.client.iter());
    apply(&mut c, cfg.consumer.iter());
    if member.auto_commit_every.is_none() {
        c.set("enable.auto.commit", "false");
    }
    c
}

/// Log a commit's outcome (a consumer context's `commit_callback`): a
/// failed commit is a warning naming the partitions and offsets it would
/// have moved, since the records after the last commit run again after a
/// crash; "nothing to commit" is not a failure.
pub fn log_commit(
    who: &str,
    result: &rdkafka::error::KafkaResult<()>,
    offsets: &rdkafka::TopicPartitionList,
) {
    use rdkafka::types::RDKafkaErrorCode;
    match result {
        Ok(()) => tracing::trace!(consumer = who, "offsets committed"),
        Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        // The group is completing a rebalance: the next commit after it
        // carries the same offsets.
        Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::RebalanceInProgress)) => {
            tracing::debug!(consumer = who, "offset commit deferred: the group is rebalancing")
        }
        Err(e) => {
            let wanted: Vec<(i32, i64)> = offsets
                .elements()
                .iter()
                .filter_map(|e| e.offset().to_raw().map(|o| (e.partition(), o)))
                .collect();
            tracing::warn!(consumer = who, error = %e, offsets = ?wanted, "offset commit failed");
        }
    }
}

/// An idempotent producer.
pub fn producer(cfg: &KafkaConfig, client_id: &str) -> Result<FutureProducer, KafkaError> {
    FutureProducer::from_config(&producer_config(cfg, client_id))
}

/// A group member with a custom context (rebalance callbacks).
pub fn consumer<C, T>(
    cfg: &KafkaConfig,
    member: &Membership<'_>,
    client_id: &str,
    context: C,
) -> Result<T, KafkaError>
where
    C: ConsumerContext,
    T: FromClientConfigAndContext<C>,
{
    T::from_config_and_context(&consumer_config(cfg, member, client_id), context)
}

/// An admin client.
pub fn admin(cfg: &KafkaConfig) -> Result<AdminClient<DefaultClientContext>, KafkaError> {
    AdminClient::from_config(&base_config(cfg, "kairos-admin"))
}

/// Produce one record and wait for the broker's acknowledgement (or for
/// librdkafka's `message.timeout.ms` to expire). `partition` pins the
/// partition; `None` lets the partitioner choose by key.
pub async fn send(
    producer: &FutureProducer,
    rec: &OwnedRecord,
    partition: Option<i32>,
) -> Result<Delivery, KafkaError> {
    enqueue(producer, rec, partition).await.await
}

/// Hand a record to librdkafka now, in call order, and return a future of
/// its acknowledgement. Records enqueued one after the other keep their order
/// per partition (the producer is idempotent), so a caller can enqueue the
/// next batch while the previous one is still being acknowledged. A full
/// local queue is waited out here (briefly), never skipped.
pub async fn enqueue(
    producer: &FutureProducer,
    rec: &OwnedRecord,
    partition: Option<i32>,
) -> impl std::future::Future<Output = Result<Delivery, KafkaError>> + Send + 'static {
    let mut fr = FutureRecord::to(&rec.topic)
        .key(&rec.key[..])
        .headers(rec.kafka_headers());
    if let Some(v) = &rec.value {
        fr = fr.payload(&v[..]);
    }
    if let Some(p) = partition {
        fr = fr.partition(p);
    }
    enqueue_record(producer, fr).await
}

/// [`enqueue`] each of `records` (with its pinned partition, if any) in
/// turn, so that they keep their order per partition; returns the futures
/// of their acknowledgements, in the same order.
pub async fn enqueue_all(
    producer: &FutureProducer,
    records: &[(&OwnedRecord, Option<i32>)],
) -> Vec<impl std::future::Future<Output = Result<Delivery, KafkaError>> + Send + 'static> {
    let mut acks = Vec::with_capacity(records.len());
    for (rec, partition) in records {
        acks.push(enqueue(producer, rec, *partition).await);
    }
    acks
}

/// [`enqueue`] for a job fired to its work topic, built straight from the
/// job (no intermediate [`OwnedRecord`]: the scheduler's hot path).
pub async fn enqueue_job(
    producer: &FutureProducer,
    job: &crate::Job,
) -> impl std::future::Future<Output = Result<Delivery, KafkaError>> + Send + 'static {
    let fr = FutureRecord::to(&job.topic)
        .key(&job.key[..])
        .payload(&job.payload[..])
        .headers(crate::wire::kafka_headers(job));
    enqueue_record(producer, fr).await
}

async fn enqueue_record(
    producer: &FutureProducer,
    mut fr: FutureRecord<'_, [u8], [u8]>,
) -> impl std::future::Future<Output = Result<Delivery, KafkaError>> + Send + 'static {
    loop {
        let result = match producer.send_result(fr) {
            Ok(delivery) => Ok(delivery),
            Err((KafkaError::MessageProduction(rdkafka::types::RDKafkaErrorCode::QueueFull), back)) => {
                fr = back;
                let wait = std::time::Duration::from_millis(5);
                // Also called through `block_on` from plain threads (the
                // ingest and poll threads), where there is no tokio timer.
                if tokio::runtime::Handle::try_current().is_ok() {
                    tokio::time::sleep(wait).await;
                } else {
                    std::thread::sleep(wait);
                }
                continue;
            }
            Err((e, _)) => Err(e),
        };
        return async move {
            match result?.await {
                Ok(Ok(d)) => Ok(d),
                Ok(Err((e, _))) => Err(e),
                Err(_) => Err(KafkaError::Canceled),
            }
        };
    }
}

/// Ask `producer`'s cluster for the metadata of `topic`, so that its first
/// writes to it do not wait for librdkafka to look it up (on a cold producer
/// that wait held the first fires after a start back by up to most of a
/// second). Only for a topic known to exist: a producer's metadata
/// request may auto-create a topic on brokers that allow it.
pub async fn warm_up(producer: &FutureProducer, topic: &str, timeout: std::time::Duration) {
    use rdkafka::producer::Producer as _;
    let client = producer.clone();
    let name = topic.to_string();
    let started = std::time::Instant::now();
    match blocking(move || client.client().fetch_metadata(Some(&name), timeout).map(|_| ())).await {
        Ok(()) => tracing::debug!(topic, elapsed = ?started.elapsed(), "producer warmed up"),
        Err(e) => tracing::warn!(topic, error = %e, "producer warm-up failed; first writes may wait"),
    }
}

/// Run a blocking librdkafka call: on tokio's blocking pool inside a runtime,
/// inline on a plain thread (the worker's and scheduler's poll threads).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, KafkaError> + Send + 'static,
) -> Result<T, KafkaError> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => tokio::task::spawn_blocking(f)
            .await
            .map_err(|_| KafkaError::Canceled)?,
        Err(_) => f(),
    }
}

/// Answers "does this topic exist?" from the cluster's metadata, with a
/// cache, through a consumer-type client (whose metadata requests never
/// auto-create topics, unlike a producer's). librdkafka itself only notices a
/// missing topic when a write times out, which a retry loop would take for a
/// passing fault.
#[derive(Clone)]
pub struct TopicCheck {
    client: std::sync::Arc<rdkafka::consumer::BaseConsumer>,
    /// Look-ups wait here in arrival order (tokio's mutex is fair), so that
    /// writes started in some order, waiting for the same look-up, still
    /// reach librdkafka in that order (per-key order of concurrent enqueues).
    lookup: std::sync::Arc<tokio::sync::Mutex<()>>,
    known: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>>,
    timeout: std::time::Duration,
}

impl TopicCheck {
    /// How long a topic seen to exist is trusted without asking again.
    const TRUST: std::time::Duration = std::time::Duration::from_secs(60);

    /// A checker on the cluster of `cfg`.
    pub fn new(cfg: &KafkaConfig) -> Result<Self, KafkaError> {
        let client: rdkafka::consumer::BaseConsumer = base_config(cfg, "kairos-topic-check")
            .set("allow.auto.create.topics", "false")
            .create()?;
        Ok(TopicCheck {
            client: std::sync::Arc::new(client),
            lookup: Default::default(),
            known: Default::default(),
            timeout: cfg.produce_timeout,
        })
    }

    /// Whether `topic` exists. Errors only when the cluster cannot be asked.
    pub async fn exists(&self, topic: &str) -> Result<bool, KafkaError> {
        use rdkafka::consumer::Consumer as _;
        if self.known_now(topic) {
            return Ok(true);
        }
        let _turn = self.lookup.lock().await;
        if self.known_now(topic) {
            return Ok(true); // looked up by the caller before us
        }
        let client = self.client.clone();
        let name = topic.to_string();
        let timeout = self.timeout;
        let exists = blocking(move || {
            let md = client.fetch_metadata(Some(&name), timeout)?;
            Ok(md
                .topics()
                .iter()
                .any(|t| t.name() == name && t.error().is_none() && !t.partitions().is_empty()))
        })
        .await?;
        if exists {
            let mut known = self.known.locked();
            known.insert(topic.to_string(), std::time::Instant::now());
        }
        Ok(exists)
    }
}

impl TopicCheck {
    fn known_now(&self, topic: &str) -> bool {
        let known = self.known.locked();
        known.get(topic).is_some_and(|t| t.elapsed() < Self::TRUST)
    }
}

/// Whether a write failed because its topic does not exist (a permanent
/// failure: retrying will not help).
pub fn is_unknown_topic(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition
                | rdkafka::types::RDKafkaErrorCode::UnknownTopic
        )
    )
}

/// Number of partitions of `topic`, from the cluster's metadata. Blocking
/// (librdkafka's metadata call), so it runs on tokio's blocking pool.
pub async fn partition_count(
    producer: &FutureProducer,
    topic: &str,
    timeout: std::time::Duration,
) -> Result<i32, KafkaError> {
    use rdkafka::producer::Producer as _;
    let producer = producer.clone();
    let topic = topic.to_string();
    blocking(move || {
        let md = producer.client().fetch_metadata(Some(&topic), timeout)?;
        let t = md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .ok_or(KafkaError::MetadataFetch(
                rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition,
            ))?;
        if let Some(e) = t.error() {
            return Err(KafkaError::MetadataFetch(e.into()));
        }
        if t.partitions().is_empty() {
            return Err(KafkaError::MetadataFetch(
                rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition,
            ));
        }
        Ok(t.partitions().len() as i32)
    })
    .await
}

/// Delays between attempts of a write that failed: 100 ms, doubling, at most 5 s.
#[derive(Debug)]
pub(crate) struct RetryDelay(std::time::Duration);

impl RetryDelay {
    /// Start at 100 ms.
    pub(crate) fn new() -> Self {
        RetryDelay(std::time::Duration::from_millis(100))
    }

    /// The delay before the next attempt.
    pub(crate) fn next_delay(&mut self) -> std::time::Duration {
        let d = self.0;
        self.0 = (self.0 * 2).min(std::time::Duration::from_secs(5));
        d
    }
}

#[cfg(test)]
mod tests;
