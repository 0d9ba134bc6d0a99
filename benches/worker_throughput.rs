//! Worker throughput against Apache Kafka (the test broker that
//! `tests/common` starts on free ports), each number against its baseline
//! measured in the same run, since the machine is small and shared.
//!
//! ```text
//! cargo bench --bench worker_throughput                    # A: N = 100,000; B: J = 5,000
//! cargo bench --bench worker_throughput -- 20000 2000      # quick run (N, J[, B baseline jobs])
//! cargo bench --bench worker_throughput -- a               # only benchmark A (or `b`, `c`)
//! ```
//!
//! Numbers are positional (N, then J, then the B baseline's job count, so
//! `-- 1 5000 b` runs B alone with J = 5,000); when absent they come from
//! `$KAIROS_BENCH_N`, `$KAIROS_BENCH_B_JOBS` and `$KAIROS_BENCH_B_BASELINE`.
//!
//! - **A, per-job overhead.** N header-less records (valid jobs, due now; keys
//!   `key-<i mod 10,000>`, 16-byte payloads) in one work topic of 6 partitions.
//!   Baseline: a plain rdkafka `BaseConsumer` in its own group (auto commit),
//!   from its creation and subscribe to the N-th record. Kairos: a `Worker`
//!   with a no-op handler, concurrency 256, in another group on the same
//!   filled topic, from `run_until` to `stats().succeeded == N` (polled every
//!   2 ms). Both sides include joining the group. Each side runs twice,
//!   interleaved, and the best run counts.
//! - **B, key parallelism.** One partition, 1,000 keys, J jobs written round
//!   by round (job r of every key, then job r + 1, ...; payload = the per-key
//!   sequence number). The handler sleeps 10 ms. Kairos with concurrency 256
//!   runs all J; the partition-ordered baseline (the same worker with
//!   concurrency 1: one job at a time in partition order) runs the first
//!   1,000. Every handler run records (key, seq, start, end); for the
//!   concurrency-256 runs, per-key order violations and same-key overlaps
//!   are counted (they must be zero). Each side runs twice; the best counts.
//!   Besides jobs/s from the worker's start, jobs/s over the handlers' busy
//!   window (first handler start to the J-th end: no group join) is shown.
//!
//! - **C, exactly-once settlement.** `$KAIROS_BENCH_C_JOBS` jobs (default
//!   100,000; 6 partitions, 10,000 keys) whose handler writes one follow-up
//!   each to another topic; concurrency 256. The same worker in
//!   at-least-once mode (the baseline) and with `[worker] exactly_once`
//!   (each commit round one transaction) at commit intervals of 10, 100
//!   and 1,000 ms, interleaved, three runs each, in fresh groups: from `run_until` until the group's committed offsets
//!   reach every job (polled every 20 ms), so that both count only work
//!   whose follow-ups Kafka has and whose offsets are committed. Medians.
//!
//! - **D, exactly once on a topic that holds keys.** C's jobs and worker,
//!   on a topic with `on_failure = "hold_key"` (no job fails): exactly once
//!   there commits every finished job's writes at the next round with the
//!   partition's progress record, against exactly once on a plain topic
//!   (the baseline) and at least once on the hold-key topic; commit
//!   interval 100 ms, interleaved, three runs each, medians.
//!
//! The targets are judged on the worker's default configuration. As a
//! diagnostic, each benchmark also runs the concurrency-256 worker with
//! `[worker] max_buffered` raised to the job count, so that it never pauses
//! its partitions: every pause makes librdkafka drop the records it had
//! prefetched, and after the resume nothing is fetched again for up to
//! ~0.5-1 s (librdkafka 2.12), which is what the difference between the two
//! shows.
//!
//! Records are produced with a plain rdkafka `BaseProducer` before any clock
//! starts; every run uses a fresh consumer group, so it reads from the start.
//! Each run also prints this process's CPU time and the time its threads
//! spent runnable but waiting for a core (`/proc/self/task/*/schedstat`),
//! as a measure of how busy the shared machine was.
//!
//! For investigating: `KAIROS_BENCH_TIMELINE=1` prints B's handler starts
//! per 50 ms; `KAIROS_BENCH_WORKER_CONSUMER=key=value,...` passes librdkafka
//! settings to the workers' consumers; `RUST_LOG=kairos::worker=debug` (with
//! `librdkafka=debug` and `KAIROS_BENCH_WORKER_CONSUMER=debug=fetch`) logs to
//! stderr.

#[path = "../tests/common/mod.rs"]
mod common;
/// The shipped allocator (mimalloc) and the bench knobs.
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Broker;
use kairos::worker::{JobContext, Outcome, Worker};
use kairos::{Config, Job};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
use rdkafka::Message as _;
use support::knobs;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

/// A: partitions of the work topic, distinct keys, payload size.
const A_PARTITIONS: i32 = 6;
const A_KEYS: u64 = 10_000;
const A_PAYLOAD_BYTES: usize = 16;
/// B: distinct keys, and how long each job's handler sleeps.
const B_KEYS: u64 = 1_000;
const B_SLEEP: Duration = Duration::from_millis(10);
/// Concurrency of the Kairos worker in both benchmarks.
const CONCURRENCY: usize = 256;
/// Runs per side; the best one counts.
const RUNS: usize = 2;
/// How often the worker's counters are read.
const STATS_POLL: Duration = Duration::from_millis(2);

/// How often the "metrics on" runs scrape `/metrics` (Prometheus's default
/// is every 15 s).
const SCRAPE_EVERY: Duration = Duration::from_millis(100);
/// Longest a single run may take before the bench gives up.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

const TARGET_A: f64 = 0.5;
const TARGET_B: f64 = 150.0;

/// Sizes and which benchmarks to run, from the command line and environment.
struct Args {
    n: u64,
    b_jobs: u64,
    b_baseline: u64,
    c_jobs: u64,
    run_a: bool,
    run_b: bool,
    run_c: bool,
    run_d: bool,
}

impl Args {
    fn parse() -> Args {
        let parse = |s: &str| s.replace('_', "").parse::<u64>().ok();
        let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
        let nums: Vec<u64> = args.iter().filter_map(|a| parse(a)).collect();
        let size = |i: usize, var: &str, default: u64| {
            nums.get(i)
                .copied()
                .or_else(|| knobs::number(var))
                .unwrap_or(default)
                .max(1)
        };
        let named = |x: &str| args.iter().any(|a| a.eq_ignore_ascii_case(x));
        let (only_a, only_b, only_c, only_d) = (named("a"), named("b"), named("c"), named("d"));
        let all = !(only_a || only_b || only_c || only_d);
        let b_jobs = size(1, "KAIROS_BENCH_B_JOBS", 5_000);
        Args {
            n: size(0, "KAIROS_BENCH_N", 100_000),
            b_jobs,
            b_baseline: size(2, "KAIROS_BENCH_B_BASELINE", 1_000).min(b_jobs),
            c_jobs: size(3, "KAIROS_BENCH_C_JOBS", 100_000),
            run_a: only_a || all,
            run_b: only_b || all,
            run_c: only_c || all,
            run_d: only_d || all,
        }
    }
}

/// librdkafka consumer settings for the Kairos workers from
/// `$KAIROS_BENCH_WORKER_CONSUMER` (`key=value,key=value`; none by default),
/// for experiments such as `queued.min.messages=1000000`.
fn worker_consumer_overrides(cfg: &mut Config) -> Vec<String> {
    let spec = knobs::text("KAIROS_BENCH_WORKER_CONSUMER").unwrap_or_default();
    let mut applied = Vec::new();
    for kv in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .unwrap_or_else(|| panic!("KAIROS_BENCH_WORKER_CONSUMER: `{kv}` is not key=value"));
        cfg.kafka.consumer.insert(k.trim().to_string(), v.trim().into());
        applied.push(kv.to_string());
    }
    applied
}

/// Write `records` (key, payload) to `topic` as fast as the broker takes
/// them; returns how many were written.
fn fill(cfg: &Config, topic: &str, records: impl Iterator<Item = (String, String)>) -> u64 {
    let mut c = kairos::kafka::producer_config(&cfg.kafka, "bench-fill");
    c.set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "1000000");
    let producer: BaseProducer = c.create().expect("fill producer");
    let mut n = 0u64;
    for (key, payload) in records {
        let rec = BaseRecord::to(topic).key(key.as_str()).payload(payload.as_str());
        support::send_queued(&producer, rec, Duration::from_millis(10));
        n += 1;
        if n.is_multiple_of(1000) {
            producer.poll(Duration::ZERO);
        }
    }
    producer.flush(Duration::from_secs(300)).expect("flush");
    let count = common::record_count(&cfg.kafka.brokers, topic);
    assert_eq!(count, n as i64, "records in {topic} after filling");
    n
}

/// Per thread of this process: (ns on a core, ns runnable but waiting for
/// a core), from `/proc/self/task/*/schedstat` (empty where unavailable).
fn sched_snapshot() -> HashMap<u32, (u64, u64)> {
    let mut m = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return m;
    };
    for e in dir.flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if let Ok(text) = std::fs::read_to_string(e.path().join("schedstat")) {
            let mut it = text.split_whitespace().filter_map(|x| x.parse::<u64>().ok());
            if let (Some(run), Some(wait)) = (it.next(), it.next()) {
                m.insert(tid, (run, wait));
            }
        }
    }
    m
}

/// Seconds on a core and seconds waiting for one, summed over the threads of
/// this process, since `before` (threads started since count in full).
fn sched_since(before: &HashMap<u32, (u64, u64)>) -> (f64, f64) {
    let (mut run, mut wait) = (0u64, 0u64);
    for (tid, (r, w)) in sched_snapshot() {
        let (r0, w0) = before.get(&tid).copied().unwrap_or((0, 0));
        run += r.saturating_sub(r0);
        wait += w.saturating_sub(w0);
    }
    (run as f64 / 1e9, wait as f64 / 1e9)
}

/// One run: `jobs` processed in `total` from the start, the first one
/// reached after `first`; this process's CPU time and time spent waiting
/// for a core meanwhile (a measure of how busy the shared machine was).
#[derive(Clone, Copy, Debug)]
struct Timing {
    jobs: u64,
    total: Duration,
    first: Duration,
    cpu: f64,
    waited: f64,
}

impl Timing {
    /// Jobs per second from the start (group join included).
    fn rate(&self) -> f64 {
        self.jobs as f64 / self.total.as_secs_f64()
    }

    /// Jobs per second after the first record arrived (group join excluded).
    fn steady_rate(&self) -> f64 {
        self.jobs.saturating_sub(1) as f64 / (self.total - self.first).as_secs_f64().max(1e-9)
    }

    fn describe(&self, what: &str) -> String {
        format!(
            "{} {what} in {:.3} s ({:.0} jobs/s; first after {:.3} s; process cpu {:.2} s, waited for a core \
             {:.2} s)",
            self.jobs,
            self.total.as_secs_f64(),
            self.rate(),
            self.first.as_secs_f64(),
            self.cpu,
            self.waited
        )
    }
}

fn best(runs: &[Timing]) -> Timing {
    *runs
        .iter()
        .max_by(|a, b| a.rate().total_cmp(&b.rate()))
        .expect("at least one run")
}

// ---------------------------------------------------------------- benchmark A

/// A plain rdkafka consumer in a fresh group, reading `n` records.
fn plain_run(brokers: &str, topic: &str, n: u64) -> Timing {
    let sched = sched_snapshot();
    let started = Instant::now();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", common::unique("bench-plain"))
        .set("enable.auto.commit", "true")
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("plain consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut seen = 0u64;
    let mut bytes = 0usize;
    let mut first = None;
    while seen < n {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                first.get_or_insert_with(|| started.elapsed());
                bytes += m.key().map_or(0, <[u8]>::len) + m.payload().map_or(0, <[u8]>::len);
                seen += 1;
            }
            Some(Err(e)) => eprintln!("plain consumer: {e}"),
            None => assert!(
                started.elapsed() < RUN_TIMEOUT,
                "plain consumer read {seen} of {n} records in {RUN_TIMEOUT:?}"
            ),
        }
    }
    let total = started.elapsed();
    let (cpu, waited) = sched_since(&sched);
    std::hint::black_box(bytes);
    drop(consumer); // leaves the group; not timed
    Timing {
        jobs: n,
        total,
        first: first.unwrap_or(total),
        cpu,
        waited,
    }
}

/// A Kairos worker with a no-op handler in a fresh group, until `n` jobs
/// succeeded; `max_buffered` overrides `[worker] max_buffered`.
async fn kairos_run_a(
    cfg: &Config,
    topic: &str,
    n: u64,
    max_buffered: Option<usize>,
    scraped: bool,
) -> Timing {
    let mut cfg = cfg.clone();
    if let Some(m) = max_buffered {
        cfg.worker.max_buffered = m;
    }
    if scraped {
        cfg.worker.admin.listen = Some("127.0.0.1:0".parse().expect("address"));
    }
    let worker = Worker::builder(&cfg)
        .topics([topic])
        .group(common::unique("bench-kairos"))
        .concurrency(CONCURRENCY)
        .build(|_job: Job, _ctx: JobContext| async { Outcome::done() })
        .expect("worker");
    let scraper = worker
        .admin_addr()
        .map(|addr| common::Scraper::start(addr, SCRAPE_EVERY));
    let (timing, stats) = run_worker_until(worker, n).await;
    if let Some(s) = scraper {
        assert!(s.finish() > 0, "the endpoint was scraped");
    }
    assert_eq!(
        (stats.dead_lettered, stats.retried, stats.panicked),
        (0, 0, 0),
        "kairos run A: {stats:?}"
    );
    timing
}

/// Run `worker` from now until `n` jobs succeeded, then stop it (not timed).
async fn run_worker_until(worker: Worker, n: u64) -> (Timing, kairos::worker::WorkerStats) {
    run_worker_while(worker, n, STATS_POLL, |st| std::future::ready(st.succeeded >= n)).await
}

/// Run `worker` from now until `done` says its `n` jobs are done (asked
/// every `every`), then stop it (not timed).
async fn run_worker_while<F, Fut>(
    worker: Worker,
    n: u64,
    every: Duration,
    mut done: F,
) -> (Timing, kairos::worker::WorkerStats)
where
    F: FnMut(&kairos::worker::WorkerStats) -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let handle = worker.handle();
    let stop = CancellationToken::new();
    let s = stop.clone();
    let sched = sched_snapshot();
    let started = Instant::now();
    let task = tokio::spawn(worker.run_until(async move { s.cancelled().await }));
    let mut first = None;
    loop {
        let st = handle.stats();
        if st.started > 0 {
            first.get_or_insert_with(|| started.elapsed());
        }
        if done(&st).await {
            break;
        }
        assert!(
            started.elapsed() < RUN_TIMEOUT && !task.is_finished(),
            "worker did {} of {n} jobs in {:?}: {st:?}",
            st.succeeded,
            started.elapsed()
        );
        tokio::time::sleep(every).await;
    }
    let total = started.elapsed();
    let (cpu, waited) = sched_since(&sched);
    stop.cancel();
    task.await.expect("worker task").expect("worker");
    let timing = Timing {
        jobs: n,
        total,
        first: first.unwrap_or(total),
        cpu,
        waited,
    };
    (timing, handle.stats())
}

fn bench_a(rt: &Runtime, broker: &Broker, n: u64) -> bool {
    let mut cfg = broker.config();
    cfg.topics.work_partitions = A_PARTITIONS;
    let overrides = worker_consumer_overrides(&mut cfg);
    rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
    let topic = cfg.topics.work[0].clone();
    let t = Instant::now();
    fill(
        &cfg,
        &topic,
        (0..n).map(|i| {
            (
                format!("key-{}", i % A_KEYS),
                format!("{i:0w$}", w = A_PAYLOAD_BYTES),
            )
        }),
    );
    let default_buffered = cfg.worker.max_buffered;
    println!(
        "A: N = {n} jobs in {topic} ({A_PARTITIONS} partitions, {A_KEYS} keys, {A_PAYLOAD_BYTES}-byte \
         payloads), filled in {:.2} s; kairos concurrency {CONCURRENCY}, max_buffered {default_buffered} \
         (default) and, as a diagnostic, {n} (never pauses)",
        t.elapsed().as_secs_f64()
    );
    if !overrides.is_empty() {
        println!(
            "   worker consumer settings (experiment): {}",
            overrides.join(", ")
        );
    }

    let mut plain = Vec::new();
    let mut kairos = Vec::new();
    let mut unpaused = Vec::new();
    let mut scraped = Vec::new();
    for run in 1..=RUNS {
        let p = plain_run(&cfg.kafka.brokers, &topic, n);
        println!("  run {run} plain consumer:        {}", p.describe("records"));
        plain.push(p);
        let k = rt.block_on(kairos_run_a(&cfg, &topic, n, None, false));
        println!("  run {run} kairos:                {}", k.describe("jobs"));
        kairos.push(k);
        let m = rt.block_on(kairos_run_a(&cfg, &topic, n, None, true));
        println!("  run {run} kairos, metrics scraped: {}", m.describe("jobs"));
        scraped.push(m);
        let u = rt.block_on(kairos_run_a(&cfg, &topic, n, Some(n as usize), false));
        println!("  run {run} kairos, never paused:  {}", u.describe("jobs"));
        unpaused.push(u);
    }
    let (p, k, u) = (best(&plain), best(&kairos), best(&unpaused));
    let m = best(&scraped);
    println!(
        "  metrics on/off: the worker with its endpoint scraped every {SCRAPE_EVERY:?} / without: {:.2}x \
         ({:.0} against {:.0} jobs/s; target >= 0.95x)",
        m.rate() / k.rate(),
        m.rate(),
        k.rate()
    );
    let ratio = k.rate() / p.rate();
    println!();
    println!(
        "| A: per-job overhead (best of {RUNS}) | kairos / plain | kairos jobs/s | plain jobs/s | \
         kairos never paused / plain | kairos never paused jobs/s |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| from start, group join included | **{ratio:.2}x** | {:.0} | {:.0} | {:.2}x | {:.0} |",
        k.rate(),
        p.rate(),
        u.rate() / p.rate(),
        u.rate()
    );
    println!(
        "| after the first record (join excluded) | {:.2}x | {:.0} | {:.0} | {:.2}x | {:.0} |",
        k.steady_rate() / p.steady_rate(),
        k.steady_rate(),
        p.steady_rate(),
        u.steady_rate() / p.steady_rate(),
        u.steady_rate()
    );
    println!();
    println!(
        "  {}  A: kairos jobs/s / plain consumer jobs/s >= {TARGET_A} (default config): {ratio:.2}x",
        support::pass(ratio >= TARGET_A)
    );
    println!(
        "  {}  A, diagnostic: the same with max_buffered = N: {:.2}x",
        support::pass(u.rate() / p.rate() >= TARGET_A),
        u.rate() / p.rate()
    );
    println!();
    ratio >= TARGET_A
}

// ---------------------------------------------------------------- benchmark B

/// One handler run.
#[derive(Clone, Debug)]
struct Rec {
    key: String,
    seq: u32,
    start: Instant,
    end: Instant,
}

/// A B run: timing from the worker's start, and the handler runs.
struct RunB {
    wall: Timing,
    recs: Vec<Rec>,
}

impl RunB {
    /// Jobs per second from the first handler start to the end of the
    /// `jobs`-th handler run (the handlers' busy window; group join excluded).
    fn busy_rate(&self) -> f64 {
        let mut ends: Vec<Instant> = self.recs.iter().map(|r| r.end).collect();
        ends.sort();
        let n = (self.wall.jobs as usize).min(ends.len());
        let first = self.recs.iter().map(|r| r.start).min().expect("some runs");
        n as f64 / (ends[n - 1] - first).as_secs_f64()
    }

    /// Handler starts per 50 ms from the first start, with the running count
    /// at each bucket's start (printed with `$KAIROS_BENCH_TIMELINE` set).
    fn timeline(&self) -> String {
        let bucket = Duration::from_millis(50);
        let t0 = self.recs.iter().map(|r| r.start).min().expect("some runs");
        let last = self.recs.iter().map(|r| r.end).max().expect("some runs");
        let n = ((last - t0).as_millis() / bucket.as_millis() + 1) as usize;
        let mut starts = vec![0usize; n];
        for r in &self.recs {
            starts[((r.start - t0).as_millis() / bucket.as_millis()) as usize] += 1;
        }
        let running = |at: Instant| self.recs.iter().filter(|r| r.start <= at && at < r.end).count();
        starts
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{}ms:+{s}/{}", i * 50, running(t0 + bucket * i as u32)))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Most handlers running at the same moment.
    fn peak_concurrency(&self) -> usize {
        let mut events: Vec<(Instant, i32)> = self
            .recs
            .iter()
            .flat_map(|r| [(r.start, 1), (r.end, -1)])
            .collect();
        events.sort(); // at equal instants the end (-1) comes first
        let (mut now, mut peak) = (0i32, 0i32);
        for (_, d) in events {
            now += d;
            peak = peak.max(now);
        }
        peak as usize
    }
}

/// Per-key checks over the handler runs.
#[derive(Debug, Default, Clone, Copy)]
struct Checks {
    /// Consecutive runs of a key (by start) whose seq did not go up by one.
    order_violations: usize,
    /// Consecutive runs of a key where the next started before the previous ended.
    overlaps: usize,
    /// Keys that did not run exactly seqs 0, 1, ..., rounds - 1.
    incomplete_keys: usize,
}

fn check(recs: &[Rec], rounds: u32) -> Checks {
    let mut by_key: HashMap<&str, Vec<&Rec>> = HashMap::new();
    for r in recs {
        by_key.entry(&r.key).or_default().push(r);
    }
    let mut c = Checks::default();
    for runs in by_key.values_mut() {
        runs.sort_by_key(|r| r.start);
        if runs.len() != rounds as usize || runs.iter().enumerate().any(|(i, r)| r.seq != i as u32) {
            c.incomplete_keys += 1;
        }
        for w in runs.windows(2) {
            if w[1].seq != w[0].seq + 1 {
                c.order_violations += 1;
            }
            if w[1].start < w[0].end {
                c.overlaps += 1;
            }
        }
    }
    c
}

/// The sleeping worker with `concurrency`, in a fresh group, until `jobs`
/// succeeded; `max_buffered` overrides `[worker] max_buffered`.
async fn kairos_run_b(
    cfg: &Config,
    topic: &str,
    concurrency: usize,
    jobs: u64,
    max_buffered: Option<usize>,
) -> RunB {
    let mut cfg = cfg.clone();
    if let Some(m) = max_buffered {
        cfg.worker.max_buffered = m;
    }
    let log: Arc<Mutex<Vec<Rec>>> = Arc::new(Mutex::new(Vec::with_capacity(jobs as usize + CONCURRENCY)));
    let l = log.clone();
    let worker = Worker::builder(&cfg)
        .topics([topic])
        .group(common::unique("bench-keys"))
        .concurrency(concurrency)
        .build(move |job: Job, _ctx: JobContext| {
            let l = l.clone();
            async move {
                let start = Instant::now();
                tokio::time::sleep(B_SLEEP).await;
                let end = Instant::now();
                let key = String::from_utf8(job.key).expect("utf-8 key");
                let seq = std::str::from_utf8(&job.payload)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .expect("payload is a sequence number");
                l.lock().unwrap().push(Rec { key, seq, start, end });
                Outcome::done()
            }
        })
        .expect("worker");
    let (wall, stats) = run_worker_until(worker, jobs).await;
    assert_eq!(
        (stats.dead_lettered, stats.retried, stats.panicked),
        (0, 0, 0),
        "kairos run B: {stats:?}"
    );
    let recs = std::mem::take(&mut *log.lock().unwrap());
    RunB { wall, recs }
}

fn bench_b(rt: &Runtime, broker: &Broker, jobs: u64, baseline_jobs: u64) -> bool {
    let mut cfg = broker.config();
    cfg.topics.work_partitions = 1;
    let overrides = worker_consumer_overrides(&mut cfg);
    rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
    let topic = cfg.topics.work[0].clone();
    let keys = B_KEYS.min(jobs);
    let rounds = (jobs / keys) as u32;
    let jobs = keys * rounds as u64;
    let baseline_jobs = baseline_jobs.min(jobs);
    fill(
        &cfg,
        &topic,
        (0..rounds).flat_map(|seq| (0..keys).map(move |k| (format!("key-{k:04}"), seq.to_string()))),
    );
    println!(
        "B: J = {jobs} jobs in {topic} (1 partition, {keys} keys x {rounds} jobs, written round by \
         round); handler sleeps {B_SLEEP:?}; concurrency {CONCURRENCY} runs all {jobs}, the baseline \
         (concurrency 1) the first {baseline_jobs}; max_buffered {} (default) and, as a diagnostic for \
         concurrency {CONCURRENCY}, {jobs} (never pauses)",
        cfg.worker.max_buffered
    );
    if !overrides.is_empty() {
        println!(
            "   worker consumer settings (experiment): {}",
            overrides.join(", ")
        );
    }
    let timeline = knobs::set("KAIROS_BENCH_TIMELINE");
    let show = |label: &str, r: &RunB, checks: Option<Checks>| {
        println!(
            "  {label} {}; {:.0} jobs/s over the handlers' busy window, peak {} running{}",
            r.wall.describe("jobs"),
            r.busy_rate(),
            r.peak_concurrency(),
            checks.map(|c| format!("; {c:?}")).unwrap_or_default()
        );
        if timeline {
            println!("    starts/running per 50 ms: {}", r.timeline());
        }
    };

    let (mut par, mut seq, mut unpaused) = (Vec::new(), Vec::new(), Vec::new());
    let mut checks = Vec::new();
    for run in 1..=RUNS {
        let k = rt.block_on(kairos_run_b(&cfg, &topic, CONCURRENCY, jobs, None));
        let c = check(&k.recs, rounds);
        show(
            &format!("run {run} concurrency {CONCURRENCY}:               "),
            &k,
            Some(c),
        );
        checks.push(c);
        par.push(k);
        let s = rt.block_on(kairos_run_b(&cfg, &topic, 1, baseline_jobs, None));
        show(&format!("run {run} concurrency 1:                 "), &s, None);
        seq.push(s);
        let u = rt.block_on(kairos_run_b(&cfg, &topic, CONCURRENCY, jobs, Some(jobs as usize)));
        let c = check(&u.recs, rounds);
        show(
            &format!("run {run} concurrency {CONCURRENCY}, never paused: "),
            &u,
            Some(c),
        );
        checks.push(c);
        unpaused.push(u);
    }
    let best_by = |runs: &[RunB], f: fn(&RunB) -> f64| runs.iter().map(f).fold(0.0, f64::max);
    let wall = |r: &RunB| r.wall.rate();
    let busy = |r: &RunB| r.busy_rate();
    let (pw, sw, uw) = (best_by(&par, wall), best_by(&seq, wall), best_by(&unpaused, wall));
    let (pb, sb, ub) = (best_by(&par, busy), best_by(&seq, busy), best_by(&unpaused, busy));
    let ratio = pw / sw;
    let total: Checks = checks.iter().fold(Checks::default(), |a, c| Checks {
        order_violations: a.order_violations + c.order_violations,
        overlaps: a.overlaps + c.overlaps,
        incomplete_keys: a.incomplete_keys + c.incomplete_keys,
    });
    println!();
    println!(
        "| B: key parallelism (best of {RUNS}) | c{CONCURRENCY} / c1 | c{CONCURRENCY} jobs/s | c1 jobs/s | \
         c{CONCURRENCY} never paused / c1 | c{CONCURRENCY} never paused jobs/s |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| from start, group join included | **{ratio:.1}x** | {pw:.0} | {sw:.1} | {:.1}x | {uw:.0} |",
        uw / sw
    );
    println!(
        "| handlers' busy window (join excluded) | {:.1}x | {pb:.0} | {sb:.1} | {:.1}x | {ub:.0} |",
        pb / sb,
        ub / sb
    );
    println!();
    println!(
        "concurrency {CONCURRENCY}, all {} runs: {} order violations, {} same-key overlaps, {} keys without \
         exactly seqs 0..{rounds}",
        checks.len(),
        total.order_violations,
        total.overlaps,
        total.incomplete_keys
    );
    println!();
    let clean = total.order_violations == 0 && total.overlaps == 0 && total.incomplete_keys == 0;
    println!(
        "  {}  B: concurrency {CONCURRENCY} jobs/s / concurrency 1 jobs/s >= {TARGET_B} (default config): \
         {ratio:.1}x",
        support::pass(ratio >= TARGET_B)
    );
    println!(
        "  {}  B, diagnostic: the same with max_buffered = J: {:.1}x",
        support::pass(uw / sw >= TARGET_B),
        uw / sw
    );
    println!(
        "  {}  B: zero order violations and same-key overlaps",
        support::pass(clean)
    );
    println!();
    ratio >= TARGET_B && clean
}

fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        // e.g. RUST_LOG=kairos=debug to see the worker pause and resume its partitions
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let broker = Broker::own();
    println!(
        "worker_throughput: {}, classic group protocol, {} cores",
        broker.describe(),
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    if args.run_a {
        bench_a(&rt, &broker, args.n);
    }
    if args.run_b {
        bench_b(&rt, &broker, args.b_jobs, args.b_baseline);
    }
    if args.run_c {
        bench_c(&rt, &broker, args.c_jobs);
    }
    if args.run_d {
        bench_d(&rt, &broker, args.c_jobs);
    }
}

// ---------------------------------------------------------------- benchmark C

/// Runs per mode in C (medians count).
const C_RUNS: usize = 3;

/// A worker whose handler writes one follow-up per job to `follow`, in a
/// fresh group, from its start until its committed offsets reach `n`.
async fn follow_up_run(
    cfg: &Config,
    topic: &str,
    follow: &str,
    n: u64,
    exactly_once: Option<Duration>,
    holds: bool,
) -> Timing {
    let mut cfg = cfg.clone();
    if holds {
        cfg.worker.on_failure = kairos::config::OnFailure::HoldKey;
    }
    cfg.worker.exactly_once = exactly_once.is_some();
    if let Some(every) = exactly_once {
        cfg.worker.commit_interval = every;
    }
    let group = common::unique("bench-follow");
    let follow = follow.to_string();
    let worker = Worker::builder(&cfg)
        .topics([topic])
        .group(group.as_str())
        .concurrency(CONCURRENCY)
        .build(move |job: Job, _ctx: JobContext| {
            let follow_up = Job::new(follow.as_str(), job.key.clone(), job.payload.clone());
            async move { Outcome::done_with(vec![follow_up]) }
        })
        .expect("worker");
    let (timing, st) = run_worker_while(worker, n, Duration::from_millis(20), |_| {
        let (brokers, g, t) = (cfg.kafka.brokers.clone(), group.clone(), topic.to_string());
        async move {
            let committed = tokio::task::spawn_blocking(move || common::committed(&brokers, &g, &t));
            committed.await.expect("committed offsets") as u64 >= n
        }
    })
    .await;
    assert_eq!(st.succeeded, n, "every job once in an undisturbed run: {st:?}");
    timing
}

fn median_rate(runs: &[Timing]) -> f64 {
    let mut r: Vec<f64> = runs.iter().map(Timing::rate).collect();
    r.sort_by(f64::total_cmp);
    r[r.len() / 2]
}

/// C's and D's set-up: `n` jobs in a fresh work topic, and a topic for
/// their follow-ups; the configuration, the work topic and the follow-ups'.
fn follow_up_topics(rt: &Runtime, broker: &Broker, n: u64) -> (Config, String, String) {
    let mut cfg = broker.config();
    cfg.topics.work_partitions = A_PARTITIONS;
    let follow = common::unique("bench-follow-ups");
    cfg.topics.work.push(follow.clone());
    rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
    let topic = cfg.topics.work[0].clone();
    fill(
        &cfg,
        &topic,
        (0..n).map(|i| (format!("key-{}", i % A_KEYS), format!("{i:016}"))),
    );
    (cfg, topic, follow)
}

fn bench_c(rt: &Runtime, broker: &Broker, n: u64) {
    let (cfg, topic, follow) = follow_up_topics(rt, broker, n);
    println!(
        "C: {n} jobs in {topic} ({A_PARTITIONS} partitions, {A_KEYS} keys), one follow-up each; concurrency {CONCURRENCY}; until the offsets are committed"
    );
    let intervals = [10, 100, 1000].map(Duration::from_millis);
    let mut alo = Vec::new();
    let mut eos: Vec<Vec<Timing>> = intervals.iter().map(|_| Vec::new()).collect();
    for run in 1..=C_RUNS {
        let a = rt.block_on(follow_up_run(&cfg, &topic, &follow, n, None, false));
        println!("  run {run} at least once:                {}", a.describe("jobs"));
        alo.push(a);
        for (i, every) in intervals.iter().enumerate() {
            let e = rt.block_on(follow_up_run(&cfg, &topic, &follow, n, Some(*every), false));
            println!(
                "  run {run} exactly once, rounds {every:>6?}: {}",
                e.describe("jobs")
            );
            eos[i].push(e);
        }
    }
    let a = median_rate(&alo);
    for (every, runs) in intervals.iter().zip(&eos) {
        let e = median_rate(runs);
        println!(
            "  C: exactly once (commit_interval {every:?}) / at least once, medians of {C_RUNS}: {:.2}x \
             ({e:.0} against {a:.0} jobs/s)",
            e / a
        );
    }
    println!();
}

// ---------------------------------------------------------------- benchmark D

fn bench_d(rt: &Runtime, broker: &Broker, n: u64) {
    let (cfg, topic, follow) = follow_up_topics(rt, broker, n);
    println!(
        "D: {n} jobs in {topic} ({A_PARTITIONS} partitions, {A_KEYS} keys), one follow-up each; concurrency {CONCURRENCY}; commit_interval 100 ms; until the offsets are committed"
    );
    let every = Some(Duration::from_millis(100));
    let modes = [
        ("exactly once, plain topic   ", every, false),
        ("exactly once, hold-key topic", every, true),
        ("at least once, hold-key topic", None, true),
    ];
    let mut runs: Vec<Vec<Timing>> = modes.iter().map(|_| Vec::new()).collect();
    for run in 1..=C_RUNS {
        for ((what, eos, holds), got) in modes.iter().zip(runs.iter_mut()) {
            let t = rt.block_on(follow_up_run(&cfg, &topic, &follow, n, *eos, *holds));
            println!("  run {run} {what}: {}", t.describe("jobs"));
            got.push(t);
        }
    }
    let [plain, held, alo] = [0, 1, 2].map(|i| median_rate(&runs[i]));
    println!(
        "  D: exactly once on the hold-key topic / on the plain topic, medians of {C_RUNS}: {:.2}x \
         ({held:.0} against {plain:.0} jobs/s); / at least once on the hold-key topic: {:.2}x ({alo:.0} jobs/s)",
        held / plain,
        held / alo
    );
    println!();
}
