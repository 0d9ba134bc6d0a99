//! Recurring schedules at scale, through Apache Kafka, each case against
//! the plain job path measured in the same run.
//!
//! ```text
//! cargo bench --bench schedules                       # N = 1,000,000 schedules; 10,000 occurrences/s for 10 s
//! cargo bench --bench schedules -- 100000             # N = 100,000
//! KAIROS_BENCH_ONLY=held cargo bench --bench schedules    # or `fire`
//! KAIROS_BENCH_RATE=5000 KAIROS_BENCH_SECS=20 cargo bench --bench schedules
//! ```
//!
//! **(a) Held** (`held`). N schedule definitions (a yearly cron pattern,
//! so none comes due during the run; 36-character ids, a 100-byte
//! payload) are written to the schedules topic with `Schedules::upsert`,
//! all in flight at once; N jobs due in 30 days (36-character keys,
//! 100-byte payloads) with `Producer::enqueue` to another schedule topic:
//! the upsert rate against the enqueue rate. Then a `kairos scheduler`
//! process (the release binary, default settings) starts over each in
//! turn, and over neither: the time from its owning the partitions until
//! it holds all N (its `/status`, read every 100 ms: `schedules`, or
//! `pending`), and its memory 5 s later (VmRSS, and the peak VmHWM). Target: RSS ≤ 256 MB with N = 1,000,000
//! schedules held.
//!
//! **(b) Fire** (`fire`). R schedules (`KAIROS_BENCH_RATE`, 10,000) each
//! firing every second for S seconds (`KAIROS_BENCH_SECS`, 10) into a work
//! topic, through a `kairos scheduler` process: R occurrences per second,
//! their times spread evenly over each second (intervals of 1 s whose
//! starts are 0 to 999 ms apart).
//! Lateness of each occurrence: the fired record's CreateTime (stamped by
//! the scheduler's producer when it fires) − its nominal time. Baseline,
//! the same process afterwards: R plain jobs due each second for S
//! seconds, spread the same way, each second's written 2 s ahead (the schedules' lead), through
//! the same scheduler. Target: p99 ≤ 10 ms.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, DurationRound as _, Utc};
use kairos::schedules::{JobTemplate, Schedule, Schedules};
use kairos::wire::{Command as Cmd, Context, Limits, RecordView};
use kairos::{Config, Job, Producer};
use rdkafka::Message as _;

use common::Broker;
use support::{bench_dir, job_count, knobs, mem_of, mib, pass, runtime};

/// RSS target with N = 1,000,000 schedules held.
const RSS_TARGET_MIB: f64 = 256.0;
/// Lateness p99 target.
const P99_TARGET_MS: i64 = 10;

/// A `kairos scheduler` process with its admin endpoint, killed on drop.
struct Proc {
    child: Child,
    admin: SocketAddr,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn spawn(cfg: &Config, dir: &Path, name: &str) -> Proc {
        let admin = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port");
        let mut cfg = cfg.clone();
        cfg.scheduler.data_dir = dir.join(name);
        cfg.scheduler.admin.listen = Some(admin);
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, toml::to_string(&cfg).expect("config to TOML")).expect("write config");
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_kairos"))
            .args(["--config", path.to_str().expect("utf-8 path"), "scheduler"])
            .env("KAIROS_LOG", "warn")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn kairos scheduler");
        Proc { child, admin }
    }

    /// Its `/status` stats, once it answers.
    fn stats(&self) -> Option<serde_json::Value> {
        let (code, body) = kairos::admin::get(self.admin, "/status", None).ok()?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (code == 200).then(|| v["stats"].clone())
    }

    /// Once it owns its partitions: seconds from then until `field` of
    /// its stats reaches `n`.
    fn until(&self, field: &str, n: u64) -> f64 {
        let timeout = Duration::from_secs(1800);
        common::wait_for("the partitions owned", timeout, || {
            let s = self.stats()?;
            s["owned"].as_array().is_some_and(|o| !o.is_empty()).then_some(())
        });
        let t = Instant::now();
        common::wait_for(field, timeout, || {
            (self.stats()?[field].as_u64()? >= n).then_some(())
        });
        t.elapsed().as_secs_f64()
    }
}

fn definition(id: String, work: &str, payload: &str) -> Schedule {
    Schedule::cron(id, "0 0 0 1 1 *", JobTemplate::new(work, payload))
}

/// (a): upserts against enqueues, then a scheduler over each.
fn held(rt: &tokio::runtime::Runtime, broker: &Broker, n: u64) {
    let dir = bench_dir("kairos-bench-schedules-");
    let cfg = broker.config();
    let mut jobs_cfg = broker.config();
    jobs_cfg.topics.work = cfg.topics.work.clone();
    rt.block_on(kairos::topics::init(&cfg)).expect("topics");
    rt.block_on(kairos::topics::init(&jobs_cfg)).expect("topics");
    let work = cfg.topics.work[0].clone();
    let payload = "p".repeat(100);

    let schedules = Schedules::new(&cfg).expect("schedules client");
    let t = Instant::now();
    rt.block_on(async {
        for chunk in (0..n).collect::<Vec<_>>().chunks(50_000) {
            let defs: Vec<Schedule> = chunk
                .iter()
                .map(|i| definition(format!("{:036}", i), &work, &payload))
                .collect();
            let writes = defs.iter().map(|d| schedules.upsert(d));
            for r in futures::future::join_all(writes).await {
                r.expect("upsert");
            }
        }
    });
    let upsert_s = t.elapsed().as_secs_f64();
    let producer = Producer::new(&jobs_cfg).expect("producer");
    let due = Utc::now() + chrono::Duration::days(30);
    let t = Instant::now();
    rt.block_on(async {
        for chunk in (0..n).collect::<Vec<_>>().chunks(50_000) {
            let writes = chunk.iter().map(|i| {
                let job = Job::new(&work, format!("{:036}", i), payload.clone().into_bytes()).at(due);
                producer.enqueue(job).into_future()
            });
            for r in futures::future::join_all(writes).await {
                r.expect("enqueue");
            }
        }
    });
    let enqueue_s = t.elapsed().as_secs_f64();
    println!(
        "  upsert: ratio {:.2} of the job path ({:.0} definitions/s vs {:.0} jobs/s enqueued, N = {n})",
        enqueue_s / upsert_s,
        n as f64 / upsert_s,
        n as f64 / enqueue_s
    );

    let idle = {
        let mut empty = broker.config();
        empty.topics.work = cfg.topics.work.clone();
        rt.block_on(kairos::topics::init(&empty)).expect("topics");
        let p = Proc::spawn(&empty, dir.path(), "idle");
        p.until("fired", 0);
        std::thread::sleep(Duration::from_secs(5));
        mem_of(p.child.id())
    };
    let p = Proc::spawn(&cfg, dir.path(), "schedules");
    let hold_s = p.until("schedules", n);
    std::thread::sleep(Duration::from_secs(5));
    let with_schedules = mem_of(p.child.id());
    drop(p);
    let p = Proc::spawn(&jobs_cfg, dir.path(), "jobs");
    let pending_s = p.until("pending", n);
    std::thread::sleep(Duration::from_secs(5));
    let with_jobs = mem_of(p.child.id());
    drop(p);
    println!(
        "  held: RSS {:.1} MiB with {n} schedules (peak {:.1}), {:.1} MiB with {n} pending jobs (peak {:.1}), \
         {:.1} MiB with neither; RSS target ≤ {RSS_TARGET_MIB} MiB: {}",
        mib(with_schedules.rss),
        mib(with_schedules.hwm),
        mib(with_jobs.rss),
        mib(with_jobs.hwm),
        mib(idle.rss),
        pass(mib(with_schedules.rss) <= RSS_TARGET_MIB && mib(with_schedules.hwm) <= RSS_TARGET_MIB)
    );
    println!(
        "  take-over: ratio {:.2} of the job path ({hold_s:.1} s to hold {n} schedules, {pending_s:.1} s to hold {n} \
         pending jobs, from the partitions owned)",
        pending_s / hold_s
    );
}

/// Lateness (ms) of each record on `topic` (CreateTime − run-at).
fn lateness(cfg: &Config, topic: &str) -> Vec<i64> {
    let mut out: Vec<i64> = common::read_all(
        &cfg.kafka.brokers,
        topic,
        "read_committed",
        Duration::from_secs(60),
    )
    .iter()
    .filter_map(|m| {
        let view = RecordView::from_message(m);
        match kairos::wire::decode(&view, Context::Work, &Limits::default()) {
            Ok(Cmd::Schedule(j)) => Some(m.timestamp().to_millis()? - j.run_at.timestamp_millis()),
            _ => None,
        }
    })
    .collect();
    out.sort_unstable();
    out
}

/// Where the `i`-th schedule (or job) falls within each second: spread
/// evenly, as due jobs at a steady rate are.
fn spread(i: u64) -> chrono::Duration {
    chrono::Duration::milliseconds((i % 1000) as i64)
}

fn pct(sorted: &[i64], q: f64) -> i64 {
    sorted
        .get(((sorted.len() as f64 - 1.0) * q).round() as usize)
        .copied()
        .unwrap_or(-1)
}

/// (b): R occurrences/s against R plain jobs/s, one scheduler process.
fn fire(rt: &tokio::runtime::Runtime, broker: &Broker, rate: u64, secs: i64) {
    let dir = bench_dir("kairos-bench-schedules-");
    let cfg = broker.config();
    rt.block_on(kairos::topics::init(&cfg)).expect("topics");
    let mut plain = cfg.clone();
    plain.topics.work = vec![
        cfg.topics.work[0].clone(),
        format!("{}.plain", cfg.topics.work[0]),
    ];
    rt.block_on(kairos::topics::init(&plain)).expect("topics");
    let p = Proc::spawn(&plain, dir.path(), "fire");
    p.until("fired", 0);
    let work = cfg.topics.work[0].clone();
    let schedules = Schedules::new(&cfg).expect("schedules client");
    let start = Utc::now()
        .duration_trunc(chrono::Duration::seconds(1))
        .expect("trunc")
        + chrono::Duration::seconds(15);
    rt.block_on(async {
        let defs: Vec<Schedule> = (0..rate)
            .map(|i| {
                let mut s = Schedule::every(
                    format!("tick-{i:06}"),
                    Duration::from_secs(1),
                    JobTemplate::new(&work, "tick"),
                );
                let first = start + spread(i);
                s.start = Some(first);
                s.end = Some(first + chrono::Duration::seconds(secs - 1));
                s
            })
            .collect();
        for r in futures::future::join_all(defs.iter().map(|d| schedules.upsert(d))).await {
            r.expect("upsert");
        }
    });
    p.until("schedules", rate);
    let wait = (start - Utc::now()).to_std().unwrap_or_default();
    assert!(
        wait > Duration::ZERO,
        "the {rate} schedules took over 15 s to be read"
    );
    let want = rate * secs as u64;
    std::thread::sleep(wait);
    p.until("fired", want);
    let occurrences = lateness(&cfg, &work);

    // Baseline: plain jobs through the same process, each second's 2 s ahead.
    let producer = Producer::new(&plain).expect("producer");
    let plain_work = plain.topics.work[1].clone();
    let first = Utc::now()
        .duration_trunc(chrono::Duration::seconds(1))
        .expect("trunc")
        + chrono::Duration::seconds(4);
    rt.block_on(async {
        for s in 0..secs {
            let at: DateTime<Utc> = first + chrono::Duration::seconds(s);
            let write_at = at - chrono::Duration::seconds(2);
            if let Ok(d) = (write_at - Utc::now()).to_std() {
                tokio::time::sleep(d).await;
            }
            let writes = (0..rate).map(|i| {
                producer
                    .enqueue(
                        Job::new(&plain_work, format!("tick-{i:06}"), b"tick".to_vec()).at(at + spread(i)),
                    )
                    .into_future()
            });
            for r in futures::future::join_all(writes).await {
                r.expect("enqueue");
            }
        }
    });
    p.until("fired", 2 * want);
    drop(p);
    let jobs = lateness(&plain, &plain_work);
    let (o50, o99, j50, j99) = (
        pct(&occurrences, 0.5),
        pct(&occurrences, 0.99),
        pct(&jobs, 0.5),
        pct(&jobs, 0.99),
    );
    println!(
        "  fire: lateness p99 ratio {:.2} of plain jobs (occurrences p50 {o50} ms, p99 {o99} ms, max {} ms, {} fired; \
         plain jobs p50 {j50} ms, p99 {j99} ms, {} fired; {rate}/s for {secs} s); p99 target ≤ {P99_TARGET_MS} ms: {}",
        o99 as f64 / j99.max(1) as f64,
        occurrences.last().copied().unwrap_or(-1),
        occurrences.len(),
        jobs.len(),
        pass(o99 <= P99_TARGET_MS)
    );
}

fn main() {
    let n = job_count(1_000_000);
    let rate = knobs::u64_or("KAIROS_BENCH_RATE", 10_000);
    let secs = knobs::u64_or("KAIROS_BENCH_SECS", 10) as i64;
    let only = knobs::text("KAIROS_BENCH_ONLY");
    let rt = runtime();
    let broker = Broker::own();
    println!(
        "schedules: N = {n} schedules held, {rate} occurrences/s for {secs} s, {}, {} cores, `kairos scheduler` = {}",
        broker.describe(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        env!("CARGO_BIN_EXE_kairos"),
    );
    if only.as_deref().is_none_or(|o| o == "held") {
        held(&rt, &broker, n);
    }
    if only.as_deref().is_none_or(|o| o == "fire") {
        fire(&rt, &broker, rate, secs);
    }
}
