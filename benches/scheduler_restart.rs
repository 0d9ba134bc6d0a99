//! Restart of a `kairos scheduler` process killed with SIGKILL while holding
//! P pending jobs: time from the restart to the first fire, and that no
//! pending job was lost; against the same restart with an empty store, in
//! the same run.
//!
//! ```text
//! cargo bench --bench scheduler_restart                 # P = 10,000,000
//! cargo bench --bench scheduler_restart -- 1000000      # P = 1,000,000
//! KAIROS_BENCH_ROUNDS=5 cargo bench --bench scheduler_restart
//! KAIROS_BENCH_MEMBERSHIP=dynamic cargo bench --bench scheduler_restart   # or `static`; default both
//! KAIROS_BENCH_DIR=/some/disk cargo bench --bench scheduler_restart
//! ```
//!
//! Per case (P = 0, then P):
//! 1. Topics on Apache Kafka (as in the integration tests); the
//!    scheduler's sled store pre-filled directly with `Store::apply`: P jobs
//!    (36-char keys, 100-byte payloads) with run-ats uniform over the 30 days
//!    starting 30 days from now, spread round-robin over the schedule
//!    partitions, each partition's checkpoint at the changelog's end offset
//!    (so catching up has nothing to replay). Filling 10M through the
//!    broker would take hours on this machine; the store is what a restart reads.
//! 2. Five jobs due 3 s later go through the broker; `kairos scheduler`
//!    starts (config TOML beside the store, `session.timeout.ms` = 6000 and
//!    `heartbeat.interval.ms` = 500 so a killed member's partitions move
//!    quickly); the bench waits until it owns its partitions (its log) and the
//!    five have fired (a consumer on the work topic).
//! 3. Rounds (`KAIROS_BENCH_ROUNDS`, 3): kill -9; enqueue one job due 1 s
//!    later; start the process again on the same store; measure the time to
//!    that job's fire (the consumer receiving it). The process's log gives
//!    when it owned its partitions again and the pending count it found.
//! 4. A last kill -9; the bench opens the store itself, timed (sled's
//!    recovery after a crash: what every restart pays before it can join the
//!    group), and compares its pending count with P.
//!
//! Membership (`KAIROS_BENCH_MEMBERSHIP` = `both` (default), `dynamic` or
//! `static`), measured one after the other on the same store and process
//! history: `dynamic` is the configuration above: a new member waits for the
//! group to expire the killed one (the session timeout) before it gets the
//! partitions. `static` adds `group.instance.id`, so the restarted process
//! takes its partitions back at once; it shows what the restart itself costs.
//! The switch from dynamic to static is one extra restart, not counted.

#[path = "../tests/common/mod.rs"]
mod common;
mod support;

use support::{bench_dir, job_count, knobs, runtime};

use std::collections::HashSet;
use std::fs::File;
use std::future::IntoFuture;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use common::{Broker, ChildGuard};
use kairos::scheduler::store::{Change, Store};
use kairos::scheduler::stored::StoredJob;
use kairos::wire::header;
use kairos::{Config, Job, JobId, Producer};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::Message;

const PAYLOAD_BYTES: usize = 100;
const DAY_MS: i64 = 24 * 3600 * 1000;
/// Jobs per `Store::apply` while filling.
const FILL_BATCH: usize = 10_000;
/// sled page cache while filling (the process uses its configured 16 MiB).
const FILL_CACHE: u64 = 512 << 20;
/// Jobs due shortly after the first start.
const FIRST_JOBS: usize = 5;
const TARGET_SECS: f64 = 2.0;
/// Longest wait for one start (a slow disk with 10M jobs included).
const START_TIMEOUT: Duration = Duration::from_secs(900);

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        f64::NAN
    } else {
        s[s.len() / 2]
    }
}

fn dir_size(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else { return 0 };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

// ------------------------------------------------------------------ prefill

/// Changelog end offset of every partition.
fn changelog_ends(cfg: &Config) -> Vec<i64> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .expect("client");
    (0..cfg.topics.schedule_partitions)
        .map(|p| {
            c.fetch_watermarks(&cfg.topics.changelog, p, Duration::from_secs(10))
                .expect("changelog watermarks")
                .1
        })
        .collect()
}

/// Fill the store with `n` far-future jobs; returns seconds taken.
fn prefill(cfg: &Config, n: u64) -> f64 {
    let started = Instant::now();
    let parts = cfg.topics.schedule_partitions;
    let ends = changelog_ends(cfg);
    let store = Store::open(&cfg.scheduler.data_dir, FILL_CACHE).expect("open store");
    let mut rng = StdRng::seed_from_u64(0x0072_6573_7461_7274);
    let base_ms = Utc::now().timestamp_millis() + 30 * DAY_MS;
    let mut seqs = vec![0u64; parts as usize];
    let work = cfg.topics.work[0].clone();
    let mut made = 0u64;
    let report_every = (n / 10).max(FILL_BATCH as u64);
    while made < n {
        let batch = (n - made).min(FILL_BATCH as u64);
        let mut by_part: Vec<Vec<Change>> = vec![Vec::new(); parts as usize];
        for _ in 0..batch {
            let p = (made % parts as u64) as usize;
            made += 1;
            let mut id = [0u8; 10];
            rng.fill_bytes(&mut id);
            let id = uuid::Builder::from_unix_timestamp_millis(base_ms as u64 + made, &id).into_uuid();
            let mut key = [0u8; 16];
            rng.fill_bytes(&mut key);
            let key = uuid::Builder::from_random_bytes(key)
                .into_uuid()
                .hyphenated()
                .to_string();
            let mut payload = vec![0u8; PAYLOAD_BYTES];
            rng.fill_bytes(&mut payload);
            let run_at = Utc
                .timestamp_millis_opt(base_ms + rng.gen_range(0..30 * DAY_MS))
                .single()
                .expect("run-at");
            let job = Job::new(&work, key, payload).id(JobId::from(id)).at(run_at);
            by_part[p].push(Change::Put(StoredJob { job, seq: seqs[p] }));
            seqs[p] += 1;
        }
        for (p, changes) in by_part.iter().enumerate() {
            if !changes.is_empty() {
                store.apply(p as i32, changes, Some(ends[p])).expect("apply");
            }
        }
        if made % report_every < batch || made == n {
            store.flush().expect("flush");
            let secs = started.elapsed().as_secs_f64();
            println!(
                "    filled {made:>10} jobs in {secs:>7.1} s ({:.0} jobs/s)",
                made as f64 / secs
            );
        }
    }
    store.flush().expect("flush");
    let pending: u64 = (0..parts)
        .map(|p| store.checkpoint(p).expect("checkpoint").pending)
        .sum();
    assert_eq!(pending, n, "pending after the fill");
    drop(store);
    started.elapsed().as_secs_f64()
}

/// Pending jobs of every partition, from the store's checkpoints (the
/// process must not be running).
fn store_pending(cfg: &Config) -> u64 {
    let store = Store::open(&cfg.scheduler.data_dir, cfg.scheduler.cache_capacity).expect("open store");
    (0..cfg.topics.schedule_partitions)
        .map(|p| store.checkpoint(p).expect("checkpoint").pending)
        .sum()
}

// ------------------------------------------------------------------ the work topic

/// A fire as the bench's consumer saw it.
#[derive(Clone, Copy)]
struct Fired {
    at: Instant,
    id: JobId,
}

/// Reads the work topic from the start on its own thread until stopped.
struct Watcher {
    seen: Arc<Mutex<Vec<Fired>>>,
    stop: Arc<AtomicBool>,
    done: JoinHandle<()>,
}

fn watch(cfg: &Config) -> Watcher {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let (s, st) = (seen.clone(), stop.clone());
    let brokers = cfg.kafka.brokers.clone();
    let topic = cfg.topics.work[0].clone();
    let done = std::thread::spawn(move || {
        let consumer = common::reader(&brokers, "bench-watch", &[]);
        common::assign_from_start(&consumer, &topic);
        while !st.load(Ordering::Relaxed) {
            let Some(m) = consumer.poll(Duration::from_millis(20)) else {
                continue;
            };
            let at = Instant::now();
            let m = m.expect("consume");
            let id = m
                .headers()
                .and_then(|hs| hs.iter().find(|h| h.key == header::ID).and_then(|h| h.value))
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<JobId>().ok())
                .expect("fired record has a kairos-id");
            s.lock().expect("lock").push(Fired { at, id });
        }
    });
    Watcher { seen, stop, done }
}

impl Watcher {
    fn find(&self, id: &JobId) -> Option<Instant> {
        self.seen
            .lock()
            .expect("lock")
            .iter()
            .find(|f| f.id == *id)
            .map(|f| f.at)
    }

    fn wait_for(&self, id: &JobId, timeout: Duration) -> Instant {
        common::wait_for("a job to fire", timeout, || self.find(id))
    }

    fn all(&self) -> Vec<Fired> {
        self.seen.lock().expect("lock").clone()
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.done.join();
    }
}

// ------------------------------------------------------------------ the process

/// A `kairos scheduler` process, killed with SIGKILL when dropped.
struct Proc {
    child: ChildGuard,
    /// Wall-clock time it was spawned (to place its log lines).
    spawned_wall: DateTime<Utc>,
    spawned: Instant,
    log: PathBuf,
}

fn spawn(cfg_path: &Path, log: PathBuf) -> Proc {
    let out = File::create(&log).expect("log file");
    let spawned_wall = Utc::now();
    let spawned = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["--config", cfg_path.to_str().expect("utf-8 path"), "scheduler"])
        .env("KAIROS_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(out))
        .spawn()
        .expect("spawn kairos scheduler");
    Proc {
        child: ChildGuard(child),
        spawned_wall,
        spawned,
        log,
    }
}

impl Proc {
    /// kill -9, and wait until it is gone.
    fn kill9(mut self) {
        self.child.kill().expect("kill -9");
        self.child.wait().expect("wait");
    }

    /// Partitions assigned so far per its log: (count, pending summed, ms
    /// after spawn of the last assignment).
    fn assigned(&self) -> (usize, Assigned) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut count = 0;
        let mut pending = 0u64;
        let mut last_ms = f64::NAN;
        let mut catch_up_ms = 0.0;
        for line in strip_ansi(&text).lines() {
            if line.contains("schedule partitions caught up") {
                catch_up_ms += field(line, "elapsed").and_then(debug_duration_ms).unwrap_or(0.0);
                continue;
            }
            if !line.contains("schedule partition assigned") {
                continue;
            }
            count += 1;
            pending += field(line, "pending").and_then(|v| v.parse().ok()).unwrap_or(0);
            if let Some(t) = line
                .split_whitespace()
                .next()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            {
                last_ms = (t.with_timezone(&Utc) - self.spawned_wall)
                    .num_microseconds()
                    .unwrap_or(0) as f64
                    / 1000.0;
            }
        }
        (
            count,
            Assigned {
                pending,
                ms: last_ms,
                catch_up_ms,
            },
        )
    }

    fn wait_assigned(&self, partitions: usize, timeout: Duration) -> Assigned {
        common::wait_for("the process to own its partitions", timeout, || {
            let (n, a) = self.assigned();
            (n >= partitions).then_some(a)
        })
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// What a process's log says about its partitions.
#[derive(Clone, Copy)]
struct Assigned {
    /// Pending jobs it found, summed over its partitions (after catching up).
    pending: u64,
    /// When it owned the last of them, ms after spawn.
    ms: f64,
    /// Time its changelog catch-ups took, summed (ms).
    catch_up_ms: f64,
}

/// A `Duration` as `Debug` prints it (`1.5s`, `3.2ms`, `870µs`, `12ns`), in ms.
fn debug_duration_ms(text: &str) -> Option<f64> {
    for (unit, scale) in [("ms", 1.0), ("µs", 1e-3), ("us", 1e-3), ("ns", 1e-6), ("s", 1e3)] {
        if let Some(n) = text.strip_suffix(unit) {
            return n.parse::<f64>().ok().map(|v| v * scale);
        }
    }
    None
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The value of `name=value` in a log line.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
}

// ------------------------------------------------------------------ one case

/// Restarts measured under one membership setting.
struct Variant {
    name: &'static str,
    /// Restart → the job fired, per round (s).
    to_fire: Vec<f64>,
    /// Restart → every partition owned again, per round (ms, from its log).
    to_assigned: Vec<f64>,
    /// Changelog catch-up time within that, per round (ms, from its log).
    catch_up: Vec<f64>,
    /// Restart → the job's run-at, per round (s): the floor.
    due_after: Vec<f64>,
    /// Pending the process found at each restart (after catching up).
    pending_at_restart: Vec<u64>,
}

struct Case {
    pending: u64,
    fill_secs: f64,
    disk_bytes: u64,
    /// First start on the (filled) store: spawn → every partition owned (ms).
    first_start_assigned_ms: f64,
    /// After the last kill -9: `Store::open` plus reading the checkpoints (ms).
    open_after_kill_ms: f64,
    variants: Vec<Variant>,
    /// Pending in the store after the last run.
    pending_after: u64,
    /// Jobs fired, distinct jobs fired, jobs expected to fire.
    fired: usize,
    fired_distinct: usize,
    expected_fired: usize,
}

impl Case {
    fn lost(&self) -> bool {
        self.pending_after != self.pending
            || self
                .variants
                .iter()
                .any(|v| v.pending_at_restart.iter().any(|n| *n != self.pending))
            || self.fired_distinct != self.expected_fired
    }
}

/// Everything one case needs while it runs.
struct Ctx<'a> {
    rt: &'a tokio::runtime::Runtime,
    producer: Producer,
    work: String,
    watcher: Watcher,
    dir: &'a Path,
    parts: usize,
    expected: Vec<JobId>,
    runs: usize,
}

impl Ctx<'_> {
    fn enqueue(&mut self, at: DateTime<Utc>) -> JobId {
        let key = format!("bench-{}", self.expected.len());
        let id = self
            .rt
            .block_on(
                self.producer
                    .enqueue(Job::new(&self.work, key, b"restart".to_vec()))
                    .at(at)
                    .into_future(),
            )
            .expect("enqueue");
        self.expected.push(id);
        id
    }

    fn spawn(&mut self, cfg_path: &Path) -> Proc {
        self.runs += 1;
        spawn(cfg_path, self.dir.join(format!("run-{}.log", self.runs)))
    }

    /// kill -9 `proc`, enqueue a job due 1 s later, start again on `cfg_path`,
    /// wait for that job to fire. Returns the new process and what it took.
    fn restart(&mut self, proc: Proc, cfg_path: &Path) -> (Proc, f64, Assigned, f64) {
        proc.kill9();
        let run_at = Utc::now() + chrono::Duration::seconds(1);
        let id = self.enqueue(run_at);
        let mut proc = self.spawn(cfg_path);
        let due = (run_at - proc.spawned_wall).num_milliseconds() as f64 / 1000.0;
        let fired_at = common::wait_for("the restart job to fire", START_TIMEOUT, || {
            if let Ok(Some(st)) = proc.child.try_wait() {
                panic!("scheduler exited: {st}; log:\n{}", proc.log_tail());
            }
            self.watcher.find(&id)
        });
        let secs = (fired_at - proc.spawned).as_secs_f64();
        let a = proc.wait_assigned(self.parts, Duration::from_secs(30));
        (proc, secs, a, due)
    }
}

fn case(rt: &tokio::runtime::Runtime, broker: &Broker, p: u64, rounds: u64, memberships: &[bool]) -> Case {
    let dir = bench_dir("kairos-bench-restart-");
    let mut cfg = broker.config();
    cfg.scheduler.data_dir = dir.path().join("store");
    cfg.scheduler.group_id = common::unique("bench-sched");
    cfg.kafka
        .consumer
        .insert("session.timeout.ms".into(), "6000".into());
    cfg.kafka
        .consumer
        .insert("heartbeat.interval.ms".into(), "500".into());
    let mut static_cfg = cfg.clone();
    static_cfg.scheduler.instance_id = common::unique("bench-member");
    cfg.scheduler.static_membership = false;
    rt.block_on(kairos::topics::init(&cfg)).expect("topics");
    let paths = [
        dir.path().join("scheduler.toml"),
        dir.path().join("scheduler-static.toml"),
    ];
    for (path, c) in paths.iter().zip([&cfg, &static_cfg]) {
        std::fs::write(path, toml::to_string(c).expect("config to TOML")).expect("write config");
    }
    let parts = cfg.topics.schedule_partitions as usize;

    let fill_secs = if p > 0 { prefill(&cfg, p) } else { 0.0 };
    let disk_bytes = dir_size(&cfg.scheduler.data_dir);
    if p > 0 {
        println!(
            "    store: {:.0} MiB on disk",
            disk_bytes as f64 / (1024.0 * 1024.0)
        );
    }

    let mut ctx = Ctx {
        rt,
        producer: Producer::new(&cfg).expect("producer"),
        work: cfg.topics.work[0].clone(),
        watcher: watch(&cfg),
        dir: dir.path(),
        parts,
        expected: Vec::new(),
        runs: 0,
    };
    let first: Vec<JobId> = (0..FIRST_JOBS)
        .map(|_| ctx.enqueue(Utc::now() + chrono::Duration::seconds(3)))
        .collect();
    let first_path = &paths[usize::from(memberships[0])];
    let mut proc = ctx.spawn(first_path);
    let a0 = proc.wait_assigned(parts, START_TIMEOUT);
    for id in &first {
        ctx.watcher.wait_for(id, START_TIMEOUT);
    }
    println!(
        "    first start: owned {parts} partitions {:.0} ms after spawn (catch-up {:.1} ms), pending {}; \
         {FIRST_JOBS} jobs fired {:.2} s after spawn",
        a0.ms,
        a0.catch_up_ms,
        a0.pending,
        proc.spawned.elapsed().as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(1)); // their deletes reach the store

    let mut variants = Vec::new();
    for (k, static_member) in memberships.iter().enumerate() {
        let path = &paths[usize::from(*static_member)];
        let name = if *static_member {
            "static membership"
        } else {
            "dynamic membership"
        };
        if k > 0 {
            // Switching membership: one restart, not measured (a static member
            // joining still waits for the killed dynamic one to expire).
            let (next, secs, ..) = ctx.restart(proc, path);
            proc = next;
            println!("    switch to {name}: first fire {secs:.2} s after restart (not counted)");
            std::thread::sleep(Duration::from_secs(1));
        }
        let mut v = Variant {
            name,
            to_fire: Vec::new(),
            to_assigned: Vec::new(),
            catch_up: Vec::new(),
            due_after: Vec::new(),
            pending_at_restart: Vec::new(),
        };
        for round in 1..=rounds {
            let (next, secs, a, due) = ctx.restart(proc, path);
            proc = next;
            println!(
                "    {name} restart {round}: first fire {secs:.2} s after restart (job due {due:.2} s after), \
                 partitions owned after {:.0} ms (catch-up {:.1} ms), pending found {}",
                a.ms, a.catch_up_ms, a.pending
            );
            v.to_fire.push(secs);
            v.to_assigned.push(a.ms);
            v.catch_up.push(a.catch_up_ms);
            v.due_after.push(due);
            v.pending_at_restart.push(a.pending);
            std::thread::sleep(Duration::from_secs(1));
        }
        variants.push(v);
    }
    proc.kill9();
    std::thread::sleep(Duration::from_millis(500)); // the last fires reach the watcher
    let fired = ctx.watcher.all();
    let expected = std::mem::take(&mut ctx.expected);
    ctx.watcher.stop();
    let distinct: HashSet<JobId> = fired.iter().map(|f| f.id).collect();
    let opened = Instant::now();
    let pending_after = store_pending(&cfg);
    let open_after_kill_ms = opened.elapsed().as_secs_f64() * 1000.0;
    let missing = expected.iter().filter(|id| !distinct.contains(id)).count();
    assert_eq!(missing, 0, "jobs that never fired");
    Case {
        pending: p,
        fill_secs,
        disk_bytes,
        first_start_assigned_ms: a0.ms,
        open_after_kill_ms,
        variants,
        pending_after,
        fired: fired.len(),
        fired_distinct: distinct.len(),
        expected_fired: expected.len(),
    }
}

fn list(v: &[f64]) -> String {
    v.iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", ")
}

fn describe(c: &Case) {
    for v in &c.variants {
        println!(
            "  P = {}, {}: restart → first fire median {:.2} s (rounds {}), partitions owned after median {:.0} ms \
             (catch-up {:.1} ms), job due {:.2} s after restart; pending found at restarts {:?}",
            c.pending,
            v.name,
            median(&v.to_fire),
            list(&v.to_fire),
            median(&v.to_assigned),
            median(&v.catch_up),
            median(&v.due_after),
            v.pending_at_restart,
        );
    }
    println!(
        "  P = {}: after a last kill -9 the store opened in {:.0} ms and holds {} pending ({}); \
         fired {} records, {} distinct, {} expected",
        c.pending,
        c.open_after_kill_ms,
        c.pending_after,
        if c.lost() { "LOST JOBS" } else { "nothing lost" },
        c.fired,
        c.fired_distinct,
        c.expected_fired,
    );
}

// ------------------------------------------------------------------ main

fn main() {
    let p = job_count(10_000_000);
    let rounds = knobs::u64_or("KAIROS_BENCH_ROUNDS", 3).max(1);
    let membership = knobs::text("KAIROS_BENCH_MEMBERSHIP").unwrap_or_else(|| "both".into());
    let memberships: Vec<bool> = match membership.as_str() {
        "static" => vec![true],
        "dynamic" => vec![false],
        _ => vec![false, true],
    };
    let rt = runtime();
    let broker = Broker::own();
    println!(
        "scheduler_restart: P = {p} pending, {rounds} kill -9 + restart rounds per membership setting, \
         {}, classic group protocol, {} cores, 3 schedule partitions, `kairos scheduler` = {}",
        broker.describe(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        env!("CARGO_BIN_EXE_kairos"),
    );
    println!("empty store");
    let empty = case(&rt, &broker, 0, rounds, &memberships);
    describe(&empty);
    println!("P = {p}");
    let full = case(&rt, &broker, p, rounds, &memberships);
    println!(
        "  store filled in {:.1} s ({:.0} jobs/s), {:.0} MiB",
        full.fill_secs,
        p as f64 / full.fill_secs.max(1e-9),
        full.disk_bytes as f64 / (1024.0 * 1024.0)
    );
    describe(&full);
    println!("summary:");
    for (e, f) in empty.variants.iter().zip(&full.variants) {
        let (em, fm) = (median(&e.to_fire), median(&f.to_fire));
        println!(
            "  {}: restart→first fire ratio P={p}/empty = {:.2} ({fm:.2} s vs {em:.2} s, medians of {rounds}; \
             partitions owned after {:.0} ms vs {:.0} ms; job due {:.2} s after restart) — target < {TARGET_SECS} s \
             at P={p}: {}",
            f.name,
            fm / em,
            median(&f.to_assigned),
            median(&e.to_assigned),
            median(&f.due_after),
            support::pass(fm < TARGET_SECS),
        );
    }
    println!(
        "  first start on the filled store: partitions owned {:.0} ms after spawn (empty: {:.0} ms)",
        full.first_start_assigned_ms, empty.first_start_assigned_ms
    );
    println!(
        "  Store::open + checkpoints after kill -9, in the bench: {:.0} ms at P={p} vs {:.0} ms empty (ratio {:.1})",
        full.open_after_kill_ms,
        empty.open_after_kill_ms,
        full.open_after_kill_ms / empty.open_after_kill_ms.max(1e-3)
    );
    println!(
        "  pending kept across kill -9: {} (P = {p}: found {:?} at restarts, {} in the store after the run; \
         {} of {} jobs due fired, {} records)",
        if full.lost() || empty.lost() { "NO" } else { "yes" },
        full.variants
            .iter()
            .flat_map(|v| v.pending_at_restart.iter())
            .collect::<Vec<_>>(),
        full.pending_after,
        full.fired_distinct,
        full.expected_fired,
        full.fired,
    );
}
