//! Throughput of scheduling then firing N jobs through the scheduler's sled
//! store and timer wheel (no broker), against the Redis sorted-set design
//! doing the same work, measured in the same run.
//!
//! ```text
//! cargo bench --bench scheduler_store              # N = 200,000
//! cargo bench --bench scheduler_store -- 50000     # quick run
//! ```
//!
//! - sled: `Store::apply_all` of Put batches of 2000 (all partitions in one
//!   batch, one flush = fsync of the value log and of sled per batch, as
//!   ingest does); then, with "now" past every run-at, the scheduler's fire
//!   path on two threads, as the service runs it: a dispatcher (cascade one
//!   step per partition, refill the wheel when due, `take_due` 1000, hand
//!   the batch over) and a finisher (every batch waiting, as one
//!   `apply_all` of `Change::Fired` + flush, then `TimerWheel::follow`),
//!   until nothing is left. Redis runs on its own core too (a separate
//!   process; the ZREMs are pipelined with the next range).
//! - Redis (`--save '' --appendonly no`: not durable): variadic ZADD of 2000
//!   members per command, pipelined; then ZRANGEBYSCORE -inf now LIMIT 0 1000
//!   and ZREM of the members it returned, each ZREM pipelined with the next
//!   ZRANGEBYSCORE (one round trip per batch).
//! - For reference only, the same Redis work with `--appendonly yes
//!   --appendfsync always` (an fsync before each batch of replies), the
//!   closest Redis gets to sled's durability.
//!
//! Jobs are generated and encoded before the clocks start.

mod support;

use std::collections::HashMap;
use std::sync::{mpsc, Mutex};
use std::time::Instant;

use kairos::scheduler::store::{Change, DueKey, PartitionWrite, Store};
use kairos::scheduler::stored::StoredJob;
use kairos::scheduler::timer_wheel::TimerWheel;
use support::*;

const SEED: u64 = 0x6b61_6972_6f73;
const SPREAD_MS: i64 = 30 * 24 * 3600 * 1000;
const TARGET_RATIO: f64 = 1.0;

/// Seconds spent scheduling and firing N jobs.
#[derive(Clone, Copy)]
struct Run {
    schedule: f64,
    fire: f64,
}

impl Run {
    fn total(&self) -> f64 {
        self.schedule + self.fire
    }
}

fn rate(n: u64, secs: f64) -> f64 {
    n as f64 / secs
}

fn sled_run(jobs: &[(i32, StoredJob)], fire_at_ms: i64) -> Run {
    let dir = bench_dir("kairos-bench-store-");
    let store = Store::open(dir.path(), CACHE_BYTES).expect("open store");

    let started = Instant::now();
    for chunk in jobs.chunks(INGEST_BATCH) {
        let by_part = puts_by_partition(chunk.iter().cloned());
        let writes: Vec<PartitionWrite> = by_part.iter().map(|(p, c)| PartitionWrite::new(*p, c)).collect();
        store.apply_all(&writes).expect("apply puts");
        store.flush().expect("flush");
    }
    let schedule = started.elapsed().as_secs_f64();
    let pending: u64 = (0..PARTITIONS)
        .map(|p| store.checkpoint(p).expect("checkpoint").pending)
        .sum();
    assert_eq!(pending, jobs.len() as u64, "every job pending after scheduling");

    // As the scheduler does it: the dispatcher refills and takes due jobs
    // while a finisher deletes the batches taken before (the service's
    // `finish_loop`: every batch waiting in one round, one flush).
    let started = Instant::now();
    let wheel = Mutex::new(TimerWheel::new(WHEEL_SPAN_MS, WHEEL_CAPACITY));
    for p in 0..PARTITIONS {
        wheel.lock().unwrap().add_partition(p);
    }
    // Every partition read to its end: nothing held back.
    let read_to_end: kairos::hash::HashMap<i32, i64> = (0..PARTITIONS).map(|p| (p, i64::MAX)).collect();
    let (to_finisher, batches) = mpsc::channel::<Vec<(DueKey, StoredJob)>>();
    let fired = std::thread::scope(|s| {
        let (store, wheel) = (&store, &wheel);
        let finisher = s.spawn(move || {
            let mut fired = 0u64;
            while let Ok(mut due) = batches.recv() {
                // Every batch waiting goes in one round, as in the service.
                while let Ok(more) = batches.try_recv() {
                    due.extend(more);
                }
                let mut by_part: HashMap<i32, Vec<Change>> = HashMap::new();
                for (k, s) in &due {
                    by_part
                        .entry(k.partition)
                        .or_default()
                        .push(Change::Fired(s.job.id, *k));
                }
                let writes: Vec<PartitionWrite> =
                    by_part.iter().map(|(p, c)| PartitionWrite::new(*p, c)).collect();
                let applied = store.apply_all(&writes).expect("apply fired");
                store.flush().expect("flush");
                let mut w = wheel.lock().unwrap();
                w.follow(&applied);
                w.fired(&due);
                fired += due.len() as u64;
            }
            fired
        });
        loop {
            // The service's cascade loop moves far jobs into the near range
            // without holding the window; here one step per partition ahead
            // of each refill.
            if wheel
                .lock()
                .unwrap()
                .refill_due_ms()
                .is_some_and(|t| t <= fire_at_ms)
            {
                for p in 0..PARTITIONS {
                    store.cascade(p, fire_at_ms + 2 * WHEEL_SPAN_MS).expect("cascade");
                }
            }
            let refill_due = wheel
                .lock()
                .unwrap()
                .refill_due_ms()
                .is_some_and(|t| t <= fire_at_ms);
            if refill_due {
                kairos::scheduler::refill::refill(wheel, store, fire_at_ms).expect("refill");
            }
            let due = wheel
                .lock()
                .unwrap()
                .take_due(fire_at_ms, FIRE_BATCH, &read_to_end)
                .jobs;
            if due.is_empty() {
                break;
            }
            to_finisher.send(due).expect("finisher running");
        }
        drop(to_finisher);
        finisher.join().expect("finisher")
    });
    let fire = started.elapsed().as_secs_f64();
    assert_eq!(fired, jobs.len() as u64, "every job fired once");
    let left: u64 = (0..PARTITIONS)
        .map(|p| store.checkpoint(p).expect("checkpoint").pending)
        .sum();
    assert_eq!(left, 0, "nothing pending after firing");
    Run { schedule, fire }
}

fn redis_run(items: &[(i64, Vec<u8>)], fire_at_ms: i64, extra: &[&str]) -> Run {
    let redis = RedisServer::start(extra).expect("start redis-server");
    let mut c = redis.connect().expect("connect to redis");

    let started = Instant::now();
    let added = zadd_all(&mut c, items.iter().cloned(), INGEST_BATCH, 8).expect("ZADD");
    let schedule = started.elapsed().as_secs_f64();
    assert_eq!(added, items.len() as u64, "every job added");

    let now = fire_at_ms.to_string();
    let limit = FIRE_BATCH.to_string();
    let range: [&[u8]; 7] = [
        b"ZRANGEBYSCORE",
        ZKEY,
        b"-inf",
        now.as_bytes(),
        b"LIMIT",
        b"0",
        limit.as_bytes(),
    ];
    let started = Instant::now();
    let mut fired = 0u64;
    let mut members = c.call(&range).expect("ZRANGEBYSCORE").bulks();
    while !members.is_empty() {
        c.begin(2 + members.len()).expect("ZREM");
        c.arg(b"ZREM").expect("ZREM");
        c.arg(ZKEY).expect("ZREM");
        for m in &members {
            c.arg(m).expect("ZREM");
        }
        c.send(&range).expect("ZRANGEBYSCORE");
        c.flush().expect("flush");
        let removed = c.read().expect("ZREM reply").int() as u64;
        assert_eq!(removed, members.len() as u64, "each member removed once");
        fired += removed;
        members = c.read().expect("ZRANGEBYSCORE reply").bulks();
    }
    let fire = started.elapsed().as_secs_f64();
    assert_eq!(fired, items.len() as u64, "every job fired once");
    let card = c.call(&[b"ZCARD", ZKEY]).expect("ZCARD").int();
    assert_eq!(card, 0, "nothing pending after firing");
    Run { schedule, fire }
}

fn main() {
    let n = job_count(200_000);
    let base_ms = now_ms();
    let fire_at_ms = base_ms + SPREAD_MS + 1;
    let mut gen = JobGen::new(SEED, base_ms, SPREAD_MS);
    let jobs: Vec<(i32, StoredJob)> = (0..n).map(|_| gen.next_job()).collect();
    let items: Vec<(i64, Vec<u8>)> = jobs
        .iter()
        .map(|(_, s)| (s.job.run_at.timestamp_millis(), s.encode()))
        .collect();
    let member_bytes = items.iter().map(|(_, m)| m.len()).sum::<usize>() as f64 / n as f64;
    println!(
        "scheduler_store: N = {n} jobs ({PAYLOAD_BYTES}-byte payloads, {member_bytes:.0}-byte encoded jobs, \
         {PARTITIONS} partitions); batches: {INGEST_BATCH} to schedule, {FIRE_BATCH} to fire"
    );

    let sled = sled_run(&jobs, fire_at_ms);
    println!("sled:  schedule {:.2} s, fire {:.2} s", sled.schedule, sled.fire);
    let redis = redis_run(&items, fire_at_ms, &[]);
    println!(
        "redis: schedule {:.2} s, fire {:.2} s",
        redis.schedule, redis.fire
    );
    let redis_aof = redis_run(
        &items,
        fire_at_ms,
        &["--appendonly", "yes", "--appendfsync", "always"],
    );
    println!(
        "redis (appendfsync always): schedule {:.2} s, fire {:.2} s",
        redis_aof.schedule, redis_aof.fire
    );

    let ratio = rate(n, sled.total()) / rate(n, redis.total());
    println!();
    println!(
        "| phase | sled / redis | sled / redis-aof-always | sled jobs/s | redis jobs/s | redis-aof-always jobs/s |"
    );
    println!("|---|---|---|---|---|---|");
    type Phase = fn(&Run) -> f64;
    let rows: [(&str, Phase); 3] = [
        ("schedule + fire (end to end)", Run::total),
        ("schedule (ZADD / apply Put)", |r| r.schedule),
        ("fire (range + ZREM / take_due + apply Fired)", |r| r.fire),
    ];
    for (name, secs) in rows {
        let (s, r, a) = (
            rate(n, secs(&sled)),
            rate(n, secs(&redis)),
            rate(n, secs(&redis_aof)),
        );
        println!(
            "| {name} | **{:.2}x** | {:.2}x | {s:.0} | {r:.0} | {a:.0} |",
            s / r,
            s / a
        );
    }
    println!();
    println!("target (sled is durable, fsync per batch; redis here is not):");
    println!(
        "  {}  sled jobs/s / redis jobs/s (end to end) >= {TARGET_RATIO}: {ratio:.2}x",
        pass(ratio >= TARGET_RATIO)
    );
}
