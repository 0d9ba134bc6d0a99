//! Helpers shared by the integration tests: a real Kafka-protocol broker
//! process per test, unique names, waiting on conditions with a deadline,
//! and reading topics back.
#![allow(dead_code)]

pub mod events;

/// What a handler under test records, shared with the test.
pub type Recorded<T> = std::sync::Arc<std::sync::Mutex<Vec<T>>>;
pub mod system;

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kairos::Config;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::OwnedMessage;
use rdkafka::producer::{BaseProducer, Producer as _};
use rdkafka::{Message, Offset, TopicPartitionList};

/// The broker binary: `$KAIROS_NISSHI_BIN`, else the install script's cache.
pub fn broker_binary() -> PathBuf {
    if let Ok(p) = std::env::var("KAIROS_NISSHI_BIN") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("KAIROS_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let base = std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache"));
            base.join("kairos")
        });
    let bin = cache.join("nisshi-0.8.1/bin/nisshi");
    assert!(
        bin.exists(),
        "test broker not found at {}: run ./scripts/test.sh (or scripts/install-broker.sh) first",
        bin.display()
    );
    bin
}

/// Storage for a broker: in memory, or a sqlite file that survives a restart.
#[derive(Clone, Debug)]
pub enum Storage {
    /// Nothing survives the process.
    Memory,
    /// Records survive a kill -9 and restart: the broker runs in this
    /// directory (kept across restarts) with its database at `data/broker.db`.
    Sqlite(PathBuf),
}

/// A broker process listening on 127.0.0.1, stopped when dropped, and also
/// when the test process dies (it watches a pipe from us; see `spawn`).
pub struct Broker {
    /// Port on 127.0.0.1.
    pub port: u16,
    /// The watchdog shell that owns the broker process.
    child: Child,
    /// Closing this pipe makes the watchdog kill the broker.
    lifeline: Option<ChildStdin>,
    /// The broker's working directory (it reads a `.env` from there).
    dir: tempfile::TempDir,
    /// Where its data lives.
    storage: Storage,
}

impl Broker {
    /// Start an in-memory broker on a free port and wait until it answers.
    pub fn start() -> Broker {
        capture_logs();
        Self::start_with(Storage::Memory, free_port())
    }

    /// Start a broker with the given storage on the given port.
    pub fn start_with(storage: Storage, port: u16) -> Broker {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("tcp://127.0.0.1:{port}");
        let (engine, workdir) = match &storage {
            Storage::Memory => ("memory://nisshi/".to_string(), dir.path().to_path_buf()),
            Storage::Sqlite(d) => {
                std::fs::create_dir_all(d.join("data")).expect("broker data dir");
                // nisshi takes a path relative to its working directory.
                ("sqlite://data/broker.db".to_string(), d.clone())
            }
        };
        let log = dir.path().join("broker.log");
        // The watchdog: run the broker in the background; when our end of
        // its stdin closes (we dropped the Broker, or this test process died
        // in any way, SIGKILL included), kill the broker.
        let script = r#"
            exec 3<&0
            "$@" </dev/null >"$BROKER_LOG" 2>&1 &
            b=$!
            ( read -r _ <&3; kill -9 "$b" 2>/dev/null ) &
            w=$!
            wait "$b"
            kill "$w" 2>/dev/null
        "#;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("broker")
            .arg(broker_binary())
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .args(["--storage-engine", &engine])
            .args(["--group-initial-rebalance-delay", "0s", "--silent"])
            .env("BROKER_LOG", &log)
            .current_dir(&workdir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn broker");
        let lifeline = child.stdin.take();
        let broker = Broker {
            port,
            child,
            lifeline,
            dir,
            storage,
        };
        broker.wait_ready(Duration::from_secs(30));
        broker
    }

    /// `host:port` for `bootstrap.servers`.
    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn wait_ready(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "broker did not listen on port {} within {timeout:?}; log:\n{}",
                self.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Listening is not yet serving: wait for a metadata answer.
        let p: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("probe client");
        let left = deadline.saturating_duration_since(Instant::now());
        p.client()
            .fetch_metadata(None, left)
            .unwrap_or_else(|e| panic!("broker not answering metadata: {e}; log:\n{}", self.log()));
    }

    /// The broker's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("broker.log")).unwrap_or_default()
    }

    /// Kill the broker with SIGKILL and wait for it to be gone.
    pub fn kill(mut self) -> (Storage, u16) {
        self.stop();
        (self.storage.clone(), self.port)
    }

    fn stop(&mut self) {
        if let Some(mut l) = self.lifeline.take() {
            let _ = l.write_all(b"stop\n");
        }
        let _ = self.child.wait();
    }

    /// A configuration pointing at this broker, with topic names unique to
    /// this test and small partition counts.
    pub fn config(&self) -> Config {
        let mut cfg = Config::default();
        cfg.kafka.brokers = self.bootstrap();
        cfg.kafka.produce_timeout = Duration::from_secs(10);
        fresh_topics(&mut cfg);
        cfg
    }
}

/// Topic names of their own for `cfg` (one work topic), 3 schedule and 3
/// work partitions.
pub fn fresh_topics(cfg: &mut Config) {
    let p = unique("t");
    cfg.topics.schedule = format!("{p}.schedule");
    cfg.topics.changelog = format!("{p}.changelog");
    cfg.topics.dead_letter = format!("{p}.dead");
    cfg.topics.held = format!("{p}.held");
    cfg.topics.work = vec![format!("{p}.jobs")];
    cfg.topics.schedule_partitions = 3;
    cfg.topics.work_partitions = 3;
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
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
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
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
/// watermark), as the broker reports it now.
pub fn record_count(brokers: &str, topic: &str) -> i64 {
    let consumer = reader(brokers, "counter", &[]);
    partitions(&consumer, topic)
        .into_iter()
        .map(|p| {
            let (lo, hi) = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .expect("watermarks");
            hi - lo
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
/// (partitions with no commit count as 0).
pub fn committed(brokers: &str, group: &str, topic: &str) -> i64 {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .create()
        .expect("client");
    let mut tpl = TopicPartitionList::new();
    for p in partitions(&consumer, topic) {
        tpl.add_partition(topic, p);
    }
    let c = consumer
        .committed_offsets(tpl, Duration::from_secs(10))
        .expect("committed");
    c.elements()
        .iter()
        .filter_map(|e| e.offset().to_raw())
        .filter(|o| *o >= 0)
        .sum()
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
