//! Memory of the scheduler's disk-backed store at N pending jobs, against
//! the Redis sorted-set design (score = run-at ms, member = the job's bytes)
//! holding the same N jobs, measured in the same run.
//!
//! ```text
//! cargo bench --bench scheduler_memory              # N = 10,000,000
//! cargo bench --bench scheduler_memory -- 1000000   # quick run
//! KAIROS_BENCH_DIR=/some/disk cargo bench --bench scheduler_memory
//! ```
//!
//! 1. Fills a sled [`Store`] (16 MiB cache, as the default config) with N
//!    jobs in ingest batches of 2000, one flush (fsync) per batch, printing
//!    the process's memory every 1M jobs; then builds a [`TimerWheel`]
//!    (60 s span, 100,000 capacity) and refills it once.
//! 2. Starts `redis-server` (no persistence), ZADDs the same N jobs, reads
//!    `INFO memory`.
//! 3. Prints the table and PASS/FAIL per target (never aborts on a FAIL).

mod support;

use std::time::Instant;

use kairos::scheduler::store::Store;
use kairos::scheduler::timer_wheel::TimerWheel;
use support::*;

const SEED: u64 = 0x6b61_6972_6f73;
const SPREAD_MS: i64 = 30 * 24 * 3600 * 1000;
const CHECKPOINT: u64 = 1_000_000;

/// Targets of the issue (MB read as MiB).
const TARGET_RSS_AT_10M: u64 = 256 << 20;
const TARGET_GROWTH_1M_TO_10M: u64 = 64 << 20;
const TARGET_REDIS_RATIO: f64 = 10.0;

fn main() {
    let n = job_count(10_000_000);
    let dir = bench_dir("kairos-bench-mem-");
    println!(
        "scheduler_memory: N = {n} jobs ({PAYLOAD_BYTES}-byte payloads, 36-char keys, run-at over 30 days, \
         {PARTITIONS} partitions), store in {}",
        dir.path().display()
    );
    let at_start = mem();
    println!(
        "before open: VmRSS {:.1} MiB, VmHWM {:.1} MiB",
        mib(at_start.rss),
        mib(at_start.hwm)
    );

    // ------------------------------------------------------------ the scheduler
    let store = Store::open(&dir.path().join("store"), CACHE_BYTES).expect("open store");
    let base_ms = now_ms();
    let mut gen = JobGen::new(SEED, base_ms, SPREAD_MS);
    let progress_every = CHECKPOINT.min((n / 10).max(INGEST_BATCH as u64));
    let mut at_1m: Option<Mem> = None;
    let mut filled = 0u64;
    let started = Instant::now();
    println!(
        "{:>12} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "pending", "secs", "jobs/s", "VmRSS MiB", "VmHWM MiB", "anon MiB", "file MiB", "disk MiB"
    );
    while filled < n {
        let batch = (n - filled).min(INGEST_BATCH as u64);
        let jobs = (0..batch).map(|_| gen.next_job());
        for (p, changes) in puts_by_partition(jobs) {
            store.apply(p, &changes, None).expect("apply");
        }
        store.flush().expect("flush");
        let before = filled;
        filled += batch;
        let crossed = |step: u64| before / step != filled / step;
        if crossed(CHECKPOINT) && filled / CHECKPOINT == 1 {
            at_1m = Some(mem());
        }
        if crossed(progress_every) || filled == n {
            let m = mem();
            let secs = started.elapsed().as_secs_f64();
            println!(
                "{filled:>12} {secs:>9.1} {:>10.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                filled as f64 / secs,
                mib(m.rss),
                mib(m.hwm),
                mib(m.anon),
                mib(m.file),
                mib(store.size_on_disk().unwrap_or(0)),
            );
        }
    }
    let fill_secs = started.elapsed().as_secs_f64();

    let mut wheel = TimerWheel::new(WHEEL_SPAN_MS, WHEEL_CAPACITY);
    for p in 0..PARTITIONS {
        wheel.add_partition(p);
        // The cascader's step, as the scheduler does it before a refill.
        store.cascade(p, base_ms + 2 * WHEEL_SPAN_MS).expect("cascade");
    }
    let wheel = std::sync::Mutex::new(wheel);
    kairos::scheduler::refill::refill(&wheel, &store, base_ms).expect("refill");
    let wheel = wheel.into_inner().expect("wheel");
    let at_n = mem();
    let disk = store.size_on_disk().expect("size on disk");
    println!(
        "filled in {fill_secs:.1} s ({:.0} jobs/s); timer wheel holds {} jobs after one refill; \
         VmRSS {:.1} MiB, VmHWM {:.1} MiB, disk {:.1} MiB",
        n as f64 / fill_secs,
        wheel.len(),
        mib(at_n.rss),
        mib(at_n.hwm),
        mib(disk)
    );
    drop(wheel);
    drop(store);

    // ------------------------------------------------------------ Redis
    let redis = RedisServer::start(&[]).expect("start redis-server");
    let mut c = redis.connect().expect("connect to redis");
    let baseline = c.info("memory").expect("INFO memory");
    let version = c
        .info("server")
        .ok()
        .and_then(|m| m.get("redis_version").cloned())
        .unwrap_or_default();
    let mut gen = JobGen::new(SEED, base_ms, SPREAD_MS);
    let started = Instant::now();
    let items = (0..n).map(|_| {
        let (_, s) = gen.next_job();
        (s.job.run_at.timestamp_millis(), s.encode())
    });
    let added = zadd_all(&mut c, items, INGEST_BATCH, 8).expect("ZADD");
    let redis_secs = started.elapsed().as_secs_f64();
    let card = c.call(&[b"ZCARD", ZKEY]).expect("ZCARD").int() as u64;
    assert_eq!((added, card), (n, n), "Redis holds every job once");
    let info = c.info("memory").expect("INFO memory");
    let field = |m: &std::collections::HashMap<String, String>, k: &str| -> u64 {
        m.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let used = field(&info, "used_memory");
    let used_rss = field(&info, "used_memory_rss");
    let used_empty = field(&baseline, "used_memory");
    println!(
        "redis-server {}: {n} jobs ZADDed in {redis_secs:.1} s ({:.0} jobs/s); used_memory {:.1} MiB \
         (empty: {:.1} MiB), used_memory_rss {:.1} MiB",
        version,
        n as f64 / redis_secs,
        mib(used),
        mib(used_empty),
        mib(used_rss)
    );
    drop(c);
    drop(redis);

    // ------------------------------------------------------------ report
    let growth = at_1m.map(|m| at_n.rss as i64 - m.rss as i64);
    let ratio = used as f64 / at_n.rss as f64;
    println!();
    println!("| metric | value |");
    println!("|---|---|");
    println!("| ratio Redis used_memory / scheduler VmRSS at N | **{ratio:.1}x** |");
    println!(
        "| ratio Redis used_memory_rss / scheduler VmRSS at N | {:.1}x |",
        used_rss as f64 / at_n.rss as f64
    );
    match at_1m {
        Some(m) => println!(
            "| scheduler VmRSS at 1M pending | {:.1} MiB (VmHWM {:.1} MiB) |",
            mib(m.rss),
            mib(m.hwm)
        ),
        None => println!("| scheduler VmRSS at 1M pending | n/a (N < 1M) |"),
    }
    println!(
        "| scheduler VmRSS at N = {n} pending | {:.1} MiB (VmHWM {:.1} MiB) |",
        mib(at_n.rss),
        mib(at_n.hwm)
    );
    if let Some(g) = growth {
        println!("| VmRSS growth 1M → N | {:+.1} MiB |", g as f64 / MIB);
        if n > CHECKPOINT {
            println!(
                "| VmRSS growth per extra job (1M → N) | {:.1} bytes |",
                g as f64 / (n - CHECKPOINT) as f64
            );
        }
    }
    println!(
        "| VmRSS per pending job at N | {:.1} bytes |",
        at_n.rss as f64 / n as f64
    );
    println!(
        "| store on disk at N | {:.1} MiB ({:.0} bytes/job) |",
        mib(disk),
        disk as f64 / n as f64
    );
    println!(
        "| Redis used_memory at N | {:.1} MiB ({:.0} bytes/job) |",
        mib(used),
        (used.saturating_sub(used_empty)) as f64 / n as f64
    );
    println!("| Redis used_memory_rss at N | {:.1} MiB |", mib(used_rss));
    println!();
    let scale_note = if n == 10_000_000 {
        String::new()
    } else {
        format!(" (targets are stated for N = 10M; this run has N = {n})")
    };
    println!("targets{scale_note}:");
    println!(
        "  {}  scheduler VmRSS at N <= 256 MiB: {:.1} MiB",
        pass(at_n.rss <= TARGET_RSS_AT_10M),
        mib(at_n.rss)
    );
    match growth {
        Some(g) => println!(
            "  {}  scheduler VmRSS at N <= VmRSS at 1M + 64 MiB: {:+.1} MiB",
            pass(g <= TARGET_GROWTH_1M_TO_10M as i64),
            g as f64 / MIB
        ),
        None => println!("  n/a   scheduler VmRSS at N <= VmRSS at 1M + 64 MiB: N < 1M"),
    }
    println!(
        "  {}  Redis used_memory / scheduler VmRSS >= {TARGET_REDIS_RATIO}x: {ratio:.1}x",
        pass(ratio >= TARGET_REDIS_RATIO)
    );
}
