//! Fair dispatch against a real broker (`[fair]`): a flooding tenant does
//! not hold back the others, weights share the releases, a high-priority job
//! overtakes a low-priority backlog. Timing-sensitive, so a binary of its
//! own, its tests one at a time.

#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::future::IntoFuture;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::system::{config, run};
use common::{wait_for, Broker};
use kairos::worker::Outcome;
use kairos::{Config, Job, Priority, Producer};

/// One test at a time: they measure waits.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A job's start: its tenant, key, position within its key, and when.
#[derive(Clone, Debug)]
struct Start {
    tenant: String,
    key: String,
    seq: u64,
    at: Instant,
    /// The wall clock at the start, the job's run-at, in ms.
    wall_ms: i64,
    run_at_ms: i64,
}

type Starts = Arc<Mutex<Vec<Start>>>;

/// A handler that records each start and takes `work`.
fn recording(work: Duration) -> (Starts, impl kairos::worker::Handler) {
    let starts: Starts = Default::default();
    let s = starts.clone();
    let handler = move |job: Job, _ctx| {
        let starts = s.clone();
        async move {
            let at = Instant::now();
            let seq = String::from_utf8_lossy(&job.payload).parse().unwrap_or(u64::MAX);
            starts.lock().unwrap().push(Start {
                tenant: job.tenant.clone().unwrap_or_default(),
                key: String::from_utf8_lossy(&job.key).into_owned(),
                seq,
                at,
                wall_ms: chrono::Utc::now().timestamp_millis(),
                run_at_ms: job.run_at.timestamp_millis(),
            });
            tokio::time::sleep(work).await;
            Outcome::done()
        }
    };
    (starts, handler)
}

/// Write `n` jobs of `tenant` to `topic` over `keys` keys, a round of keys
/// at a time (so each key's order is defined: payload = position in key).
async fn write_tenant(
    producer: &Producer,
    topic: &str,
    tenant: &str,
    n: usize,
    keys: usize,
    priority: Priority,
) {
    let keys = keys.min(n).max(1);
    for round in 0..n.div_ceil(keys) {
        let writes = (0..keys).filter(|k| round * keys + k < n).map(|k| {
            let job = Job::new(topic, format!("{tenant}-{k}"), round.to_string().into_bytes())
                .tenant(tenant)
                .priority(priority);
            producer.enqueue(job).into_future()
        });
        for r in futures::future::join_all(writes).await {
            r.expect("enqueue");
        }
    }
}

/// Every job of every key started, in order: `(tenant, jobs, keys)`.
fn assert_all_started_in_key_order(starts: &[Start], tenants: &[(&str, usize)]) {
    let mut by_key: HashMap<&str, Vec<&Start>> = HashMap::new();
    for s in starts {
        by_key.entry(&s.key).or_default().push(s);
    }
    for (tenant, n) in tenants {
        let mut seen = 0;
        for (key, runs) in by_key
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{tenant}-")))
        {
            let mut firsts: Vec<&Start> = Vec::new();
            for r in runs {
                if !firsts.iter().any(|f| f.seq == r.seq) {
                    firsts.push(r);
                }
            }
            firsts.sort_by_key(|s| s.at);
            let seqs: Vec<u64> = firsts.iter().map(|s| s.seq).collect();
            let mut sorted = seqs.clone();
            sorted.sort_unstable();
            assert_eq!(seqs, sorted, "key {key} started out of order");
            seen += seqs.len();
        }
        assert_eq!(seen, *n, "tenant {tenant}: every job started once at least");
    }
}

fn fair_config(broker: &Broker, dir: &std::path::Path) -> Config {
    let mut cfg = config(broker, dir);
    cfg.fair.topics = cfg.topics.work.clone();
    cfg.worker.concurrency = 32;
    cfg
}

const FLOOD: usize = 100_000;
const SMALL_TENANTS: usize = 20;
const SMALL_JOBS: usize = 20;

/// Write the small tenants' jobs one by one, each with the time its write
/// was acknowledged, spread over about a second.
async fn write_small(producer: &Producer, topic: &str) -> HashMap<(String, u64), Instant> {
    let mut written = HashMap::new();
    for i in 0..SMALL_JOBS {
        for t in 0..SMALL_TENANTS {
            let tenant = format!("small{t}");
            let key = format!("{tenant}-0");
            let job = Job::new(topic, key.clone(), i.to_string().into_bytes()).tenant(&tenant);
            producer.enqueue(job).await.expect("enqueue");
            written.insert((key, i as u64), Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    written
}

/// The longest wait from write to first start of the small tenants' jobs.
fn longest_wait(starts: &[Start], written: &HashMap<(String, u64), Instant>) -> Duration {
    written
        .iter()
        .map(|((key, seq), at)| {
            let first = starts
                .iter()
                .filter(|s| &s.key == key && s.seq == *seq)
                .map(|s| s.at)
                .min()
                .unwrap_or_else(|| panic!("{key} #{seq} never started"));
            first.saturating_duration_since(*at)
        })
        .max()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_does_not_hold_back_the_others_on_a_fair_topic_but_does_on_a_plain_one() {
    let _serial = SERIAL.lock().await;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = fair_config(&broker, dir.path());
    let fair = cfg.topics.work[0].clone();
    let plain = format!("{fair}.plain");
    cfg.topics.work.push(plain.clone());
    kairos::topics::init(&cfg).await.unwrap();
    let producer = Producer::new(&cfg).unwrap();
    let small_total = SMALL_TENANTS * SMALL_JOBS;

    // The fair topic.
    cfg.worker.topics = vec![fair.clone()];
    let (starts, handler) = recording(Duration::from_millis(5));
    let sys = run(&cfg, true, handler);
    let t0 = Instant::now();
    write_tenant(&producer, &fair, "flood", FLOOD, 1_000, Priority::Normal).await;
    println!("fair topic: {FLOOD} flood jobs written in {:?}", t0.elapsed());
    let written = write_small(&producer, &fair).await;
    let started_at_end = starts.lock().unwrap().len();
    wait_for("every fair job to start", Duration::from_secs(240), || {
        (starts.lock().unwrap().len() >= FLOOD + small_total).then_some(())
    });
    println!(
        "fair topic: all {} jobs started in {:?} ({started_at_end} by the time the small tenants had written)",
        FLOOD + small_total,
        t0.elapsed()
    );
    sys.stop().await;
    let fair_starts = starts.lock().unwrap().clone();
    let fair_wait = longest_wait(&fair_starts, &written);
    assert_all_started_in_key_order(&fair_starts, &[("flood", FLOOD)]);
    for t in 0..SMALL_TENANTS {
        assert_all_started_in_key_order(&fair_starts, &[(&format!("small{t}"), SMALL_JOBS)]);
    }

    // The same on a plain topic: the small tenants' jobs queue behind the flood.
    let mut plain_cfg = cfg.clone();
    plain_cfg.worker.topics = vec![plain.clone()];
    plain_cfg.worker.group_id = format!("{}.plain", cfg.worker.group_id);
    let (starts, handler) = recording(Duration::from_millis(5));
    let sys = run(&plain_cfg, false, handler);
    write_tenant(&producer, &plain, "flood", FLOOD, 1_000, Priority::Normal).await;
    let written = write_small(&producer, &plain).await;
    wait_for(
        "the small tenants' plain jobs to start",
        Duration::from_secs(240),
        || {
            let s = starts.lock().unwrap();
            (s.iter().filter(|s| s.tenant != "flood").count() >= small_total).then_some(())
        },
    );
    sys.stop().await;
    let plain_wait = longest_wait(&starts.lock().unwrap(), &written);
    println!(
        "longest wait of {SMALL_TENANTS} small tenants' jobs behind a {FLOOD}-job flood: fair topic {fair_wait:?}, plain topic {plain_wait:?}"
    );
    assert!(fair_wait <= Duration::from_secs(2), "fair topic: {fair_wait:?}");
    assert!(
        plain_wait > fair_wait,
        "the plain topic should show the flood's wait (else the test measures nothing): {plain_wait:?}"
    );
}

/// Starts per tenant between `from` and `to`.
fn starts_between(starts: &[Start], from: Instant, to: Instant) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for s in starts.iter().filter(|s| s.at >= from && s.at < to) {
        *out.entry(s.tenant.clone()).or_default() += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_backlogged_tenants_of_weights_3_and_1_get_3_to_1_of_the_starts() {
    let _serial = SERIAL.lock().await;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = fair_config(&broker, dir.path());
    cfg.fair.weights.insert("heavy".into(), 3.0);
    kairos::topics::init(&cfg).await.unwrap();
    let topic = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    // Both backlogs written before the scheduler runs, so neither is first.
    let (a, b) = futures::join!(
        write_tenant(&producer, &topic, "heavy", 45_000, 500, Priority::Normal),
        write_tenant(&producer, &topic, "light", 18_000, 500, Priority::Normal),
    );
    let ((), ()) = (a, b);
    let (starts, handler) = recording(Duration::from_millis(5));
    let sys = run(&cfg, true, handler);
    let first = wait_for("the first start", Duration::from_secs(60), || {
        starts.lock().unwrap().first().map(|s| s.at)
    });
    let from = first + Duration::from_secs(2);
    let to = from + Duration::from_secs(10);
    wait_for("the 10 s window to pass", Duration::from_secs(60), || {
        (Instant::now() >= to).then_some(())
    });
    let counts = starts_between(&starts.lock().unwrap(), from, to);
    sys.stop().await;
    let (heavy, light) = (counts["heavy"], counts["light"]);
    println!("starts over 10 s: heavy (weight 3) {heavy}, light (weight 1) {light}");
    assert!(
        heavy < 45_000 && light < 18_000,
        "both stayed backlogged: {counts:?}"
    );
    let ratio = heavy as f64 / light as f64;
    assert!(
        (ratio - 3.0).abs() / 3.0 <= 0.05,
        "3:1 within 5 %: {ratio:.3} ({counts:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_job_starts_within_a_second_under_a_low_priority_backlog() {
    let _serial = SERIAL.lock().await;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = fair_config(&broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let topic = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    write_tenant(&producer, &topic, "bulk", 30_000, 500, Priority::Low).await;
    let (starts, handler) = recording(Duration::from_millis(5));
    let sys = run(&cfg, true, handler);
    wait_for("the backlog to run", Duration::from_secs(60), || {
        (starts.lock().unwrap().len() >= 3_000).then_some(())
    });
    // Same tenant, so only the class lets them through.
    let mut waits = Vec::new();
    for i in 0..5u64 {
        let key = format!("urgent-{i}");
        let job = Job::new(&topic, key.clone(), i.to_string().into_bytes())
            .tenant("bulk")
            .priority(Priority::High);
        producer.enqueue(job).await.expect("enqueue");
        let written = Instant::now();
        let started = wait_for("the high-priority job to start", Duration::from_secs(30), || {
            starts.lock().unwrap().iter().find(|s| s.key == key).map(|s| s.at)
        });
        waits.push(started.saturating_duration_since(written));
    }
    let backlog_left = 30_000usize.saturating_sub(
        starts
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.key.starts_with("bulk-"))
            .count(),
    );
    sys.stop().await;
    println!(
        "high-priority waits under a low-priority backlog: {waits:?} ({backlog_left} low jobs still waiting)"
    );
    assert!(
        backlog_left > 0,
        "the low-priority backlog ran out: the test measured nothing"
    );
    for w in waits {
        assert!(w <= Duration::from_secs(1), "{w:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_workers_run_jobs_early_within_their_allowance_and_busy_ones_do_not() {
    let _serial = SERIAL.lock().await;
    let broker = Broker::start();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = fair_config(&broker, dir.path());
    // Early release looks one window ahead.
    cfg.scheduler.window = Duration::from_secs(30);
    kairos::topics::init(&cfg).await.unwrap();
    let topic = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let (starts, handler) = recording(Duration::from_millis(5));
    let sys = run(&cfg, true, handler);
    let job = |key: String, run_in: Duration, early: Option<Duration>| {
        let mut j = Job::new(&topic, key, b"0".to_vec())
            .tenant("t")
            .at(chrono::Utc::now() + run_in);
        j.early = early;
        j
    };
    // Idle workers: allowed from 4 s on, due at 12 s; never early, due at 6 s.
    for i in 0..10 {
        let allowed = job(
            format!("allowed-{i}"),
            Duration::from_secs(12),
            Some(Duration::from_secs(8)),
        );
        producer.enqueue(allowed).await.unwrap();
        let never = job(format!("never-{i}"), Duration::from_secs(6), None);
        producer.enqueue(never).await.unwrap();
    }
    wait_for("the 20 jobs to start", Duration::from_secs(40), || {
        (starts.lock().unwrap().len() >= 20).then_some(())
    });
    for s in starts.lock().unwrap().iter() {
        let early_by = s.run_at_ms - s.wall_ms;
        if s.key.starts_with("allowed-") {
            assert!(
                early_by <= 8_000,
                "{} started {early_by} ms early, more than its allowance",
                s.key
            );
            assert!(
                early_by >= 2_000,
                "{} was not released early ({early_by} ms)",
                s.key
            );
        } else {
            assert!(early_by <= 0, "{} started {early_by} ms before its run-at", s.key);
        }
    }
    // Busy workers: a backlog of due jobs; jobs allowed to start at once
    // still wait for their run-at.
    write_tenant(&producer, &topic, "bulk", 30_000, 500, Priority::Normal).await;
    wait_for("the backlog to run", Duration::from_secs(60), || {
        (starts.lock().unwrap().len() >= 3_000).then_some(())
    });
    for i in 0..10 {
        let allowed = job(
            format!("busy-{i}"),
            Duration::from_secs(4),
            Some(Duration::from_secs(4)),
        );
        producer.enqueue(allowed).await.unwrap();
    }
    wait_for("the 10 jobs to start", Duration::from_secs(60), || {
        let s = starts.lock().unwrap();
        (s.iter().filter(|s| s.key.starts_with("busy-")).count() >= 10).then_some(())
    });
    let s = starts.lock().unwrap().clone();
    sys.stop().await;
    let bulk_left = 30_000 - s.iter().filter(|s| s.key.starts_with("bulk-")).count();
    assert!(bulk_left > 0, "the backlog ran out: the test measured nothing");
    for s in s.iter().filter(|s| s.key.starts_with("busy-")) {
        assert!(
            s.wall_ms >= s.run_at_ms,
            "{} went early while the workers were busy",
            s.key
        );
    }
}
