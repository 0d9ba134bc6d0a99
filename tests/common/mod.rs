//! Helpers shared by the integration tests: the Apache Kafka broker
//! ([`kafka`]), unique names, waiting on conditions with a deadline, and
//! reading topics back.
#![allow(dead_code)]

pub mod events;
pub mod kafka;

pub use kafka::Broker;

/// What a handler under test records, shared with the test.
pub type Recorded<T> = std::sync::Arc<std::sync::Mutex<Vec<T>>>;
pub mod system;

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kairos::Config;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};

/// Topic names of their own for `cfg` (one work topic), 3 schedule and 3
/// work partitions.
pub fn fresh_topics(cfg: &mut Config) {
    let p = unique("t");
    cfg.topics.schedule = format!("{p}.schedule");
    cfg.topics.changelog = format!("{p}.changelog");
    cfg.topics.dead_letter = format!("{p}.dead");
    cfg.topics.schedules = format!("{p}.schedules");
    cfg.topics.schedule_cursors = format!("{p}.schedules.cursors");
    cfg.topics.held = format!("{p}.held");
    cfg.topics.work = vec![format!("{p}.jobs")];
    cfg.topics.schedule_partitions = 3;
    cfg.topics.work_partitions = 3;
}

/// A free TCP port on 127.0.0.1 (bound, then released for the broker).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The logs of the services this test process runs: on stderr, when
/// `KAIROS_TEST_LOG` names a filter (as `RUST_LOG` does:
/// `KAIROS_TEST_LOG=info,kairos::scheduler=debug`); else their warnings
/// and errors, in the output of the test that ran them (shown when it
/// fails). Set up once.
pub fn capture_logs() {
    let builder = tracing_subscriber::fmt();
    let _ = match std::env::var("KAIROS_TEST_LOG") {
        Ok(filter) => builder
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init(),
        Err(_) => builder
            .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
            .with_test_writer()
            .try_init(),
    };
}

/// A child process killed (SIGKILL) and reaped when dropped, so a failing
/// test or bench leaves no orphan.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for ChildGuard {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

/// A name unique within this test run: prefix, process id and a counter.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Poll `f` until it returns `Some`, or panic with `what` after `timeout`.
/// For waiting on an event that has no notification of its own.
pub fn wait_for<T>(what: &str, timeout: Duration, f: impl FnMut() -> Option<T>) -> T {
    wait_until(timeout, f).unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

/// Poll `f` until it returns `Some`, or give `None` after `timeout`: for
/// checking that something does not happen within a bound.
pub fn wait_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A consumer in a fresh group (named from `group_prefix`) that commits
/// nothing, with extra librdkafka `settings`.
pub fn reader(brokers: &str, group_prefix: &str, settings: &[(&str, &str)]) -> BaseConsumer {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", unique(group_prefix))
        .set("enable.auto.commit", "false");
    for (k, v) in settings {
        c.set(*k, *v);
    }
    c.create().expect("reader")
}

/// The partition ids of `topic`.
pub fn partitions(consumer: &BaseConsumer, topic: &str) -> Vec<i32> {
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    md.topics()[0].partitions().iter().map(|p| p.id()).collect()
}

/// Assign every partition of `topic` to `consumer` from its beginning;
/// returns the partition ids.
pub fn assign_from_start(consumer: &BaseConsumer, topic: &str) -> Vec<i32> {
    let ids = partitions(consumer, topic);
    let mut tpl = TopicPartitionList::new();
    for p in &ids {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)
            .expect("partition");
    }
    consumer.assign(&tpl).expect("assign");
    ids
}

/// Every record of `topic` that a reader with `isolation` (`read_committed`
/// or `read_uncommitted`) is handed, from each partition's start to its
/// end as of the call (the log's end: a read_committed reader waits out a
/// transaction still open there); panics after `timeout`.
pub fn read_all(brokers: &str, topic: &str, isolation: &str, timeout: Duration) -> Vec<OwnedMessage> {
    let consumer = reader(brokers, "all", &[("isolation.level", isolation)]);
    let ends = reader(brokers, "ends", &[("isolation.level", "read_uncommitted")]);
    let ids = assign_from_start(&consumer, topic);
    let mut todo: std::collections::HashMap<i32, (i64, i64)> = ids
        .iter()
        .map(|p| {
            let (low, high) = ends
                .fetch_watermarks(topic, *p, Duration::from_secs(10))
                .expect("watermarks");
            (*p, (low, high))
        })
        .filter(|(_, (low, high))| low < high)
        .collect();
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while !todo.is_empty() {
        assert!(
            Instant::now() < deadline,
            "{topic} not read to its end within {timeout:?} ({isolation}): {todo:?}"
        );
        match consumer.poll(Duration::from_millis(50)) {
            Some(r) => {
                let m = r.expect("consume").detach();
                if let Some((at, _)) = todo.get_mut(&m.partition()) {
                    *at = m.offset() + 1;
                }
                out.push(m);
            }
            // Past transaction markers and aborted records, which are not handed over.
            None => {
                for e in consumer.position().expect("position").elements() {
                    if let (Some((at, _)), Offset::Offset(next)) = (todo.get_mut(&e.partition()), e.offset())
                    {
                        *at = (*at).max(next);
                    }
                }
            }
        }
        todo.retain(|_, (at, end)| at < end);
    }
    out
}

/// Read every partition of `topic` from the beginning until `n` records
/// have arrived or `timeout` has passed; returns what arrived. Records keep
/// offset order within each partition, interleaved across partitions.
pub fn read_up_to(brokers: &str, topic: &str, n: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let consumer = reader(brokers, "reader", &[]);
    assign_from_start(&consumer, topic);
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while out.len() < n && Instant::now() < deadline {
        if let Some(r) = consumer.poll(Duration::from_millis(50)) {
            out.push(r.expect("consume").detach());
        }
    }
    out
}

/// Read `n` records from `topic` (see [`read_up_to`]); panic if fewer arrive within `timeout`.
pub fn read_n(brokers: &str, topic: &str, n: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let out = read_up_to(brokers, topic, n, timeout);
    assert_eq!(out.len(), n, "records read from {topic} within {timeout:?}");
    out
}

/// Number of records in `topic` (sum over partitions of high minus low
/// watermark), as the broker reports it now. A partition whose leader was
/// just killed is asked again until a new leader answers (the controller
/// notices a dead broker after `broker.session.timeout.ms`, 9 s).
pub fn record_count(brokers: &str, topic: &str) -> i64 {
    let consumer = reader(brokers, "counter", &[]);
    partitions(&consumer, topic)
        .into_iter()
        .map(|p| {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                match consumer.fetch_watermarks(topic, p, Duration::from_secs(10)) {
                    Ok((lo, hi)) => return hi - lo,
                    Err(e) if Instant::now() > deadline => panic!("watermarks of {topic} [{p}]: {e}"),
                    Err(_) => std::thread::sleep(Duration::from_millis(200)),
                }
            }
        })
        .sum()
}

/// Read `n` records and check, by the watermarks, that the topic holds no more.
pub fn read_exactly(brokers: &str, topic: &str, n: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let out = read_n(brokers, topic, n, timeout);
    assert_eq!(record_count(brokers, topic), n as i64, "records in {topic}");
    out
}

/// The value of header `name` on a consumed message.
pub fn header<'a>(m: &'a OwnedMessage, name: &str) -> Option<&'a [u8]> {
    use rdkafka::message::Headers;
    let h = m.headers()?;
    h.iter().find(|h| h.key == name).and_then(|h| h.value)
}

/// Sum over partitions of the offsets `group` has committed on `topic`
/// (partitions with no commit count as 0). A request that times out (a
/// broker busy with the tests running beside) is asked again, for a minute.
pub fn committed(brokers: &str, group: &str, topic: &str) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("client");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut tpl = TopicPartitionList::new();
        for p in partitions(&consumer, topic) {
            tpl.add_partition(topic, p);
        }
        match consumer.committed_offsets(tpl, Duration::from_secs(10)) {
            Ok(c) => {
                return c
                    .elements()
                    .iter()
                    .filter_map(|e| e.offset().to_raw())
                    .filter(|o| *o >= 0)
                    .sum()
            }
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("committed offsets of {group}: {e}; asking again")
            }
            Err(e) => panic!("committed offsets of {group}: {e}"),
        }
    }
}

/// Scrapes an admin endpoint's `/metrics` every `every` on a thread of its
/// own until dropped, as an eager Prometheus would (the benches' "metrics
/// on" runs).
pub struct Scraper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Scraper {
    /// Start scraping `addr`.
    pub fn start(addr: std::net::SocketAddr, every: Duration) -> Scraper {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut scrapes = 0;
            while !s.load(Ordering::Relaxed) {
                if let Ok((200, _)) = kairos::admin::get(addr, "/metrics", None) {
                    scrapes += 1;
                }
                std::thread::sleep(every);
            }
            scrapes
        });
        Scraper {
            stop,
            thread: Some(thread),
        }
    }

    /// Stop; how many scrapes were answered.
    pub fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

/// Make compacted `topic` compact within seconds, as a busy production
/// topic would: segments roll every 100 ms (a segment is cleaned only once
/// it is no longer the one written to), any share of superseded records is
/// worth a cleaning, records may go as soon as they are superseded, and
/// tombstones stay `tombstones` after their segment was first cleaned. The
/// broker's cleaner looks every second (`common::kafka`).
pub async fn compact_soon(brokers: &str, topic: &str, tombstones: Duration) {
    let ms = tombstones.as_millis().to_string();
    // AlterConfigs replaces the topic's whole configuration: compaction is
    // named again.
    let settings = [
        ("cleanup.policy", "compact"),
        ("segment.ms", "100"),
        ("min.cleanable.dirty.ratio", "0.01"),
        ("min.compaction.lag.ms", "0"),
        ("delete.retention.ms", ms.as_str()),
    ];
    set_topic_config(brokers, topic, &settings).await;
}

/// Set `topic`'s configuration to `settings` (AlterConfigs: what they do
/// not name goes back to the broker's default).
pub async fn set_topic_config(brokers: &str, topic: &str, settings: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let change = settings
        .iter()
        .fold(AlterConfig::new(ResourceSpecifier::Topic(topic)), |c, (k, v)| {
            c.set(k, v)
        });
    let answer = admin
        .alter_configs(&[change], &AdminOptions::new())
        .await
        .expect("alter configs");
    assert!(
        answer.iter().all(|r| r.is_ok()),
        "alter configs of {topic}: {answer:?}"
    );
}

/// What `topic` holds now, from each partition's start to its end: every
/// record's partition, key and whether it is a tombstone; and how many
/// offsets the partitions span (high minus low watermark), which is more
/// than the records once the broker has compacted some away.
pub fn log_now(brokers: &str, topic: &str) -> (Vec<(i32, Vec<u8>, bool)>, i64) {
    let mut kafka = kairos::Config::default().kafka;
    kafka.brokers = brokers.to_string();
    let mut records = Vec::new();
    kairos::kafka::read_to_end(
        &kafka,
        &unique("log-now"),
        topic,
        None,
        Duration::from_secs(30),
        |m| {
            records.push((
                m.partition(),
                m.key().unwrap_or_default().to_vec(),
                m.payload().is_none(),
            ))
        },
    )
    .expect("read to end");
    (records, record_count(brokers, topic))
}

/// A producer writing as a transactional application does: each record in
/// a transaction of its own, committed or aborted.
pub struct TransactionalWriter {
    producer: rdkafka::producer::FutureProducer,
}

impl TransactionalWriter {
    /// A producer with a `transactional.id` of its own (from `name`), its
    /// transactions initialised.
    pub fn new(brokers: &str, name: &str) -> TransactionalWriter {
        use rdkafka::producer::Producer as _;
        let producer: rdkafka::producer::FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("transactional.id", unique(name))
            .create()
            .expect("a transactional producer");
        producer
            .init_transactions(TRANSACTION_TIMEOUT)
            .expect("init transactions");
        TransactionalWriter { producer }
    }

    /// Write `rec` to `partition` in a transaction, then commit it, or
    /// abort it when `commit` is false.
    pub async fn write(&self, rec: &kairos::wire::OwnedRecord, partition: i32, commit: bool) {
        self.open(rec, partition).await;
        self.end(commit);
    }

    /// Begin a transaction and write `rec` to `partition` in it (acknowledged,
    /// not committed: [`TransactionalWriter::end`] ends it).
    pub async fn open(&self, rec: &kairos::wire::OwnedRecord, partition: i32) {
        use rdkafka::producer::Producer as _;
        self.producer.begin_transaction().expect("begin");
        kairos::kafka::send(&self.producer, rec, Some(partition))
            .await
            .expect("written");
    }

    /// Commit the open transaction, or abort it when `commit` is false.
    pub fn end(&self, commit: bool) {
        use rdkafka::producer::Producer as _;
        if commit {
            self.producer
                .commit_transaction(TRANSACTION_TIMEOUT)
                .expect("committed");
        } else {
            self.producer
                .abort_transaction(TRANSACTION_TIMEOUT)
                .expect("aborted");
        }
    }
}

/// How long a transaction call may take.
const TRANSACTION_TIMEOUT: Duration = Duration::from_secs(30);
