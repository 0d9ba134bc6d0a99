//! What holding keys costs the worker (`on_failure = "hold_key"`), each
//! figure against its baseline in the same run, on Apache Kafka (the test
//! broker, `tests/common/kafka.rs`).
//!
//! ```text
//! cargo bench --bench worker_holds                 # N = 50,000 jobs (500,000 failing); 100,000 keys held
//! KAIROS_BENCH_N=20000 KAIROS_BENCH_FAILING_N=100000 KAIROS_BENCH_HELD=20000 cargo bench --bench worker_holds
//! KAIROS_BENCH_ONLY=none|failing|memory|handover cargo bench --bench worker_holds
//! ```
//!
//! - **No failures** (`none`): N due jobs over 10,000 keys, a no-op handler,
//!   concurrency 256: jobs/s with hold-key on against off, each side five
//!   times, interleaved; the ratio of each pair, and their median counts
//!   (target ≥ 0.95x: holding keys costs nothing while nothing fails).
//! - **1 % of keys failing** (`failing`): 500,000 jobs over 100,000 keys
//!   (`KAIROS_BENCH_FAILING_N`, five jobs a key), every job of one key in a
//!   hundred failing twice (a 100 ms retry delay) before it
//!   succeeds; a scheduler runs in-process for the retries and the parked
//!   jobs. Hold-key against overtaking, each on topics of its own: the
//!   jobs/s of the 99 % of keys that never fail, to the last of theirs (the
//!   worker's throughput while keys fail: target ≥ 0.8x), and, beside it,
//!   of every job to the last success (a held key runs its jobs one after
//!   another, each failing twice, so this one is bound by the failing
//!   keys' retries, not by the worker).
//! - **Memory** (`memory`): 100,000 keys whose one job fails with a retry an
//!   hour ahead, so all are held at once; the worker process's resident
//!   memory once they are, against it idle before (target ≤ 64 MiB more);
//!   beside it, the same jobs succeeding in a worker of their own. Each
//!   worker is a child process of this bench (the jobs are written from
//!   here, so the writing producer does not count). No scheduler runs:
//!   the retries wait in the schedule topic.
//!
//! Throughput is timed from the first handler start to the last success:
//! joining the group, and with keys held reading the held topic back on
//! assignment, is left out (it happens once per assignment).
//!
//! Each run uses fresh topics and groups. The worker runs on the `kairos`
//! binary's allocator, in this process for throughput, in a child for memory.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/mod.rs"]
mod support;

use support::knobs;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Broker;
use kairos::config::OnFailure;
use kairos::scheduler::Scheduler;
use kairos::worker::{JobContext, Outcome, Worker, WorkerHandle};
use kairos::{Config, Job};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};
use tokio_util::sync::CancellationToken;

const KEYS: u64 = 10_000;
const CONCURRENCY: usize = 256;
/// Runs per side (interleaved pairs); the median pair ratio counts.
const RUNS: usize = 5;
const TIMEOUT: Duration = Duration::from_secs(900);

/// Write `n` due jobs, key `key-<i mod keys>`, payload `i`, to `topic`.
fn fill(cfg: &Config, topic: &str, n: u64, keys: u64) {
    let mut c = kairos::kafka::producer_config(&cfg.kafka, "bench-fill");
    c.set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "1000000");
    let producer: BaseProducer = c.create().expect("fill producer");
    for i in 0..n {
        let (key, payload) = (format!("key-{}", i % keys), i.to_string());
        let rec = BaseRecord::to(topic).key(key.as_str()).payload(payload.as_str());
        support::send_queued(&producer, rec, Duration::from_millis(10));
    }
    producer.flush(Duration::from_secs(300)).expect("flush");
}

/// Fresh topics on `broker`, with hold-key on or off.
fn config(broker: &Broker, dir: &std::path::Path, hold: bool) -> Config {
    let mut cfg = common::system::config(broker, dir);
    cfg.topics.work_partitions = 6;
    cfg.worker.on_failure = if hold {
        OnFailure::HoldKey
    } else {
        OnFailure::Overtake
    };
    cfg.worker.backoff_base = Duration::from_millis(100);
    cfg
}

/// Whether a job's key is one of those whose jobs fail: one in a hundred.
fn is_failing_key(job: &Job) -> bool {
    let k: u64 = String::from_utf8_lossy(&job.key)
        .trim_start_matches("key-")
        .parse()
        .unwrap_or(1);
    k.is_multiple_of(100)
}

/// Whether a job fails: every job of a failing key, on its first two
/// attempts.
fn fails(job: &Job) -> bool {
    is_failing_key(job) && job.attempt <= 2
}

/// Run a worker (and a scheduler, if asked) on `cfg` until `until` says so,
/// counting in `healthy` the successes of jobs whose key never fails;
/// returns the time from its first handler start, and that start.
async fn run(
    cfg: &Config,
    scheduler: bool,
    failing: bool,
    healthy: Arc<AtomicU64>,
    until: impl Fn(&WorkerHandle) -> bool,
) -> (Duration, Instant) {
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    if scheduler {
        let s = Scheduler::builder(cfg).build().expect("scheduler");
        let st = stop.clone();
        tasks.push(tokio::spawn(async move {
            s.run_until(async move { st.cancelled().await })
                .await
                .expect("scheduler");
        }));
    }
    let worker = Worker::builder(cfg)
        .concurrency(CONCURRENCY)
        .build(move |job: Job, _ctx: JobContext| {
            let healthy = healthy.clone();
            async move {
                if failing && fails(&job) {
                    Outcome::retry_after(Duration::from_millis(100), "bench failure")
                } else {
                    if !is_failing_key(&job) {
                        healthy.fetch_add(1, Ordering::Relaxed);
                    }
                    Outcome::done()
                }
            }
        })
        .expect("worker");
    let h = worker.handle();
    let started = Instant::now();
    let st = stop.clone();
    tasks.push(tokio::spawn(async move {
        worker
            .run_until(async move { st.cancelled().await })
            .await
            .expect("worker");
    }));
    // From the first start: joining the group (and, with keys held, reading
    // the held topic back on assignment) is not the throughput.
    let mut first = None;
    while !until(&h) {
        assert!(started.elapsed() < TIMEOUT, "timed out: {:?}", h.stats());
        if first.is_none() && h.stats().started > 0 {
            first = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let first = first.unwrap_or(started);
    let took = first.elapsed();
    stop.cancel();
    for t in tasks {
        t.await.expect("task");
    }
    (took, first)
}

/// Jobs/s of `n` jobs, `RUNS` pairs of hold-key off then on, each run on
/// topics of its own. Two rates per side: all `n` jobs to the last
/// success, and the jobs of the keys that never fail to the last of theirs
/// (the worker's throughput while 1 % of keys fail).
fn compare(
    rt: &tokio::runtime::Runtime,
    broker: &Broker,
    n: u64,
    keys: u64,
    failing: bool,
) -> Vec<[Rates; 2]> {
    let healthy_n = (0..n).filter(|i| !(i % keys).is_multiple_of(100)).count() as u64;
    let mut pairs = Vec::new();
    for _ in 0..RUNS {
        let mut pair = [Rates::default(); 2];
        for (i, hold) in [false, true].into_iter().enumerate() {
            let dir = support::bench_dir("kairos-bench-holds");
            let cfg = config(broker, dir.path(), hold);
            rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
            fill(&cfg, &cfg.topics.work[0], n, keys);
            let healthy = Arc::new(AtomicU64::new(0));
            let healthy_done = std::sync::Mutex::new(None);
            let (took, first) = rt.block_on(run(&cfg, failing, failing, healthy.clone(), |h| {
                if healthy.load(Ordering::Relaxed) >= healthy_n {
                    healthy_done.lock().unwrap().get_or_insert(Instant::now());
                }
                h.stats().succeeded >= n
            }));
            let healthy_took = healthy_done
                .lock()
                .unwrap()
                .map_or(took, |t| t.duration_since(first));
            let rates = Rates {
                all: n as f64 / took.as_secs_f64(),
                healthy: healthy_n as f64 / healthy_took.as_secs_f64(),
            };
            println!(
                "  {:<9} {:>6.0} jobs/s ({n} jobs in {took:.2?}); keys that never fail: {:>6.0} jobs/s \
                 ({healthy_n} jobs in {healthy_took:.2?})",
                if hold { "hold-key" } else { "overtake" },
                rates.all,
                rates.healthy,
            );
            pair[i] = rates;
        }
        pairs.push(pair);
    }
    pairs
}

/// The median of `ratio` over `pairs` (off, on), the pair it came from,
/// and every ratio in run order.
fn median_pair(pairs: &[[Rates; 2]], ratio: impl Fn(&[Rates; 2]) -> f64) -> (f64, [Rates; 2], Vec<f64>) {
    let all: Vec<f64> = pairs.iter().map(&ratio).collect();
    let mut sorted: Vec<(f64, usize)> = all.iter().copied().zip(0..).collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (r, i) = sorted[sorted.len() / 2];
    (r, pairs[i], all)
}

/// A side's rates in [`compare`], jobs/s.
#[derive(Clone, Copy, Default)]
struct Rates {
    /// Every job, to the last success.
    all: f64,
    /// The jobs of keys that never fail, to the last of theirs.
    healthy: f64,
}

/// Environment of a memory child: the worker's config as JSON, and whether
/// its jobs fail and hold their keys.
const CHILD_CONFIG: &str = "KAIROS_BENCH_HOLDS_CHILD";
const CHILD_HOLD: &str = "KAIROS_BENCH_HOLDS_CHILD_HOLD";

/// RSS (MiB) of a worker process: idle, then with `held` jobs over `held`
/// keys written and each settled (`hold`: each fails and holds its key;
/// else each succeeds), each read 2 s after its state is reached. The
/// worker runs in a child process of its own (this binary, see
/// [`memory_child`]), so that neither this process's producer writing the
/// jobs nor an earlier side counts.
fn rss_around(rt: &tokio::runtime::Runtime, broker: &Broker, held: u64, hold: bool) -> (f64, f64) {
    use std::io::BufRead as _;
    let dir = support::bench_dir("kairos-bench-holds");
    let mut cfg = config(broker, dir.path(), true);
    cfg.worker.max_held_keys = held as usize + 1;
    rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
    let mut child = worker_child(&cfg, held, hold, std::process::Stdio::piped());
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut read = |what: &str| -> u64 {
        let line = lines
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("the worker child ended before {what}"));
        line.strip_prefix(what)
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("the worker child said {line:?}, expected {what}"))
    };
    let idle = read("idle");
    fill(&cfg, &cfg.topics.work[0], held, held);
    let at_once = read("at-once");
    let busy = read("busy");
    assert!(
        child.wait().expect("worker child").success(),
        "worker child failed"
    );
    println!(
        "  {held} jobs {}; RSS at once {:.1} MiB",
        if hold { "held their keys" } else { "succeeded" },
        support::mib(at_once)
    );
    (support::mib(idle), support::mib(busy))
}

/// This binary as a worker child on `cfg` (see [`memory_child`]): its
/// `held` jobs hold their keys (`hold`) or succeed.
fn worker_child(cfg: &Config, held: u64, hold: bool, stdout: std::process::Stdio) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("bench binary"))
        .arg("--bench")
        .env(CHILD_CONFIG, serde_json::to_string(cfg).expect("config as JSON"))
        .env(CHILD_HOLD, if hold { "1" } else { "0" })
        .env("KAIROS_BENCH_HELD", held.to_string())
        .stdout(stdout)
        .spawn()
        .expect("spawn the worker")
}

/// The worker side of [`rss_around`], in a child process: it says its RSS
/// on stdout once idle (`idle N`), once every job is settled (`at-once N`)
/// and 2 s later (`busy N`).
fn memory_child(rt: &tokio::runtime::Runtime, json: &str) {
    let cfg: Config = serde_json::from_str(json).expect("config from the parent");
    let hold = knobs::text(CHILD_HOLD).is_some_and(|v| v == "1");
    let held = knobs::u64_or("KAIROS_BENCH_HELD", 100_000);
    rt.block_on(async {
        let stop = CancellationToken::new();
        let worker = Worker::builder(&cfg)
            .concurrency(CONCURRENCY)
            .build(move |_job: Job, _ctx: JobContext| async move {
                if hold {
                    Outcome::retry_after(Duration::from_secs(3600), "held for the bench")
                } else {
                    Outcome::done()
                }
            })
            .expect("worker");
        let h = worker.handle();
        let st = stop.clone();
        let task = tokio::spawn(async move {
            worker
                .run_until(async move { st.cancelled().await })
                .await
                .expect("worker");
        });
        let t = Instant::now();
        while h.stats().owned == 0 {
            assert!(t.elapsed() < TIMEOUT, "no partitions");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        println!("idle {}", support::mem().rss);
        let reached = |s: &kairos::worker::WorkerStats| {
            if hold {
                s.held_keys >= held as usize
            } else {
                s.succeeded >= held
            }
        };
        while !reached(&h.stats()) {
            assert!(t.elapsed() < TIMEOUT, "not settled: {:?}", h.stats());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!("at-once {}", support::mem().rss);
        // The writes just made (retries, hold records) are acknowledged
        // and freed meanwhile; the holds stay.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(reached(&h.stats()), "keys let go: {:?}", h.stats());
        println!("busy {}", support::mem().rss);
        stop.cancel();
        task.await.expect("worker");
    });
}

/// A partition hand-over with `held` keys held: a worker in a child
/// process holds them and stops; a second worker takes the partitions
/// over. Returns how long from its start until it owns every partition
/// with every key held again (group join, held topic read back, the holds
/// written again under its claim and the claim committed; the log line
/// `held keys read back and claimed`, shown with
/// `KAIROS_TEST_LOG=warn,kairos::worker::service::held=info`, splits the
/// read from the rest).
fn handover(rt: &tokio::runtime::Runtime, broker: &Broker, held: u64) -> Duration {
    let dir = support::bench_dir("kairos-bench-handover");
    let mut cfg = config(broker, dir.path(), true);
    cfg.worker.max_held_keys = held as usize + 1;
    rt.block_on(kairos::topics::init(&cfg)).expect("topics init");
    let mut child = worker_child(&cfg, held, true, std::process::Stdio::null());
    fill(&cfg, &cfg.topics.work[0], held, held);
    assert!(
        child.wait().expect("worker child").success(),
        "worker child failed"
    );
    rt.block_on(async {
        let stop = CancellationToken::new();
        let worker = Worker::builder(&cfg)
            .concurrency(CONCURRENCY)
            .build(|_job: Job, _ctx: JobContext| async { Outcome::done() })
            .expect("worker");
        let h = worker.handle();
        let started = Instant::now();
        let st = stop.clone();
        let task = tokio::spawn(async move {
            worker
                .run_until(async move { st.cancelled().await })
                .await
                .expect("worker");
        });
        while !(h.stats().owned == 6 && h.stats().held_keys >= held as usize) {
            assert!(started.elapsed() < TIMEOUT, "not taken over: {:?}", h.stats());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let took = started.elapsed();
        stop.cancel();
        task.await.expect("worker");
        took
    })
}

/// Worker RSS with `held` keys held against idle, and against the same
/// jobs succeeding (what the burst of jobs costs without any hold).
fn memory(rt: &tokio::runtime::Runtime, broker: &Broker, held: u64) -> (f64, f64) {
    let (ok_idle, ok_busy) = rss_around(rt, broker, held, false);
    let (idle, busy) = rss_around(rt, broker, held, true);
    let burst = ok_busy - ok_idle;
    let holds = busy - idle;
    println!(
        "  the same jobs succeeding: {ok_busy:.1} MiB against {ok_idle:.1} MiB idle (+{burst:.1} MiB); \
         holding costs {:.1} MiB more than that ({:.0} bytes a key)",
        holds - burst,
        (holds - burst) * support::MIB / held as f64
    );
    (idle, busy)
}

fn main() {
    let only = knobs::text("KAIROS_BENCH_ONLY").unwrap_or_default();
    let n = knobs::u64_or("KAIROS_BENCH_N", 50_000);
    let held = knobs::u64_or("KAIROS_BENCH_HELD", 100_000);
    let rt = support::runtime();
    if let Some(json) = knobs::text(CHILD_CONFIG) {
        return memory_child(&rt, &json);
    }
    let broker = Broker::own();
    println!(
        "worker_holds: {}, classic group protocol, {} cores",
        broker.describe(),
        std::thread::available_parallelism().map_or(0, usize::from)
    );
    let mut ok = true;
    if only.is_empty() || only == "none" {
        println!("no failures: {n} jobs over {KEYS} keys, no-op handler, concurrency {CONCURRENCY}");
        let pairs = compare(&rt, &broker, n, KEYS, false);
        let (r, [off, on], each) = median_pair(&pairs, |[off, on]| on.all / off.all);
        println!(
            "{}  hold-key on/off {r:.2}x, median of {RUNS} ({:.0} against {:.0} jobs/s in that run; each: {each:.2?}; target >= 0.95x)",
            support::pass(r >= 0.95),
            on.all,
            off.all
        );
        ok &= r >= 0.95;
    }
    if only.is_empty() || only == "failing" {
        // Five jobs a key, as many keys as that takes: enough jobs for the
        // healthy keys' rate to be timed over about a second.
        let n = knobs::u64_or("KAIROS_BENCH_FAILING_N", 500_000);
        let keys = (n / 5).max(100);
        println!("1 % of keys failing twice: {n} jobs over {keys} keys, retries after 100 ms");
        let pairs = compare(&rt, &broker, n, keys, true);
        let (r, [off, on], each) = median_pair(&pairs, |[off, on]| on.healthy / off.healthy);
        println!(
            "{}  hold-key/overtake {r:.2}x for the keys that never fail, median of {RUNS} ({:.0} against {:.0} jobs/s in that run; each: {each:.2?}; target >= 0.8x)",
            support::pass(r >= 0.8),
            on.healthy,
            off.healthy
        );
        println!(
            "      every job to the last: {:.2}x ({:.0} against {:.0} jobs/s: a held key's jobs run one after \
             another, each failing twice, by contract)",
            on.all / off.all,
            on.all,
            off.all
        );
        ok &= r >= 0.8;
    }
    if only == "handover" {
        let took = handover(&rt, &broker, held);
        println!(
            "hand-over: a second worker owns the 6 partitions with {held} keys held again after {took:.2?}"
        );
    }
    if only.is_empty() || only == "memory" {
        println!("memory: {held} keys held at once");
        let (idle, busy) = memory(&rt, &broker, held);
        let more = busy - idle;
        println!(
            "{}  worker RSS {busy:.1} MiB with {held} keys held, {idle:.1} MiB idle: {more:.1} MiB more ({:.0} bytes a key; target <= 64 MiB)",
            support::pass(more <= 64.0),
            more * support::MIB / held as f64
        );
        ok &= more <= 64.0;
    }
    drop(broker);
    if !ok {
        std::process::exit(1);
    }
}
