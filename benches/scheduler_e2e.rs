//! End to end through Apache Kafka (as in the integration tests):
//! the scheduler's throughput and its lateness, each against the broker's
//! raw pipe measured in the same run.
//!
//! ```text
//! cargo bench --bench scheduler_e2e                 # N = 100,000; 10,000 jobs/s for 10 s
//! cargo bench --bench scheduler_e2e -- 20000        # N = 20,000
//! KAIROS_BENCH_RATE=5000 KAIROS_BENCH_SECS=5 cargo bench --bench scheduler_e2e   # one rate
//! KAIROS_BENCH_RATE=10000,7500,5000 cargo bench --bench scheduler_e2e          # a ladder
//! KAIROS_BENCH_ONLY=throughput cargo bench --bench scheduler_e2e   # or `lateness`
//! KAIROS_BENCH_ONLY=drain cargo bench --bench scheduler_e2e        # raw, drain and durable rounds only
//! KAIROS_BENCH_LEAD_SECS=30 cargo bench --bench scheduler_e2e      # durable round: run-at 30 s after the first write
//! KAIROS_BENCH_DURABLE_FIRST=1 cargo bench --bench scheduler_e2e    # durable round: jobs written before the scheduler starts
//! KAIROS_BENCH_LATENESS_LEAD_MS=12000 cargo bench --bench scheduler_e2e  # lateness: jobs written 12 s ahead (2 s)
//! KAIROS_BENCH_INGEST_BATCH=8000 KAIROS_BENCH_READ_AHEAD=8000 cargo bench --bench scheduler_e2e  # ingest_batch, queued.min.messages
//! ```
//!
//! **(a) Throughput.** N past-due jobs (36-char key, 100-byte payload,
//! headers `kairos-run-at` = a past epoch-ms, `kairos-topic` = the work topic)
//! are written to the schedule topic with as many writes in flight as
//! librdkafka queues, while a scheduler runs in this process (default
//! scheduler settings, its own sled store under /tmp). A consumer counts the
//! records arriving on the work topic. Fired jobs/s = N / (first write → N-th
//! record consumed). Baseline: the same producer (Kairos's producer settings:
//! idempotent, acks=all, linger 5 ms) writes N identical records to a topic
//! of the same shape and the same kind of consumer reads them back: the
//! broker's raw pipe. Each round (`KAIROS_BENCH_ROUNDS`, 2) runs raw,
//! drain, kairos, relay.
//!
//! Two Kairos measures. *Pipelined* (the line "throughput ratio"): the
//! writer, the scheduler and the reader all run at once, so this process does
//! twice the raw pipe's client work (two producers, two consumers) on the
//! same cores. *Drain* (the line "drain ratio"): the N jobs are written first
//! (untimed); a scheduler then starts and is timed from the first job it
//! ingests to the last fire the broker acknowledged (its status, read every
//! millisecond). The scheduler then consumes N records and produces N, which
//! is the raw pipe's client work. That is the scheduler's own fire rate, and
//! the target is judged on it. The work topic is read back afterwards to
//! check that every job arrived exactly once.
//! For reference only (not the target's baseline), each round also runs a
//! bare relay: the same records written to one topic, copied by a plain
//! consumer → producer loop to a second topic and read there. That is the
//! broker work any scheduler in the path adds (in, out, in, out), with no
//! scheduling at all. And a second drain with the rule "a cancel written
//! before the run-at wins" switched off (jobs fire as soon as they are due,
//! without first reading their partition up to their run-at): what the
//! rule costs.
//!
//! *Durable* (the line "durable path"): the drain's jobs all fire from
//! memory (due on arrival, they never touch the store), so a round of their
//! own measures the path most jobs take. N jobs are written to the schedule
//! topic due at one instant 20 s ahead (`KAIROS_BENCH_LEAD_SECS`), while a
//! scheduler runs: each goes to the changelog and the store (flushed)
//! before its offset is committed. At the run-at they fire, then are
//! tombstoned and deleted. Timed: ingest (first job ingested → the N-th
//! persisted) and fire (run-at → last fire acknowledged); the ratio is N
//! over their sum against the raw pipe's rate.
//!
//! **(b) Lateness.** Jobs due at a steady rate (10,000 per second) for
//! `KAIROS_BENCH_SECS` (10), run-ats spread evenly, each written
//! 2 s before its run-at. Lateness = the time a consumer receives the fired
//! record − run-at, and the fire time − run-at (the issue's definition): the
//! fired record's CreateTime, stamped by the scheduler's producer when it
//! fires, − run-at. Both get a verdict against the 10 ms target. Baseline: the raw
//! pipe's latency at the same rate, each record written at its "run-at" to a
//! plain topic: the floor any scheduler on this broker and producer sees.
//! The same jobs then go through a scheduler with the rule "a cancel
//! written before the run-at wins" switched off (it fires jobs as soon as
//! they are due, without first reading their schedule partition up to
//! their run-at): the line "cost of ..." compares the two.
//! When 10,000/s is not sustained (a job fires over 1 s late: a backlog is
//! building), the next lower rate of `KAIROS_BENCH_RATE` (default
//! 10000,5000,2500,1000) is tried, until one is.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use support::{job_count, knobs, now_ms, runtime};

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::Broker;
use kairos::scheduler::Scheduler;
use kairos::wire::{self, header};
use kairos::Config;
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use rdkafka::consumer::Consumer;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use rdkafka::Message;

const PAYLOAD_BYTES: usize = 100;
/// Written this long before the run-at in the lateness run
/// (`KAIROS_BENCH_LATENESS_LEAD_MS`; past the run's length, every job is
/// written before the first is due).
const LEAD_MS: i64 = 2000;
const TARGET_THROUGHPUT_RATIO: f64 = 0.5;
const TARGET_P99_MS: f64 = 10.0;
/// A rate is sustained when no job fires later than this (no backlog builds).
const SUSTAINED_MAX_MS: f64 = 1000.0;

// ------------------------------------------------------------------ settings

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as i64
}

// ------------------------------------------------------------------ records

/// Keys and payloads, made before the clock starts.
struct Bodies {
    keys: Vec<String>,
    payloads: Vec<Vec<u8>>,
}

impl Bodies {
    fn new(n: usize, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let keys = (0..n)
            .map(|_| {
                let mut b = [0u8; 16];
                rng.fill_bytes(&mut b);
                uuid::Builder::from_random_bytes(b)
                    .into_uuid()
                    .hyphenated()
                    .to_string()
            })
            .collect();
        // A few distinct payloads are enough; every record carries 100 bytes.
        let payloads = (0..64)
            .map(|_| {
                let mut p = vec![0u8; PAYLOAD_BYTES];
                rng.fill_bytes(&mut p);
                p
            })
            .collect();
        Bodies { keys, payloads }
    }
}

/// Sends records to one topic with many in flight; a full librdkafka queue
/// waits for the oldest delivery. Remembers every delivery to check at the end.
struct Writer {
    producer: FutureProducer,
    topic: String,
    work_topic: String,
    in_flight: VecDeque<DeliveryFuture>,
    failed: u64,
}

impl Writer {
    fn new(cfg: &Config, topic: &str) -> Self {
        let mut c = kairos::kafka::producer_config(&cfg.kafka, "kairos-bench-writer");
        c.set("queue.buffering.max.messages", "200000");
        let producer: FutureProducer = c.create().expect("bench producer");
        // Warm up before any clock starts: connection, producer id (one record
        // to the dead-letter topic, which nothing here reads) and the
        // destination's metadata.
        let warm = FutureRecord::<str, str>::to(&cfg.topics.dead_letter)
            .key("warm-up")
            .payload("");
        futures::executor::block_on(producer.send(warm, Duration::from_secs(10))).expect("warm-up write");
        producer
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("metadata");
        Writer {
            producer,
            topic: topic.to_string(),
            work_topic: cfg.topics.work[0].clone(),
            in_flight: VecDeque::new(),
            failed: 0,
        }
    }

    /// Write one job record: `kairos-run-at` and `kairos-topic` as any client would.
    fn send(&mut self, key: &str, payload: &[u8], run_at_ms: i64) {
        let run_at = run_at_ms.to_string();
        let headers = OwnedHeaders::new_with_capacity(2)
            .insert(Header {
                key: header::RUN_AT,
                value: Some(run_at.as_bytes()),
            })
            .insert(Header {
                key: header::TOPIC,
                value: Some(self.work_topic.as_bytes()),
            });
        let mut rec = FutureRecord::to(&self.topic)
            .key(key)
            .payload(payload)
            .headers(headers);
        loop {
            match self.producer.send_result(rec) {
                Ok(f) => {
                    self.in_flight.push_back(f);
                    break;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    rec = back;
                    match self.in_flight.pop_front() {
                        Some(f) => self.failed += settle(f),
                        None => std::thread::sleep(Duration::from_millis(1)),
                    }
                }
                Err((e, _)) => panic!("produce to {}: {e}", self.topic),
            }
        }
        // Keep the bookkeeping small: settle deliveries that are done.
        while self.in_flight.len() > 100_000 {
            let f = self.in_flight.pop_front().expect("non-empty");
            self.failed += settle(f);
        }
    }

    /// Wait for every delivery; returns the number that failed.
    fn finish(mut self) -> u64 {
        while let Some(f) = self.in_flight.pop_front() {
            self.failed += settle(f);
        }
        self.failed
    }
}

/// Wait for one delivery: 0 if it succeeded, 1 if not.
fn settle(f: DeliveryFuture) -> u64 {
    match futures::executor::block_on(f) {
        Ok(Ok(_)) => 0,
        _ => 1,
    }
}

// ------------------------------------------------------------------ reading

/// One record as the reader saw it.
#[derive(Clone, Copy)]
struct Seen {
    /// When the reader got it, µs since the epoch.
    at_us: i64,
    /// Its `kairos-run-at`, ms since the epoch.
    run_at_ms: i64,
    /// Its CreateTime, ms since the epoch.
    created_ms: i64,
    /// A hash of its `kairos-id` (for counting duplicates), 0 if none.
    id: u128,
}

/// A consumer reading every partition of `topic` from the start on its own
/// thread until it has `target` records or `deadline` passes.
struct Reader {
    ready: mpsc::Receiver<()>,
    done: JoinHandle<Vec<Seen>>,
}

fn reader(brokers: &str, topic: &str, target: usize, deadline: Instant) -> Reader {
    reader_from(brokers, topic, target, deadline, true)
}

/// [`reader`], optionally without checking that `topic` starts empty (to
/// read back records written before it started).
fn reader_from(brokers: &str, topic: &str, target: usize, deadline: Instant, empty: bool) -> Reader {
    let (tx, rx) = mpsc::channel();
    let brokers = brokers.to_string();
    let topic = topic.to_string();
    let done = std::thread::spawn(move || {
        let consumer = common::reader(&brokers, "bench-reader", &[("enable.partition.eof", "false")]);
        for p in common::assign_from_start(&consumer, &topic) {
            // Connect to the partition's leader before the clock starts.
            consumer
                .fetch_watermarks(&topic, p, Duration::from_secs(10))
                .expect("watermarks");
        }
        let warm = Instant::now() + Duration::from_millis(300);
        while empty && Instant::now() < warm {
            if let Some(m) = consumer.poll(Duration::from_millis(20)) {
                panic!("{topic} is not empty at start: {:?}", m.map(|m| m.offset()));
            }
        }
        let _ = tx.send(());
        let mut out = Vec::with_capacity(target);
        while out.len() < target && Instant::now() < deadline {
            let Some(m) = consumer.poll(Duration::from_millis(20)) else {
                continue;
            };
            let at_us = now_us();
            let m = m.expect("consume");
            let mut run_at_ms = 0;
            let mut id = 0u128;
            if let Some(hs) = m.headers() {
                for h in hs.iter() {
                    let Some(v) = h.value else { continue };
                    if h.key == header::RUN_AT {
                        let text = std::str::from_utf8(v).expect("utf-8 run-at");
                        run_at_ms = wire::parse_time(text).expect("run-at").timestamp_millis();
                    } else if h.key == header::ID {
                        id = std::str::from_utf8(v)
                            .ok()
                            .and_then(|s| s.parse::<kairos::JobId>().ok())
                            .map(|j| j.uuid().as_u128())
                            .unwrap_or(0);
                    }
                }
            }
            out.push(Seen {
                at_us,
                run_at_ms,
                created_ms: m.timestamp().to_millis().unwrap_or(0),
                id,
            });
        }
        out
    });
    Reader { ready: rx, done }
}

impl Reader {
    fn wait_ready(&self) {
        self.ready
            .recv_timeout(Duration::from_secs(30))
            .expect("reader ready");
    }

    /// Wait until it has every record or its deadline passed.
    fn finish(self) -> Vec<Seen> {
        self.done.join().expect("reader thread")
    }
}

// ------------------------------------------------------------------ scheduler

struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kairos::scheduler::SchedulerError>>,
    handle: kairos::scheduler::SchedulerHandle,
    /// Its admin endpoint (on a free loopback port).
    admin: Option<std::net::SocketAddr>,
    _dir: tempfile::TempDir,
}

/// Topics created and a scheduler running in this process, owning every
/// schedule partition.
/// Whether the scheduler waits for a job's schedule partition to be read up
/// to its run-at before firing it (so a cancel written before then wins).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    On,
    /// Fires as soon as jobs are due: the rule's cost is measured against it.
    Off,
}

/// Whether a run scrapes the scheduler's `/metrics` meanwhile (every
/// [`SCRAPE_EVERY`]), to measure what serving metrics costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scraped {
    Yes,
    No,
}

/// How often a scraped run scrapes (Prometheus's default is every 15 s).
const SCRAPE_EVERY: Duration = Duration::from_millis(100);

fn start_scheduler(rt: &tokio::runtime::Runtime, broker: &Broker, rule: Rule) -> (Config, Running) {
    let cfg = scheduler_config(rt, broker);
    let running = spawn_scheduler(rt, &cfg, rule);
    let n = cfg.topics.schedule_partitions as usize;
    common::wait_for("scheduler to own its partitions", Duration::from_secs(60), || {
        (running.handle.stats().owned.len() == n).then_some(())
    });
    (cfg, running)
}

/// Fresh topics, and a config for a scheduler with its own store and group.
fn scheduler_config(rt: &tokio::runtime::Runtime, broker: &Broker) -> Config {
    let mut cfg = broker.config();
    cfg.scheduler.group_id = common::unique("bench-sched");
    cfg.scheduler.admin.listen = Some("127.0.0.1:0".parse().expect("address"));
    rt.block_on(kairos::topics::init(&cfg)).expect("topics");
    cfg
}

/// A scheduler running in this process (store in a temp dir), not waited for.
fn spawn_scheduler(rt: &tokio::runtime::Runtime, cfg: &Config, rule: Rule) -> Running {
    let dir = tempfile::Builder::new()
        .prefix("kairos-bench-e2e-")
        .tempdir_in(knobs::text("KAIROS_BENCH_DIR").unwrap_or_else(|| "/tmp".into()))
        .expect("temp dir");
    let mut cfg = cfg.clone();
    cfg.scheduler.data_dir = dir.path().join("store");
    support::scheduler_knobs(&mut cfg);
    let mut s = Scheduler::builder(&cfg).build().expect("scheduler");
    if rule == Rule::Off {
        s = s.fire_unread();
    }
    let handle = s.handle();
    let admin = s.admin_addr();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = rt.spawn(s.run_until(async {
        let _ = rx.await;
    }));
    Running {
        stop: Some(tx),
        task,
        handle,
        admin,
        _dir: dir,
    }
}

impl Running {
    fn stop(mut self, rt: &tokio::runtime::Runtime) {
        let _ = self.stop.take().expect("once").send(());
        rt.block_on(self.task)
            .expect("scheduler task")
            .expect("scheduler ran cleanly");
    }
}

/// A plain topic shaped like the work topic (same partitions), for the raw pipe.
fn raw_topic(rt: &tokio::runtime::Runtime, broker: &Broker) -> (Config, String) {
    let cfg = broker.config();
    rt.block_on(kairos::topics::init(&cfg)).expect("topics");
    let t = cfg.topics.work[0].clone();
    (cfg, t)
}

// ------------------------------------------------------------------ (a) throughput

struct Throughput {
    secs: f64,
    /// First write → every write acknowledged.
    written_secs: f64,
    /// Start of the clock → every job ingested (Kairos rounds only).
    ingested_secs: Option<f64>,
    duplicates: usize,
}

impl Throughput {
    /// Timings from the first write (`t0`), the last acknowledged write and
    /// the records read back, µs since the epoch.
    fn measured(t0: i64, written: i64, seen: &[Seen]) -> Throughput {
        let last = seen.iter().map(|s| s.at_us).max().expect("records");
        Throughput {
            secs: (last - t0) as f64 / 1e6,
            written_secs: (written - t0) as f64 / 1e6,
            ingested_secs: None,
            duplicates: 0,
        }
    }

    fn rate(&self, n: u64) -> f64 {
        n as f64 / self.secs
    }
}

/// Records seen more than once (by `kairos-id`).
fn duplicates(seen: &[Seen]) -> usize {
    seen.len() - seen.iter().map(|s| s.id).collect::<HashSet<u128>>().len()
}

fn throughput_raw(rt: &tokio::runtime::Runtime, broker: &Broker, bodies: &Bodies) -> Throughput {
    let n = bodies.keys.len();
    let (cfg, topic) = raw_topic(rt, broker);
    let r = reader(
        &cfg.kafka.brokers,
        &topic,
        n,
        Instant::now() + Duration::from_secs(600),
    );
    r.wait_ready();
    let w = Writer::new(&cfg, &topic);
    let t0 = now_us();
    let written = write_past_due(w, bodies, "raw");
    let seen = r.finish();
    assert_eq!(seen.len(), n, "raw records read back");
    Throughput::measured(t0, written, &seen)
}

/// The reference relay: records written to the schedule topic, copied to the
/// work topic by a plain consumer → producer loop, read there.
fn throughput_relay(rt: &tokio::runtime::Runtime, broker: &Broker, bodies: &Bodies) -> Throughput {
    let n = bodies.keys.len();
    let (cfg, out) = raw_topic(rt, broker);
    let input = cfg.topics.schedule.clone();
    let deadline = Instant::now() + Duration::from_secs(600);
    let r = reader(&cfg.kafka.brokers, &out, n, deadline);
    r.wait_ready();
    let brokers = cfg.kafka.brokers.clone();
    let producer_cfg = kairos::kafka::producer_config(&cfg.kafka, "kairos-bench-relay");
    let (ready_tx, ready_rx) = mpsc::channel();
    let relay = std::thread::spawn(move || {
        let consumer = common::reader(&brokers, "bench-relay", &[("enable.partition.eof", "false")]);
        common::assign_from_start(&consumer, &input);
        let producer: FutureProducer = producer_cfg.create().expect("relay producer");
        producer
            .client()
            .fetch_metadata(Some(&out), Duration::from_secs(10))
            .expect("metadata");
        let _ = ready_tx.send(());
        let mut acks = Vec::with_capacity(n);
        while acks.len() < n && Instant::now() < deadline {
            let Some(m) = consumer.poll(Duration::from_millis(20)) else {
                continue;
            };
            let m = m.expect("relay consume");
            let mut rec = FutureRecord::to(&out).key(m.key().unwrap_or_default());
            if let Some(v) = m.payload() {
                rec = rec.payload(v);
            }
            if let Some(h) = m.headers() {
                rec = rec.headers(h.detach());
            }
            loop {
                match producer.send_result(rec) {
                    Ok(f) => {
                        acks.push(f);
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        rec = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err((e, _)) => panic!("relay produce: {e}"),
                }
            }
        }
        acks.into_iter().map(settle).sum::<u64>()
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("relay ready");
    let w = Writer::new(&cfg, &cfg.topics.schedule);
    let t0 = now_us();
    let written = write_past_due(w, bodies, "relay");
    let seen = r.finish();
    assert_eq!(relay.join().expect("relay thread"), 0, "relay writes failed");
    assert_eq!(seen.len(), n, "relayed records read back");
    Throughput::measured(t0, written, &seen)
}

/// Write every body as a record due a second ago; returns when the last
/// write was acknowledged (µs since the epoch).
fn write_past_due(w: Writer, bodies: &Bodies, what: &str) -> i64 {
    write_due_at(w, bodies, now_ms() - 1000, what)
}

/// Write every body as a record due at `run_at` (epoch ms); returns when the
/// last write was acknowledged (µs since the epoch).
fn write_due_at(mut w: Writer, bodies: &Bodies, run_at: i64, what: &str) -> i64 {
    for (i, k) in bodies.keys.iter().enumerate() {
        w.send(k, &bodies.payloads[i % bodies.payloads.len()], run_at);
    }
    let failed = w.finish();
    let written = now_us();
    assert_eq!(failed, 0, "{what} writes failed");
    written
}

fn throughput_kairos(rt: &tokio::runtime::Runtime, broker: &Broker, bodies: &Bodies) -> Throughput {
    let n = bodies.keys.len();
    let (cfg, running) = start_scheduler(rt, broker, Rule::On);
    let work = cfg.topics.work[0].clone();
    let r = reader(
        &cfg.kafka.brokers,
        &work,
        n,
        Instant::now() + Duration::from_secs(600),
    );
    r.wait_ready();
    // Watch ingest progress from another thread while this one writes.
    let handle = running.handle.clone();
    let watch_stop = Arc::new(AtomicBool::new(false));
    let ws = watch_stop.clone();
    let w = Writer::new(&cfg, &cfg.topics.schedule);
    let t0 = now_us();
    let watcher = std::thread::spawn(move || {
        while !ws.load(Ordering::Relaxed) {
            if handle.stats().ingested >= n as u64 {
                return Some(now_us());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    });
    let written = write_past_due(w, bodies, "schedule");
    let seen = r.finish();
    let ingested = {
        watch_stop.store(true, Ordering::Relaxed);
        watcher.join().expect("watcher")
    };
    assert!(
        seen.len() >= n,
        "only {} of {n} jobs fired within the deadline; status {:?}",
        seen.len(),
        running.handle.stats()
    );
    let st = running.handle.stats();
    running.stop(rt);
    eprintln!("  kairos status after: {st:?}");
    Throughput {
        ingested_secs: ingested.map(|t| (t - t0) as f64 / 1e6),
        duplicates: duplicates(&seen),
        ..Throughput::measured(t0, written, &seen)
    }
}

/// The scheduler draining a backlog: N past-due jobs are written to the
/// schedule topic first (untimed), then a scheduler starts. Timed from the
/// first job it ingests to the last fire the broker acknowledged (its
/// status, looked at every millisecond): the scheduler alone consumes N
/// records and produces N, the same client work as the raw pipe's writer
/// and reader. The work topic is read back afterwards (untimed) to check
/// that every job arrived once.
fn throughput_drain(
    rt: &tokio::runtime::Runtime,
    broker: &Broker,
    bodies: &Bodies,
    rule: Rule,
    scraped: Scraped,
) -> Throughput {
    let n = bodies.keys.len();
    let cfg = scheduler_config(rt, broker);
    let w = Writer::new(&cfg, &cfg.topics.schedule);
    write_past_due(w, bodies, "backlog");
    let running = spawn_scheduler(rt, &cfg, rule);
    let scraper = (scraped == Scraped::Yes)
        .then(|| common::Scraper::start(running.admin.expect("admin endpoint"), SCRAPE_EVERY));
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut first_ingest = None;
    let mut first_fire = None;
    let mut all_ingested = None;
    let fired_at = loop {
        let st = running.handle.stats();
        let now = now_us();
        if first_ingest.is_none() && st.ingested > 0 {
            first_ingest = Some(now);
        }
        if first_fire.is_none() && st.fired > 0 {
            first_fire = Some(now);
        }
        if all_ingested.is_none() && st.ingested >= n as u64 {
            all_ingested = Some(now);
        }
        if st.fired >= n as u64 {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "backlog not fired in time; status {st:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    if let Some(s) = scraper {
        assert!(s.finish() > 0, "the endpoint was scraped");
    }
    let t0 = first_ingest.expect("ingested before fired");
    eprintln!(
        "  drain: first fire acked at {:.3} s",
        first_fire.map_or(f64::NAN, |t| (t - t0) as f64 / 1e6)
    );
    let seen = reader_from(&cfg.kafka.brokers, &cfg.topics.work[0], n, deadline, false).finish();
    assert_eq!(seen.len(), n, "drained jobs read back");
    let st = running.handle.stats();
    running.stop(rt);
    eprintln!("  drain status after: {st:?}");
    Throughput {
        secs: (fired_at - t0) as f64 / 1e6,
        written_secs: 0.0,
        ingested_secs: all_ingested.map(|t| (t - t0) as f64 / 1e6),
        duplicates: duplicates(&seen),
    }
}

/// The durable path: N jobs written ahead of their run-at go through the
/// changelog and the store (flushed) before their offsets are committed,
/// wait, and are then fired, tombstoned and deleted. All are due at one
/// instant `lead` after the first write, far enough ahead that ingest ends
/// before it. Timed: ingest (first job ingested → the N-th persisted) and
/// fire (the run-at → the last fire acknowledged).
struct Durable {
    ingest_secs: f64,
    fire_secs: f64,
    /// Ingest ended this long before the run-at (negative: after it, and
    /// the fire time then includes ingest).
    slack_secs: f64,
    duplicates: usize,
    fired_direct: u64,
    /// What `kairos stats --json` asks (the topics from Kafka, the
    /// scheduler's `/status`), timed in ms: with no job pending, and with
    /// all N pending; and the pending count it saw then.
    stats_empty_ms: f64,
    stats_full_ms: f64,
    stats_pending: u64,
}

/// Ask what `kairos stats --json` asks; (ms taken, jobs pending it says).
fn kairos_stats(cfg: &Config, admin: std::net::SocketAddr) -> (f64, u64) {
    let t = Instant::now();
    kairos::overview::topics(cfg).expect("topic figures");
    let held = kairos::overview::schedulers(cfg, &[admin], false);
    assert!(held.unreachable.is_empty(), "{held:?}");
    (t.elapsed().as_secs_f64() * 1e3, held.pending)
}

fn throughput_durable(
    rt: &tokio::runtime::Runtime,
    broker: &Broker,
    bodies: &Bodies,
    lead: Duration,
) -> Durable {
    let n = bodies.keys.len() as u64;
    // Diagnostic: the jobs written before the scheduler starts, so that
    // ingest has the machine to itself (no stats timing "with no job
    // pending" then: 0).
    let written_first = knobs::set("KAIROS_BENCH_DURABLE_FIRST");
    let lead_ms = lead.as_millis() as i64;
    let (cfg, running, stats_empty_ms, run_at) = if written_first {
        let cfg = scheduler_config(rt, broker);
        let run_at = now_ms() + lead_ms;
        write_due_at(Writer::new(&cfg, &cfg.topics.schedule), bodies, run_at, "durable");
        let running = spawn_scheduler(rt, &cfg, Rule::On);
        (cfg, running, 0.0, run_at)
    } else {
        let (cfg, running) = start_scheduler(rt, broker, Rule::On);
        let (stats_empty_ms, _) = kairos_stats(&cfg, running.admin.expect("admin endpoint"));
        (cfg, running, stats_empty_ms, now_ms() + lead_ms)
    };
    let admin = running.admin.expect("admin endpoint");
    let handle = running.handle.clone();
    let watch_cfg = cfg.clone();
    let watcher = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(600);
        let (mut first, mut ingested, mut full) = (None, None, None);
        loop {
            let st = handle.stats();
            let now = now_us();
            if first.is_none() && st.ingested > 0 {
                first = Some(now);
            }
            if ingested.is_none() && st.ingested >= n {
                ingested = Some(now);
            }
            // Once all N wait (long before their run-at), time the stats.
            if full.is_none() && st.pending >= n && st.fired == 0 {
                full = Some(kairos_stats(&watch_cfg, admin));
            }
            if st.fired >= n {
                let full = full.expect("stats taken while all jobs were pending");
                return (first.expect("ingested"), ingested.expect("ingested"), now, full);
            }
            assert!(Instant::now() < deadline, "jobs not fired in time; status {st:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    if !written_first {
        write_due_at(Writer::new(&cfg, &cfg.topics.schedule), bodies, run_at, "durable");
    }
    let (first, ingested, fired, (stats_full_ms, stats_pending)) = watcher.join().expect("watcher");
    let seen = reader_from(
        &cfg.kafka.brokers,
        &cfg.topics.work[0],
        n as usize,
        Instant::now() + Duration::from_secs(600),
        false,
    )
    .finish();
    assert_eq!(seen.len(), n as usize, "durable jobs read back");
    let st = running.handle.stats();
    running.stop(rt);
    eprintln!("  durable status after: {st:?}");
    Durable {
        ingest_secs: (ingested - first) as f64 / 1e6,
        fire_secs: (fired - run_at * 1000) as f64 / 1e6,
        slack_secs: (run_at * 1000 - ingested) as f64 / 1e6,
        duplicates: duplicates(&seen),
        fired_direct: st.fired_direct,
        stats_empty_ms,
        stats_full_ms,
        stats_pending,
    }
}

// ------------------------------------------------------------------ (b) lateness

struct Lateness {
    /// Consume time − run-at, ms, sorted.
    consumed: Vec<f64>,
    /// CreateTime − run-at, ms, sorted.
    created: Vec<f64>,
    /// Records expected, records seen.
    expected: usize,
    /// Worst delay of a write behind its planned time, ms.
    write_lag_max_ms: i64,
    /// Writes per second achieved over the writing phase.
    write_rate: f64,
    /// Fires (records consumed) per second between the first and last run-at.
    fire_rate: f64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

/// Write `bodies` to `topic` at `rate`/s, record i with run-at `t0 + i/rate`,
/// written `lead_ms` before it; read `read_topic` back.
fn paced(cfg: &Config, topic: &str, read_topic: &str, bodies: &Bodies, rate: u64, lead_ms: i64) -> Lateness {
    let n = bodies.keys.len();
    let span_ms = (n as u64 * 1000) / rate;
    let deadline = Instant::now() + Duration::from_millis(span_ms + lead_ms as u64 + 60_000);
    let r = reader(&cfg.kafka.brokers, read_topic, n, deadline);
    r.wait_ready();
    let mut w = Writer::new(cfg, topic);
    let first_run_at = now_ms() + lead_ms + 200;
    let run_at = |i: usize| first_run_at + (i as i64 * 1000) / rate as i64;
    let mut i = 0;
    let mut lag_max = 0i64;
    let started = (first_run_at - lead_ms) * 1000;
    while i < n {
        let now = now_ms();
        while i < n && run_at(i) - lead_ms <= now {
            lag_max = lag_max.max(now_ms() - (run_at(i) - lead_ms));
            w.send(
                &bodies.keys[i],
                &bodies.payloads[i % bodies.payloads.len()],
                run_at(i),
            );
            i += 1;
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    let write_secs = (now_us() - started) as f64 / 1e6;
    let failed = w.finish();
    assert_eq!(failed, 0, "writes failed");
    let seen = r.finish();
    if let Some(path) = knobs::text("KAIROS_BENCH_DUMP") {
        let text: String = seen
            .iter()
            .map(|s| {
                format!(
                    "{} {} {}\n",
                    s.run_at_ms - first_run_at,
                    s.at_us - s.run_at_ms * 1000,
                    s.created_ms - s.run_at_ms
                )
            })
            .collect();
        std::fs::write(format!("{path}.{read_topic}"), text).expect("dump");
    }
    let mut consumed: Vec<f64> = seen
        .iter()
        .map(|s| (s.at_us - s.run_at_ms * 1000) as f64 / 1000.0)
        .collect();
    let mut created: Vec<f64> = seen.iter().map(|s| (s.created_ms - s.run_at_ms) as f64).collect();
    consumed.sort_by(f64::total_cmp);
    created.sort_by(f64::total_cmp);
    let last_seen = seen.iter().map(|s| s.at_us).max().unwrap_or(0);
    let fire_span = (last_seen - first_run_at * 1000) as f64 / 1e6;
    Lateness {
        expected: n,
        write_lag_max_ms: lag_max,
        write_rate: n as f64 / write_secs,
        fire_rate: seen.len() as f64 / fire_span.max(1e-3),
        consumed,
        created,
    }
}

fn report_lateness(name: &str, l: &Lateness) {
    let c = &l.consumed;
    println!(
        "  {name:<7} seen {}/{}  consume−run-at ms: p50 {:.1}  p99 {:.1}  max {:.1}  | CreateTime−run-at ms: p50 {:.0}  p99 {:.0}  max {:.0}",
        c.len(),
        l.expected,
        pct(c, 0.5),
        pct(c, 0.99),
        c.last().copied().unwrap_or(f64::NAN),
        pct(&l.created, 0.5),
        pct(&l.created, 0.99),
        l.created.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "          writes {:.0}/s (worst write {} ms behind plan), fires/reads {:.0}/s, early (<0 ms): {}",
        l.write_rate,
        l.write_lag_max_ms,
        l.fire_rate,
        c.iter().filter(|x| **x < 0.0).count()
    );
}

// ------------------------------------------------------------------ main

fn main() {
    if let Ok(filter) = std::env::var("KAIROS_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let n = job_count(100_000);
    // The lateness rates to try, highest first, until one is sustained.
    let rates = knobs::list_or("KAIROS_BENCH_RATE", &[10_000, 5_000, 2_500, 1_000]);
    let secs = knobs::u64_or("KAIROS_BENCH_SECS", 10).max(1);
    let rounds = knobs::u64_or("KAIROS_BENCH_ROUNDS", 2).max(1);
    let only = knobs::text("KAIROS_BENCH_ONLY").unwrap_or_default();
    let rt = runtime();
    let broker = Broker::own();
    println!(
        "scheduler_e2e: {}, classic group protocol, {} cores, {PAYLOAD_BYTES}-byte payloads, 36-char keys, \
         3 schedule / 3 work partitions, default scheduler settings",
        broker.describe(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );

    let mut summary: Vec<String> = Vec::new();
    if only.is_empty() || only == "throughput" || only == "drain" {
        let pipelined = only != "drain";
        println!(
            "(a) throughput: N = {n} past-due jobs, {rounds} round(s) of raw, drain{}",
            if pipelined { ", kairos, relay" } else { "" }
        );
        let bodies = Bodies::new(n as usize, 0x6b61_6972_6f73);
        let mut ratios = Vec::new();
        let mut raws = Vec::new();
        let mut kai = Vec::new();
        let mut relays = Vec::new();
        let mut drains = Vec::new();
        let mut drains_off = Vec::new();
        let mut drains_scraped = Vec::new();
        let mut durables = Vec::new();
        let lead = Duration::from_secs(knobs::u64_or("KAIROS_BENCH_LEAD_SECS", 20));
        for round in 1..=rounds {
            let raw = throughput_raw(&rt, &broker, &bodies);
            println!(
                "  round {round} raw    {:>9.0} records/s  ({:.2} s; writes acked at {:.2} s)",
                raw.rate(n),
                raw.secs,
                raw.written_secs
            );
            let d = throughput_drain(&rt, &broker, &bodies, Rule::On, Scraped::No);
            println!(
                "  round {round} drain  {:>9.0} fired/s    ({:.2} s from the first job ingested to the last fire acked, all ingested at {}, {} duplicates)",
                d.rate(n),
                d.secs,
                d.ingested_secs.map_or("?".into(), |s| format!("{s:.2} s")),
                d.duplicates
            );
            drains.push(d.rate(n) / raw.rate(n));
            // The same drain with the rule off: what waiting to have read a
            // job's partition up to its run-at costs here.
            let off = throughput_drain(&rt, &broker, &bodies, Rule::Off, Scraped::No);
            println!(
                "  round {round} drain, rule off {:>9.0} fired/s ({:.2} s; reference: fires as soon as due, a cancel not yet read loses)",
                off.rate(n),
                off.secs,
            );
            drains_off.push(off.rate(n) / raw.rate(n));
            // The same drain with its /metrics scraped every 100 ms.
            let scraped = throughput_drain(&rt, &broker, &bodies, Rule::On, Scraped::Yes);
            println!(
                "  round {round} drain, metrics scraped {:>9.0} fired/s ({:.2} s): on/off {:.2}x (target >= 0.95x)",
                scraped.rate(n),
                scraped.secs,
                scraped.rate(n) / d.rate(n)
            );
            drains_scraped.push(scraped.rate(n) / d.rate(n));
            let dur = throughput_durable(&rt, &broker, &bodies, lead);
            println!(
                "  round {round} durable: ingest {:>9.0} jobs/s ({:.2} s, persisted {:.1} s before the run-at), \
                 fire {:>9.0} fired/s ({:.2} s from the run-at), {} fired from memory, {} duplicates",
                n as f64 / dur.ingest_secs,
                dur.ingest_secs,
                dur.slack_secs,
                n as f64 / dur.fire_secs,
                dur.fire_secs,
                dur.fired_direct,
                dur.duplicates
            );
            println!(
                "  round {round} kairos stats --json with {} jobs pending: {:.0} ms, against {:.0} ms with none \
                 ({:.2}x; target < 1 s)",
                dur.stats_pending,
                dur.stats_full_ms,
                dur.stats_empty_ms,
                dur.stats_full_ms / dur.stats_empty_ms.max(0.001)
            );
            assert!(
                dur.slack_secs > 0.0,
                "ingest ended after the run-at: raise KAIROS_BENCH_LEAD_SECS"
            );
            durables.push((
                n as f64 / dur.ingest_secs / raw.rate(n),
                n as f64 / dur.fire_secs / raw.rate(n),
                n as f64 / (dur.ingest_secs + dur.fire_secs) / raw.rate(n),
            ));
            raws.push(raw.rate(n));
            if !pipelined {
                continue;
            }
            let k = throughput_kairos(&rt, &broker, &bodies);
            println!(
                "  round {round} kairos {:>9.0} fired/s    ({:.2} s; writes acked at {:.2} s, all ingested at {}, {} duplicates)",
                k.rate(n),
                k.secs,
                k.written_secs,
                k.ingested_secs.map_or("?".into(), |s| format!("{s:.2} s")),
                k.duplicates
            );
            let relay = throughput_relay(&rt, &broker, &bodies);
            println!(
                "  round {round} relay  {:>9.0} records/s  ({:.2} s; writes acked at {:.2} s; reference: a bare consume → produce hop)",
                relay.rate(n),
                relay.secs,
                relay.written_secs
            );
            ratios.push(k.rate(n) / raw.rate(n));
            kai.push(k.rate(n));
            relays.push(relay.rate(n));
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        if pipelined {
            let relay_line = format!(
                "reference: bare relay/raw = {:.2}, kairos/relay = {:.2} (relay {:.0} records/s, means): the hop through a second topic alone",
                mean(&relays) / mean(&raws),
                mean(&kai) / mean(&relays),
                mean(&relays)
            );
            println!("  {relay_line}");
            summary.push(relay_line);
            let ratio = mean(&ratios);
            let line = format!(
                "throughput ratio kairos/raw = {ratio:.2} (per round {}; kairos {:.0} fired/s vs raw {:.0} records/s, means) — target ≥ {TARGET_THROUGHPUT_RATIO}: {}",
                ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", "),
                mean(&kai),
                mean(&raws),
                support::pass(ratio >= TARGET_THROUGHPUT_RATIO)
            );
            println!("  {line}");
            summary.push(line);
        }
        let drain = mean(&drains);
        let line = format!(
            "drain ratio kairos/raw = {drain:.2} (per round {}): the scheduler alone consuming N and producing N, \
             the raw pipe's client work — target ≥ {TARGET_THROUGHPUT_RATIO}: {}",
            drains.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", "),
            support::pass(drain >= TARGET_THROUGHPUT_RATIO)
        );
        println!("  {line}");
        summary.push(line);
        let part = |f: fn(&(f64, f64, f64)) -> f64| durables.iter().map(f).collect::<Vec<_>>();
        let (ingest, fire, whole) = (part(|d| d.0), part(|d| d.1), part(|d| d.2));
        let line = format!(
            "durable path/raw = {:.2} (per round {}): jobs written ahead of their run-at, through changelog and \
             store, then fired; ingest {:.2}, fire {:.2} of the raw pipe's rate (reference: the drain's target ≥ {TARGET_THROUGHPUT_RATIO})",
            mean(&whole),
            whole.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", "),
            mean(&ingest),
            mean(&fire),
        );
        println!("  {line}");
        summary.push(line);
        let off = mean(&drains_off);
        let line = format!(
            "cost of 'a cancel written before the run-at wins' on the drain: {drain:.2} vs {off:.2} of the raw pipe with the rule off \
             (on/off = {:.2}; off per round {})",
            drain / off,
            drains_off.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", "),
        );
        println!("  {line}");
        summary.push(line);
        let line = format!(
            "metrics on/off on the drain (/metrics scraped every {SCRAPE_EVERY:?} / not scraped): {:.2} (per round {}) — target >= 0.95: {}",
            mean(&drains_scraped),
            drains_scraped.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", "),
            support::pass(mean(&drains_scraped) >= 0.95)
        );
        println!("  {line}");
        summary.push(line);
    }
    if only.is_empty() || only == "lateness" {
        for (k, rate) in rates.iter().copied().enumerate() {
            let total = (rate * secs) as usize;
            let lead_ms = knobs::u64_or("KAIROS_BENCH_LATENESS_LEAD_MS", LEAD_MS as u64) as i64;
            println!(
                "(b) lateness: {rate} due jobs/s for {secs} s ({total} jobs), each written {lead_ms} ms before its run-at"
            );
            let bodies = Bodies::new(total, 0x6c61_7465);
            let (raw_cfg, raw_t) = raw_topic(&rt, &broker);
            let raw = paced(&raw_cfg, &raw_t, &raw_t, &bodies, rate, 0);
            report_lateness("raw", &raw);
            // The same jobs through a scheduler with the rule on, then off
            // (jobs fire as soon as due, a cancel not yet read loses): what
            // the rule costs.
            let through_scheduler = |rule: Rule| {
                let (cfg, running) = start_scheduler(&rt, &broker, rule);
                let l = paced(
                    &cfg,
                    &cfg.topics.schedule,
                    &cfg.topics.work[0],
                    &bodies,
                    rate,
                    lead_ms,
                );
                let st = running.handle.stats();
                running.stop(&rt);
                (l, st)
            };
            let (kl, st) = through_scheduler(Rule::On);
            report_lateness("kairos", &kl);
            eprintln!("  kairos status after: {st:?}");
            let (off, _) = through_scheduler(Rule::Off);
            report_lateness("rule off", &off);
            let line = format!(
                "cost of 'a cancel written before the run-at wins' at {rate}/s: fire time − run-at p99 {:.0} ms vs {:.0} ms \
                 with the rule off (p50 {:.0} vs {:.0}, max {:.0} vs {:.0}); consume − run-at p99 ratio on/off = {:.2}",
                pct(&kl.created, 0.99),
                pct(&off.created, 0.99),
                pct(&kl.created, 0.5),
                pct(&off.created, 0.5),
                kl.created.last().copied().unwrap_or(f64::NAN),
                off.created.last().copied().unwrap_or(f64::NAN),
                pct(&kl.consumed, 0.99) / pct(&off.consumed, 0.99),
            );
            println!("  {line}");
            summary.push(line);
            let p99 = pct(&kl.consumed, 0.99);
            let raw_p99 = pct(&raw.consumed, 0.99);
            let max = kl.consumed.last().copied().unwrap_or(f64::NAN);
            let complete = kl.consumed.len() >= kl.expected;
            let sustained = complete && max <= SUSTAINED_MAX_MS;
            let line = format!(
                "lateness at {rate}/s: p99 ratio kairos/raw = {:.2} (kairos p50 {:.1} / p99 {p99:.1} / max {max:.1} ms; \
                 raw pipe p50 {:.1} / p99 {raw_p99:.1} / max {:.1} ms); {} of {} fired; writes {:.0}/s, fires {:.0}/s; \
                 sustained (no backlog, max ≤ {SUSTAINED_MAX_MS} ms): {} — target p99 ≤ {TARGET_P99_MS} ms{}: {}",
                p99 / raw_p99,
                pct(&kl.consumed, 0.5),
                pct(&raw.consumed, 0.5),
                raw.consumed.last().copied().unwrap_or(f64::NAN),
                kl.consumed.len(),
                kl.expected,
                kl.write_rate,
                kl.fire_rate,
                if sustained { "yes" } else { "no" },
                if k == 0 { "" } else { " (target is at 10,000/s)" },
                support::pass(complete && p99 <= TARGET_P99_MS && rate >= 10_000)
            );
            println!("  {line}");
            summary.push(line);
            // The issue defines lateness as fire time − run-at. The fire time
            // is when the scheduler writes the job: its producer stamps it as
            // the record's CreateTime. The line above adds the trip through
            // the broker to a consumer, which the raw pipe shows on its own.
            let fired_p99 = pct(&kl.created, 0.99);
            let line = format!(
                "fire time − run-at at {rate}/s (the record's CreateTime): p50 {:.0} / p99 {fired_p99:.0} / max {:.0} ms — target p99 ≤ {TARGET_P99_MS} ms{}: {}",
                pct(&kl.created, 0.5),
                kl.created.last().copied().unwrap_or(f64::NAN),
                if k == 0 { "" } else { " (target is at 10,000/s)" },
                support::pass(complete && fired_p99 <= TARGET_P99_MS && rate >= 10_000)
            );
            println!("  {line}");
            summary.push(line);
            if sustained {
                break;
            }
        }
    }
    println!("summary:");
    for l in &summary {
        println!("  {l}");
    }
}
