//! The crash and fault suite: two scheduler processes and three worker
//! processes run while jobs flow, and faults hit them over many cycles:
//! SIGKILL of a scheduler or a worker, a graceful restart of a worker, and a
//! SIGKILL and restart of the broker itself on its log directory; or, on a
//! cluster of three brokers, SIGKILL and restart of the partitions' leader.
//! Faults are paced by progress (completions seen), not by sleeping.
//!
//! At the end an independent checker reads the work topic, the dead-letter
//! topic and the handlers' event log, and counts lost, early, out-of-order
//! and duplicated jobs and same-key overlaps. Lost, early, out-of-order and
//! overlapping must be zero; duplicates are counted (RELIABILITY.md says where
//! they come from).
//!
//! The suite runs six times: on a plain work topic; on a fair topic
//! (`[fair]`) where every job goes through the scheduler and one tenant
//! owns half the jobs; with `on_failure = "hold_key"`, more jobs failing
//! (once or twice), where no job of a key may start before every job of its
//! key written before it has succeeded, across retries; on a plain topic
//! on a three-broker cluster whose leader is killed; and in exactly-once
//! mode (scheduler and workers), each job writing a follow-up, with the
//! process faults (and a scheduler paused past its session, then resumed:
//! a zombie) and with the leader killed: there the checker reads
//! read_committed and finds no duplicate fire and every follow-up once (a
//! read_uncommitted read shows the aborted copies).
//!
//! `KAIROS_CRASH_TIMELINE=1` prints, for the first keys whose order broke in
//! hold-key mode, every start and end of their jobs with the fault times.
//! `KAIROS_CRASH_CYCLES` sets the number of fault cycles (default 6);
//! `KAIROS_CRASH_FAULTS` draws the process faults from the kinds named only
//! (`scheduler-kill`, `worker-kill`, `worker-restart`, and in exactly-once
//! mode `scheduler-zombie`; no broker restart),
//! to measure each kind's duplicates alone;
//! `KAIROS_SOAK=1` runs a long soak (60 cycles, four times the jobs).
//! `KAIROS_CHAOS_SEED` replays a run (the seed is printed).
//!
//! Another test kills one scheduler again and again with the shipped
//! configuration and checks that jobs keep firing on time. The processes'
//! logs are kept (their directory is printed) when a test fails;
//! `KAIROS_CRASH_LOG` sets their filter (default `info`; e.g.
//! `info,kairos::scheduler=debug` logs each job scheduled and fired and
//! each partition's handled frontier).

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::Utc;
use common::events;
use common::{read_all, read_up_to, record_count, wait_for, Broker, ChildGuard};
use kairos::config::GroupProtocol;
use kairos::wire::{self, Command as Cmd, Context, Limits, RecordView};
use kairos::{Job, JobId, Producer};
use rand::{Rng, SeedableRng};
use rdkafka::message::Headers as _;
use rdkafka::Message as _;
use std::future::IntoFuture;

/// A kairos process, killed with SIGKILL when dropped. Its log (info level)
/// goes to `<logs>/<role>-<pid>.log`, kept when the suite fails (or when
/// `KAIROS_KEEP_LOGS` is set).
struct Proc {
    child: ChildGuard,
    args: Vec<String>,
    env: Vec<(String, String)>,
    logs: PathBuf,
}

impl Proc {
    fn spawn(args: Vec<String>, env: Vec<(String, String)>, logs: PathBuf) -> Proc {
        let log = tempfile::NamedTempFile::new_in(&logs).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_kairos"))
            .args(&args)
            .envs(env.iter().cloned())
            .env(
                "KAIROS_LOG",
                std::env::var("KAIROS_CRASH_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log.reopen().expect("log file"))
            .spawn()
            .expect("spawn kairos");
        // args: --config FILE <role> ...
        let named = logs.join(format!("{}-{}.log", args[2], child.id()));
        log.persist(&named).expect("log file");
        Proc {
            child: ChildGuard(child),
            args,
            env,
            logs,
        }
    }

    /// SIGKILL, then start the same command again; returns (dead pid, time of death).
    fn kill9_and_restart(&mut self) -> (u32, u128) {
        let pid = self.child.id();
        let _ = self.child.kill();
        let _ = self.child.wait();
        let at = now_nanos();
        *self = Proc::spawn(self.args.clone(), self.env.clone(), self.logs.clone());
        (pid, at)
    }

    /// SIGSTOP for `d`, then SIGCONT: a process that stopped answering
    /// (a long GC pause, a VM migration) and comes back as a zombie.
    fn pause_for(&self, d: Duration) {
        for (sig, wait) in [("-STOP", d), ("-CONT", Duration::ZERO)] {
            let ok = Command::new("kill")
                .args([sig, &self.child.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig}");
            std::thread::sleep(wait);
        }
    }

    /// SIGTERM (graceful), wait, start again.
    fn terminate_and_restart(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        *self = Proc::spawn(self.args.clone(), self.env.clone(), self.logs.clone());
    }
}

/// The processes' logs: deleted when the suite passes, kept (and their
/// place printed) when it fails.
/// A directory kept when the test fails (or with `KAIROS_KEEP_LOGS` set):
/// the process logs, or the stores and the broker's data.
struct Logs(Option<tempfile::TempDir>, &'static str);

impl Logs {
    /// A fresh directory for the processes' logs.
    fn process_logs() -> Logs {
        let dir = tempfile::Builder::new()
            .prefix("kairos-crash-logs")
            .tempdir()
            .unwrap();
        Logs(Some(dir), "process logs")
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("KAIROS_KEEP_LOGS").is_some() {
            if let Some(dir) = self.0.take() {
                eprintln!("{} kept in {}", self.1, dir.keep().display());
            }
        }
    }
}

/// Enqueue jobs, retrying the ones whose write failed (the broker may be
/// restarting; a job written twice is the same job, by id). Returns each
/// job's run-at, and the jobs written more than once: a write that failed
/// (timed out, say) may still have been stored, so a job sent again may be
/// in the topic twice, and a producer is not transactional.
async fn enqueue_retrying(producer: &Producer, jobs: Vec<Job>) -> (HashMap<JobId, i64>, HashSet<JobId>) {
    let mut left = jobs;
    let mut out = HashMap::new();
    let mut resent = HashSet::new();
    for _ in 0..60 {
        let results =
            futures::future::join_all(left.iter().map(|j| producer.enqueue(j.clone()).into_future())).await;
        let mut failed = Vec::new();
        for (j, r) in left.into_iter().zip(results) {
            match r {
                Ok(id) => {
                    assert_eq!(id, j.id);
                    out.insert(id, j.run_at.timestamp_millis());
                }
                Err(_) => {
                    resent.insert(j.id);
                    failed.push(j);
                }
            }
        }
        if failed.is_empty() {
            return (out, resent);
        }
        left = failed;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    panic!("{} jobs could not be written in a minute", left.len());
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// Jobs whose run succeeded: an end event with an attempt past its failures.
fn succeeded(events: &[events::Event], fails: &HashMap<JobId, u32>) -> HashSet<JobId> {
    events
        .iter()
        .filter(|e| !e.start && fails.get(&e.id).is_some_and(|f| e.attempt > *f))
        .map(|e| e.id)
        .collect()
}

/// What a stalled run is waiting for: the jobs that never succeeded (with
/// their runs and their copies on the work topic) and the runs that never
/// ended in processes that were not killed.
fn report_stall(
    evs: &[events::Event],
    fails: &HashMap<JobId, u32>,
    deaths: &HashMap<u32, u128>,
    cfg: &kairos::Config,
    run_at: &HashMap<JobId, i64>,
) {
    let brokers = cfg.kafka.brokers.as_str();
    let work = cfg.topics.work[0].as_str();
    let ok = succeeded(evs, fails);
    let missing: Vec<JobId> = fails.keys().filter(|id| !ok.contains(id)).copied().collect();
    eprintln!("stalled: {} of {} jobs succeeded", ok.len(), fails.len());
    let mut copies: HashMap<JobId, Vec<String>> = HashMap::new();
    for (m, j) in work_jobs(brokers, work) {
        copies.entry(j.id).or_default().push(format!(
            "p{}@{} attempt {} ts {:?}",
            m.partition(),
            m.offset(),
            j.attempt,
            m.timestamp().to_millis()
        ));
    }
    // Where else the missing jobs left a trace: their schedule records,
    // changelog records (put or tombstone) and dead letters.
    let wanted: std::collections::HashSet<JobId> = missing.iter().take(10).copied().collect();
    let mut traces: HashMap<JobId, Vec<String>> = HashMap::new();
    let t = &cfg.topics;
    for topic in [&t.schedule, &t.changelog, &t.dead_letter] {
        let n = record_count(brokers, topic) as usize;
        for m in read_up_to(brokers, topic, n, Duration::from_secs(60)) {
            let id = if topic == &t.changelog {
                m.key()
                    .and_then(|k| <[u8; 16]>::try_from(k).ok())
                    .map(JobId::from_bytes)
            } else {
                m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == wire::header::ID)
                        .and_then(|h| h.value)
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .and_then(|v| v.parse().ok())
                })
            };
            if let Some(id) = id.filter(|id| wanted.contains(id)) {
                let what = if m.payload().is_none() {
                    "tombstone"
                } else {
                    "record"
                };
                traces.entry(id).or_default().push(format!(
                    "{topic} p{}@{} {what} ts {:?}",
                    m.partition(),
                    m.offset(),
                    m.timestamp().to_millis()
                ));
            }
        }
    }
    for id in missing.iter().take(10) {
        eprintln!("  traces of {id}: {:?}", traces.get(id));
        let runs: Vec<String> = evs
            .iter()
            .filter(|e| e.id == *id)
            .map(|e| {
                format!(
                    "{} attempt {} pid {} at {}",
                    if e.start { "start" } else { "end" },
                    e.attempt,
                    e.pid,
                    e.nanos
                )
            })
            .collect();
        eprintln!(
            "  never succeeded: {id} run-at {:?} fails {}; work-topic copies {:?}; runs {runs:?}",
            run_at.get(id),
            fails[id],
            copies.get(id)
        );
    }
    for (pid, id, attempt, start) in events::open_runs(evs, deaths).iter().take(10) {
        eprintln!("  run never ended: {id} attempt {attempt} in live process {pid}, started {start}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_survive_killed_schedulers_workers_and_a_restarted_broker() {
    crash_suite(Mode::Plain, Faults::Processes).await;
}

/// A cluster of three brokers, every Kairos topic replicated three times
/// with `min.insync.replicas=2`: the broker leading the most schedule and
/// work partitions is killed (SIGKILL) and restarted on its data, three
/// times, while jobs are scheduled, fired and run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_survive_the_partition_leader_killed_in_a_three_broker_cluster() {
    crash_suite(Mode::Plain, Faults::LeaderLoss).await;
}

/// The same faults on a fair topic (`[fair]`), with one tenant flooding:
/// half the keys belong to tenant `flood`, the others to ten small tenants.
/// Every job of a fair topic goes through the scheduler, so its SIGKILLs
/// and the partitions moving between its two instances hit every job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_topic_jobs_survive_killed_schedulers_workers_and_a_restarted_broker() {
    crash_suite(Mode::Fair, Faults::Processes).await;
}

/// The process faults with the scheduler and the workers in exactly-once
/// mode, every job writing a follow-up: no job fires twice and every job
/// writes its follow-up once, as read_committed readers see them, through
/// the lone broker's kill -9 and restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_exactly_once_mode_jobs_fire_once_and_write_their_follow_ups_once_through_faults() {
    crash_suite(Mode::ExactlyOnce, Faults::Processes).await;
}

/// Exactly-once mode on three brokers whose partitions' leader is killed.
/// The test's producer is not transactional: a write of it that times out
/// while the cluster elects a controller may still be stored, and the job
/// sent again is then in its topic twice (each copy fires, once). Those
/// jobs are named and left out of the count; every other job fires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_exactly_once_mode_jobs_fire_once_through_the_partition_leader_killed() {
    crash_suite(Mode::ExactlyOnce, Faults::LeaderLoss).await;
}

/// The same faults with `on_failure = "hold_key"`: a failing job holds its
/// key while its later jobs are parked through the scheduler, across the
/// workers' SIGKILLs, restarts and rebalances and the scheduler's SIGKILLs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_keys_keep_their_order_through_killed_schedulers_workers_and_a_restarted_broker() {
    crash_suite(Mode::HoldKey, Faults::Processes).await;
}

/// Held keys in exactly-once mode: every job writes a follow-up, failing
/// jobs hold their keys and their later jobs are parked; no job fires
/// twice, each follow-up is written once, and each key's order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_exactly_once_mode_held_keys_keep_their_order_and_write_once_through_faults() {
    crash_suite(Mode::ExactlyOnceHoldKey, Faults::Processes).await;
}

/// What the crash suite kills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Faults {
    /// One broker; schedulers and workers killed (SIGKILL) or restarted
    /// (SIGTERM) at random, and halfway through, the broker killed and
    /// restarted.
    Processes,
    /// Three brokers, topics of replication factor 3 and
    /// `min.insync.replicas=2`: the broker leading the most schedule and
    /// work partitions killed, then restarted, in turn.
    LeaderLoss,
}

/// Which work topic the crash suite runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// A plain work topic: due jobs go straight to it.
    Plain,
    /// A fair topic, its jobs of eleven tenants.
    Fair,
    /// A plain topic whose failing jobs hold their keys.
    HoldKey,
    /// A plain topic, scheduler and workers in exactly-once mode; each job
    /// writes a follow-up to a topic of its own.
    ExactlyOnce,
    /// Both: exactly-once mode on a topic whose failing jobs hold their keys.
    ExactlyOnceHoldKey,
}

impl Mode {
    /// Scheduler and workers in exactly-once mode.
    fn exactly_once(self) -> bool {
        matches!(self, Mode::ExactlyOnce | Mode::ExactlyOnceHoldKey)
    }

    /// Failing jobs hold their keys.
    fn holds_keys(self) -> bool {
        matches!(self, Mode::HoldKey | Mode::ExactlyOnceHoldKey)
    }

    /// The tenant of key `k` of `keys` (`None` on a plain topic).
    fn tenant(self, k: usize, keys: usize) -> Option<String> {
        match self {
            Mode::Plain | Mode::HoldKey | Mode::ExactlyOnce | Mode::ExactlyOnceHoldKey => None,
            Mode::Fair if k < keys / 2 => Some("flood".into()),
            Mode::Fair => Some(format!("small{}", k % 10)),
        }
    }

    /// How often job `seq` of key `k` fails before it succeeds: one in
    /// twenty once; with held keys, one in ten, half of them twice.
    fn fails(self, k: usize, seq: usize) -> u32 {
        let n = k * 7 + seq;
        match self {
            _ if self.holds_keys() && n.is_multiple_of(20) => 2,
            _ if self.holds_keys() => u32::from(n.is_multiple_of(10)),
            _ => u32::from(n.is_multiple_of(20)),
        }
    }
}

async fn crash_suite(mode: Mode, faults: Faults) {
    let _one = ONE_AT_A_TIME.lock().await;
    let soak = std::env::var("KAIROS_SOAK").is_ok_and(|v| v == "1");
    // One kind of process fault only, to measure its duplicates alone (and
    // no broker restart): `KAIROS_CRASH_FAULTS=scheduler-kill`,
    // `worker-kill`, `worker-restart` or `scheduler-zombie` (comma-separated
    // for several).
    let only_kinds: Option<Vec<u32>> = std::env::var("KAIROS_CRASH_FAULTS").ok().map(|v| {
        v.split(',')
            .map(|k| match k.trim() {
                "scheduler-kill" => 0,
                "worker-kill" => 1,
                "worker-restart" => 2,
                "scheduler-zombie" => 3,
                other => panic!("KAIROS_CRASH_FAULTS: unknown fault `{other}`"),
            })
            .collect()
    });
    let cycles: usize = std::env::var("KAIROS_CRASH_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if soak { 60 } else { 6 });
    let (keys, per_key) = if soak { (1000, 80) } else { (500, 40) };
    let seed: u64 = std::env::var("KAIROS_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| now_nanos() as u64);
    eprintln!(
        "crash suite ({mode:?} topic, {faults:?}): seed {seed}, {cycles} cycles, {} jobs",
        keys * per_key
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let data = Logs(Some(tempfile::tempdir().unwrap()), "stores and broker data");
    let dir = data.0.as_ref().expect("data dir");
    let nodes = match faults {
        Faults::Processes => 1,
        Faults::LeaderLoss => 3,
    };
    let mut broker = Broker::cluster_in(&dir.path().join("kafka"), nodes);
    eprintln!("broker: {}", broker.describe());
    let mut cfg = common::system::config(&broker, dir.path());
    if faults == Faults::LeaderLoss {
        cfg.topics.replication_factor = 3;
        cfg.topics.min_insync_replicas = Some(2);
    }
    cfg.topics.work_partitions = 6;
    cfg.topics.schedule_partitions = 6;
    cfg.worker.backoff_base = Duration::from_millis(200);
    cfg.worker.revocation_deadline = Duration::from_secs(10);
    // The schedulers keep the shipped session timeout: they are static
    // members restarted at once, so a kill -9 never waits for it. Workers
    // keep 6 s, so that a killed worker's partitions move within seconds.
    cfg.scheduler.session_timeout = Duration::from_secs(30);
    let follow = format!("{}.follow-ups", cfg.topics.work[0]);
    match mode {
        Mode::Fair => cfg.fair.topics = cfg.topics.work.clone(),
        Mode::HoldKey => cfg.worker.on_failure = kairos::config::OnFailure::HoldKey,
        Mode::Plain => {}
        Mode::ExactlyOnce | Mode::ExactlyOnceHoldKey => {
            if mode.holds_keys() {
                cfg.worker.on_failure = kairos::config::OnFailure::HoldKey;
            }
            // A scheduler paused past its session (a zombie) loses its
            // partitions within seconds; one killed and restarted at once
            // is back well within it. (With the leader killed, the shipped
            // session: no zombie there.)
            if faults == Faults::Processes {
                cfg.scheduler.session_timeout = Duration::from_secs(6);
            }
            cfg.scheduler.exactly_once = true;
            cfg.worker.exactly_once = true;
            cfg.worker.transaction_timeout = Duration::from_secs(10);
            cfg.topics.work.push(follow.clone());
            cfg.worker.topics = vec![cfg.topics.work[0].clone()];
        }
    }
    kairos::topics::init(&cfg).await.unwrap();
    let config_path = dir.path().join("kairos.toml");
    std::fs::write(&config_path, toml::to_string(&cfg).unwrap()).unwrap();
    let events = dir.path().join("events.log");
    let conf = config_path.to_str().unwrap().to_string();
    let logs = Logs::process_logs();
    let logs_dir = logs.0.as_ref().unwrap().path().to_path_buf();

    let scheduler = |i: usize| {
        let data = dir.path().join(format!("scheduler-{i}"));
        Proc::spawn(
            vec!["--config".into(), conf.clone(), "scheduler".into()],
            vec![("KAIROS_SCHEDULER__DATA_DIR".into(), data.to_str().unwrap().into())],
            logs_dir.clone(),
        )
    };
    // Each worker restarts with its transactional id (exactly-once mode),
    // which ends at once what its killed self left open.
    let worker = |i: usize| {
        Proc::spawn(
            vec![
                "--config".into(),
                conf.clone(),
                "worker".into(),
                "--events".into(),
                events.to_str().unwrap().into(),
            ],
            vec![(
                "KAIROS_WORKER__TRANSACTIONAL_ID".into(),
                format!("{}-{i}", cfg.worker.group_id),
            )],
            logs_dir.clone(),
        )
    };
    let mut schedulers: Vec<Proc> = (0..2).map(scheduler).collect();
    let mut workers: Vec<Proc> = (0..3).map(worker).collect();
    let mut deaths: HashMap<u32, u128> = HashMap::new();

    // Jobs: each key's jobs written in sequence, in rounds; in each round a
    // third are due at once, the rest up to 12 s after the round is written;
    // one in twenty fails once and is retried. The rounds are written while
    // the faults below happen, so that faults hit a system with jobs in flight.
    let producer = Producer::new(&cfg).unwrap();
    let work = cfg.topics.work[0].clone();
    let mut fails: HashMap<JobId, u32> = HashMap::new();
    let mut rounds: Vec<Vec<(Job, i64)>> = Vec::new();
    for seq in 0..per_key {
        let round: Vec<(Job, i64)> = (0..keys)
            .map(|k| {
                let delay = if (k + seq) % 3 == 0 {
                    0
                } else {
                    500 + (seq as i64 * 300) % 12_000
                };
                let fail = mode.fails(k, seq);
                let then = match mode {
                    _ if mode.exactly_once() => format!(" then={follow}"),
                    _ => String::new(),
                };
                let mut job = Job::new(
                    &work,
                    format!("key-{k}"),
                    format!("seq={seq} work=2 fail={fail}{then}").into_bytes(),
                );
                job.tenant = mode.tenant(k, keys);
                fails.insert(job.id, fail);
                (job, delay)
            })
            .collect();
        rounds.push(round);
    }
    let total = fails.len();
    let start = Utc::now();
    // The rounds are spread over about as long as the faults take (each
    // fault is a kill and a restart, about 1.5 s), so that the later faults
    // too hit jobs in flight rather than an idle system.
    let pace = Duration::from_millis(1500 * cycles as u64 / rounds.len().max(1) as u64);
    let writer = tokio::spawn(async move {
        let mut run_at: HashMap<JobId, i64> = HashMap::new();
        let mut resent: HashSet<JobId> = HashSet::new();
        let first = tokio::time::Instant::now();
        for (i, round) in rounds.into_iter().enumerate() {
            tokio::time::sleep_until(first + pace * i as u32).await;
            let now = Utc::now();
            let jobs: Vec<Job> = round
                .into_iter()
                .map(|(j, delay)| j.at(now + chrono::Duration::milliseconds(delay)))
                .collect();
            let (written, again) = enqueue_retrying(&producer, jobs).await;
            run_at.extend(written);
            resent.extend(again);
        }
        (run_at, resent)
    });
    // Faults, each once some progress has been made since the last one.
    let mut log = Vec::new();
    let mut fault_times: Vec<u128> = Vec::new();
    // Each fault's time and kind, to put each duplicate down to the fault
    // before it.
    let mut kinds: Vec<(u128, &'static str)> = Vec::new();
    let broker_restart_at = if only_kinds.is_some() {
        usize::MAX
    } else {
        cycles / 2
    };
    let mut down: Option<usize> = None;
    // Which process faults to draw from: 0 scheduler SIGKILL, 1 worker
    // SIGKILL, 2 worker SIGTERM + restart, 3 (exactly-once mode) a
    // scheduler paused past its session and resumed, a zombie; in that
    // mode the second fault is always a zombie.
    let eos = mode.exactly_once();
    let kinds_allowed: Vec<u32> =
        only_kinds
            .clone()
            .unwrap_or_else(|| if eos { vec![0, 1, 2, 3] } else { vec![0, 1, 2] });
    let zombie_at = if eos && only_kinds.is_none() {
        1
    } else {
        usize::MAX
    };
    for cycle in 0..cycles {
        let target = (total * (cycle + 1)) / (cycles + 2);
        wait_for("progress before the next fault", Duration::from_secs(180), || {
            (succeeded(&events::read(&events), &fails).len() >= target).then_some(())
        });
        fault_times.push(now_nanos());
        let done = succeeded(&events::read(&events), &fails).len();
        let fired = record_count(&cfg.kafka.brokers, &work);
        eprintln!(
            "fault {cycle}: {:.1} s after start, {done} of {total} jobs succeeded, {fired} records on the work topic",
            (Utc::now() - start).num_milliseconds() as f64 / 1000.0
        );
        if faults == Faults::LeaderLoss {
            // Kill the busiest leader; restart it on the next cycle.
            match down.take() {
                Some(node) => {
                    broker.restart(node);
                    log.push(format!("broker {node} restarted"));
                    kinds.push((now_nanos(), "broker restarted"));
                }
                None => {
                    let node = busiest_leader(&broker, &cfg);
                    broker.kill(node);
                    down = Some(node);
                    log.push(format!("broker {node} (leader) kill -9"));
                    kinds.push((now_nanos(), "leader broker kill -9"));
                }
            }
            continue;
        }
        if cycle == broker_restart_at {
            broker.kill(0);
            broker.restart(0);
            log.push("broker kill -9 + restart".to_string());
            kinds.push((now_nanos(), "broker kill -9 + restart"));
            continue;
        }
        let kind = match cycle == zombie_at {
            true => 3,
            false => kinds_allowed[rng.gen_range(0..kinds_allowed.len())],
        };
        match kind {
            3 => {
                let i = rng.gen_range(0..schedulers.len());
                let pause = cfg.scheduler.session_timeout + Duration::from_secs(3);
                schedulers[i].pause_for(pause);
                log.push(format!("scheduler {i} SIGSTOP {} s + SIGCONT", pause.as_secs()));
                kinds.push((now_nanos(), "scheduler zombie (SIGSTOP past its session)"));
            }
            0 => {
                let i = rng.gen_range(0..schedulers.len());
                let (pid, at) = schedulers[i].kill9_and_restart();
                deaths.insert(pid, at);
                log.push(format!("scheduler {i} kill -9"));
                kinds.push((at, "scheduler kill -9"));
            }
            1 => {
                let i = rng.gen_range(0..workers.len());
                let (pid, at) = workers[i].kill9_and_restart();
                deaths.insert(pid, at);
                log.push(format!("worker {i} kill -9"));
                kinds.push((at, "worker kill -9"));
            }
            _ => {
                let i = rng.gen_range(0..workers.len());
                workers[i].terminate_and_restart();
                log.push(format!("worker {i} SIGTERM + restart"));
                kinds.push((now_nanos(), "worker SIGTERM + restart"));
            }
        }
    }
    if let Some(node) = down.take() {
        broker.restart(node);
        log.push(format!("broker {node} restarted"));
        kinds.push((now_nanos(), "broker restarted"));
    }
    eprintln!("faults injected: {log:?}");
    let (run_at, resent) = writer.await.expect("job writer");

    // Every job succeeded, and the duplicate runs still going then ended.
    let faults_done = std::time::Instant::now();
    let deadline = faults_done + Duration::from_secs(300);
    let mut said = faults_done;
    let events_now = loop {
        let evs = events::read(&events);
        let ok = succeeded(&evs, &fails).len();
        if ok == total && events::in_flight(&evs, &deaths) == 0 {
            eprintln!(
                "every job succeeded {:.1} s after the last fault",
                faults_done.elapsed().as_secs_f64()
            );
            break evs;
        }
        if said.elapsed() > Duration::from_secs(10) {
            said = std::time::Instant::now();
            eprintln!("after the faults: {ok} of {total} jobs succeeded");
        }
        if std::time::Instant::now() > deadline {
            report_stall(&evs, &fails, &deaths, &cfg, &run_at);
            panic!("timed out after 300 s waiting for every job to succeed and every run to end");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    if mode.exactly_once() {
        // A job's follow-up commits with its offset, in the commit round
        // after its success was logged: wait for the last rounds.
        wait_for("every follow-up committed", Duration::from_secs(120), || {
            let recs = read_all(
                &cfg.kafka.brokers,
                &follow,
                "read_committed",
                Duration::from_secs(60),
            );
            let of: HashSet<&[u8]> = recs.iter().map(|m| m.payload().unwrap_or_default()).collect();
            (of.len() >= total).then_some(())
        });
    }
    drop(workers);
    drop(schedulers);

    // ---- the independent checker
    let brokers = cfg.kafka.brokers.clone();
    // Work topic: every record, in partition order (in exactly-once mode,
    // every committed one, as read_committed readers see them).
    let records = if mode.exactly_once() {
        read_all(&brokers, &work, "read_committed", Duration::from_secs(60))
    } else {
        let n = record_count(&brokers, &work) as usize;
        let records = read_up_to(&brokers, &work, n, Duration::from_secs(60));
        assert_eq!(records.len(), n);
        records
    };
    let mut early_fires = 0;
    let mut parked_copies = 0;
    let mut work_copies: HashMap<JobId, usize> = HashMap::new();
    let mut copy_times: HashMap<(JobId, u32), Vec<u128>> = HashMap::new();
    let mut first_write: HashMap<String, Vec<JobId>> = HashMap::new();
    let mut by_partition: Vec<_> = records.iter().collect();
    by_partition.sort_by_key(|m| (m.partition(), m.offset()));
    for m in by_partition {
        let job = match wire::decode(&RecordView::from_message(m), Context::Work, &Limits::default()) {
            Ok(Cmd::Schedule(j)) => j,
            other => panic!("work topic holds an undecodable record: {other:?}"),
        };
        if m.timestamp().to_millis().unwrap() < job.run_at.timestamp_millis() {
            early_fires += 1;
        }
        if job.parked.is_some() {
            // A job parked behind its held key, back from the scheduler.
            parked_copies += 1;
            continue;
        }
        copy_times
            .entry((job.id, job.attempt))
            .or_default()
            .push(m.timestamp().to_millis().unwrap_or(0) as u128 * 1_000_000);
        let c = work_copies.entry(job.id).or_insert(0);
        *c += 1;
        if *c == 1 && job.attempt == 1 {
            first_write
                .entry(job.key_lossy().into_owned())
                .or_default()
                .push(job.id);
        }
    }
    let lost: Vec<&JobId> = fails.keys().filter(|id| !work_copies.contains_key(id)).collect();
    let dead = record_count(&brokers, &cfg.topics.dead_letter);

    // Handler runs: overlaps per key, early starts, order of first successes.
    let runs_by_key = events::runs_by_key(&events_now, &deaths);
    let early_starts = events_now
        .iter()
        .filter(|e| e.start && (e.nanos / 1_000_000) < run_at[&e.id] as u128)
        .count();
    let overlapping = events::overlaps(&runs_by_key);
    for (key, a, b) in overlapping.iter().take(5) {
        eprintln!("overlap on {key}: {a:?} and {b:?} (fault times {fault_times:?})");
    }
    let overlaps = overlapping.len();
    let mut first_success: HashMap<JobId, u128> = HashMap::new();
    for e in events_now.iter().filter(|e| !e.start && e.attempt > fails[&e.id]) {
        first_success.entry(e.id).or_insert(e.nanos);
    }
    // Jobs that never failed must first succeed in their work-topic order.
    let mut out_of_order = 0;
    for ids in first_write.values() {
        let times: Vec<u128> = ids
            .iter()
            .filter(|id| fails[*id] == 0)
            .map(|id| first_success[id])
            .collect();
        out_of_order += times.windows(2).filter(|w| w[1] < w[0]).count();
    }
    // With held keys, across retries too: no run of a job starts before
    // every job of its key written to the work topic before it succeeded.
    let mut held_order_broken = 0;
    if mode.holds_keys() {
        let mut position: HashMap<JobId, (&str, usize)> = HashMap::new();
        for (key, ids) in &first_write {
            for (i, id) in ids.iter().enumerate() {
                position.insert(*id, (key.as_str(), i));
            }
        }
        for e in events_now.iter().filter(|e| e.start) {
            let Some((key, i)) = position.get(&e.id) else {
                continue;
            };
            let earlier = &first_write[*key][..*i];
            let before = earlier
                .iter()
                .filter(|id| first_success.get(*id).is_none_or(|t| *t > e.nanos))
                .count();
            if before > 0 {
                held_order_broken += 1;
                if held_order_broken <= 5 {
                    eprintln!(
                        "{key}: {} attempt {} started before {before} earlier jobs succeeded",
                        e.id, e.attempt
                    );
                    if std::env::var("KAIROS_CRASH_TIMELINE").is_ok() {
                        let t0 = fault_times.first().copied().unwrap_or(0);
                        eprintln!(
                            "  faults at {:?} ms; log {log:?}",
                            fault_times
                                .iter()
                                .map(|f| (*f as i128 - t0 as i128) / 1_000_000)
                                .collect::<Vec<_>>()
                        );
                        for ev in events_now.iter().filter(|x| x.key == *key) {
                            let pos = position.get(&ev.id).map(|p| p.1);
                            eprintln!(
                                "  {:>8} ms pid {} {} job#{pos:?} (fails {}) attempt {}",
                                (ev.nanos as i128 - t0 as i128) / 1_000_000,
                                ev.pid,
                                if ev.start { "start" } else { "end  " },
                                fails[&ev.id],
                                ev.attempt
                            );
                        }
                    }
                }
            }
        }
    }
    let fire_duplicates: usize = work_copies.values().map(|c| c.saturating_sub(1)).sum::<usize>()
        - fails.values().map(|f| *f as usize).sum::<usize>();
    // Each duplicate (a second fire or start of one attempt of a job) put
    // down to the fault before it.
    let mut start_times: HashMap<(JobId, u32), Vec<u128>> = HashMap::new();
    for e in events_now.iter().filter(|e| e.start) {
        start_times.entry((e.id, e.attempt)).or_default().push(e.nanos);
    }
    eprintln!("duplicates by the fault before them (kind: faults, extra fires, extra runs):");
    let fires_by = by_fault(&kinds, &copy_times);
    let runs_by = by_fault(&kinds, &start_times);
    let mut names: Vec<&str> = kinds.iter().map(|(_, k)| *k).collect();
    names.sort_unstable();
    names.dedup();
    names.push("before the first fault");
    for k in names {
        let n = kinds.iter().filter(|(_, x)| *x == k).count();
        eprintln!(
            "  {k}: {n}, {}, {}",
            fires_by.get(k).unwrap_or(&0),
            runs_by.get(k).unwrap_or(&0)
        );
    }
    let runs = events_now.iter().filter(|e| e.start).count();
    let run_duplicates = runs - total - fails.values().map(|f| *f as usize).sum::<usize>();
    eprintln!(
        "crash suite result ({mode:?} topic, {faults:?}): {total} jobs, {} faults; lost {}, early fires {early_fires}, early starts {early_starts}, \
         out of order {out_of_order}, started before an earlier job of the key succeeded {held_order_broken}, \
         same-key overlaps {overlaps}, dead letters {dead}; parked copies {parked_copies}; \
         duplicates: {fire_duplicates} extra fires (scheduler), {run_duplicates} extra runs (worker re-delivery)",
        log.len(),
        lost.len()
    );
    assert!(lost.is_empty(), "lost jobs: {lost:?}");
    assert_eq!(early_fires, 0);
    assert_eq!(early_starts, 0);
    assert_eq!(out_of_order, 0, "first successes out of order");
    // With held keys, across retries too (set KAIROS_CRASH_TIMELINE=1 for
    // the broken keys' starts and ends beside the faults).
    assert_eq!(
        held_order_broken, 0,
        "starts before an earlier job of the key succeeded"
    );
    assert_eq!(overlaps, 0);
    assert_eq!(dead, 0, "no job should have used up its attempts");
    if mode.exactly_once() {
        // Copies beyond each job's attempts, of jobs the producer wrote once.
        let fired_twice = work_copies
            .iter()
            .filter(|(id, _)| !resent.contains(id))
            .map(|(id, c)| c.saturating_sub(1 + fails[id] as usize))
            .sum::<usize>();
        let resent_twice = work_copies
            .iter()
            .filter(|(id, c)| resent.contains(id) && **c > 1 + fails[id] as usize)
            .count();
        eprintln!(
            "jobs the test's producer sent again after a failed write: {} ({resent_twice} of them stored \
             twice; not counted below)",
            resent.len()
        );
        check_exactly_once(&brokers, &work, &follow, &fails, &resent, fired_twice);
    }
    drop(broker);
}

/// Exactly-once mode: no job fired twice, and each job wrote its follow-up
/// once, as read_committed readers see them; prints what read_uncommitted
/// readers see beyond that (the copies of aborted transactions).
fn check_exactly_once(
    brokers: &str,
    work: &str,
    follow: &str,
    fails: &HashMap<JobId, u32>,
    resent: &HashSet<JobId>,
    fire_duplicates: usize,
) {
    let resent: HashSet<String> = resent.iter().map(|id| format!("follow-up of {id}")).collect();
    let t = Duration::from_secs(60);
    let mut follow_ups: HashMap<String, usize> = HashMap::new();
    for m in read_all(brokers, follow, "read_committed", t) {
        let text = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
        *follow_ups.entry(text).or_default() += 1;
    }
    let missing = fails
        .keys()
        .filter(|id| !follow_ups.contains_key(&format!("follow-up of {id}")))
        .count();
    let twice = follow_ups
        .iter()
        .filter(|(text, n)| **n > 1 && !resent.contains(*text))
        .count();
    let aborted_fires = read_all(brokers, work, "read_uncommitted", t).len()
        - read_all(brokers, work, "read_committed", t).len();
    let aborted_follow_ups =
        read_all(brokers, follow, "read_uncommitted", t).len() - follow_ups.values().sum::<usize>();
    eprintln!(
        "exactly once: {fire_duplicates} extra fires, {twice} follow-ups written twice, {missing} missing; \
         read_uncommitted only (aborted): {aborted_fires} fires, {aborted_follow_ups} follow-ups"
    );
    assert_eq!(fire_duplicates, 0, "jobs fired twice");
    assert_eq!(twice, 0, "follow-ups written twice");
    assert_eq!(missing, 0, "jobs without their follow-up");
    assert_eq!(follow_ups.len(), fails.len(), "follow-ups of jobs not written");
}

/// How many of the times in `seen` beyond the first of each entry (the
/// duplicates) came after each kind of fault in `kinds` (the last fault
/// before the duplicate's time).
fn by_fault<K>(kinds: &[(u128, &'static str)], seen: &HashMap<K, Vec<u128>>) -> HashMap<&'static str, usize> {
    let mut out = HashMap::new();
    for times in seen.values() {
        let mut times = times.clone();
        times.sort_unstable();
        for t in times.iter().skip(1) {
            let kind = kinds
                .iter()
                .filter(|(at, _)| at <= t)
                .max_by_key(|(at, _)| *at)
                .map_or("before the first fault", |(_, k)| k);
            *out.entry(kind).or_insert(0) += 1;
        }
    }
    out
}

/// The node leading the most partitions of the schedule and work topics.
fn busiest_leader(broker: &Broker, cfg: &kairos::Config) -> usize {
    let mut led = vec![0; broker.nodes()];
    for (topic, n) in [
        (&cfg.topics.schedule, cfg.topics.schedule_partitions),
        (&cfg.topics.work[0], cfg.topics.work_partitions),
    ] {
        for p in 0..n {
            if let Some(node) = broker.leader_of(topic, p) {
                led[node] += 1;
            }
        }
    }
    (0..led.len()).max_by_key(|i| led[*i]).expect("a node")
}

/// The two suites here each run several processes; one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A scheduler killed (SIGKILL) and restarted every one to three seconds,
/// with the shipped configuration (static membership, its id kept in the
/// data directory), keeps firing jobs within a few seconds of their run-at:
/// the restarted instance takes its partitions back at once instead of
/// waiting for its dead predecessor's session (30 s) to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_killed_again_and_again_keeps_firing_on_time() {
    kill_loop(GroupProtocol::Classic).await;
}

/// The same under the consumer group protocol (KIP-848), the group's
/// `consumer.session.timeout.ms` 6,000: the broker keeps the instance id
/// for the killed process until its session expires, so the restarted scheduler is refused it
/// (and asks again each second) and takes its partitions back then. Jobs
/// due meanwhile fire that much later; none is lost or early. Kills come
/// 8 to 12 s apart, after each take-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_killed_again_and_again_under_the_consumer_protocol_takes_its_partitions_back() {
    kill_loop(GroupProtocol::Consumer).await;
}

async fn kill_loop(protocol: GroupProtocol) {
    let _one = ONE_AT_A_TIME.lock().await;
    let seed: u64 = std::env::var("KAIROS_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| now_nanos() as u64);
    eprintln!("kill loop: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let broker = common::Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    // The defaults, but for where the broker, the topics and the store are
    // (and the protocol's group settings).
    let mut cfg = broker.config();
    cfg.scheduler.data_dir = dir.path().join("scheduler");
    let (kills, apart, most_late) = match protocol {
        GroupProtocol::Classic => (8, 1000..3000, 5_000),
        GroupProtocol::Consumer => {
            common::system::consumer_protocol(&mut cfg).await;
            // The session, then a join and a catch-up.
            (4, 8000..12000, 11_000)
        }
    };
    kairos::topics::init(&cfg).await.unwrap();
    let config_path = dir.path().join("kairos.toml");
    std::fs::write(&config_path, toml::to_string(&cfg).unwrap()).unwrap();
    let logs = Logs::process_logs();
    let mut scheduler = Proc::spawn(
        vec![
            "--config".into(),
            config_path.to_str().unwrap().into(),
            "scheduler".into(),
        ],
        vec![],
        logs.0.as_ref().unwrap().path().to_path_buf(),
    );

    // The scheduler is up and owns its partitions once a first job fires.
    let producer = Producer::new(&cfg).unwrap();
    let work = cfg.topics.work[0].clone();
    let first =
        Job::new(&work, "ready", b"ready".to_vec()).at(Utc::now() + chrono::Duration::milliseconds(300));
    enqueue_retrying(&producer, vec![first.clone()]).await;
    wait_until_fired(&cfg.kafka.brokers, &work, &[first.id], Duration::from_secs(60));
    // A job every 100 ms, due 1.5 s after it is written (so it is stored
    // and goes through the changelog), while the scheduler is killed.
    let writing = tokio_util::sync::CancellationToken::new();
    let stop_writing = writing.clone();
    let writer = tokio::spawn(async move {
        let mut run_at = HashMap::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        let mut n = 0;
        while !stop_writing.is_cancelled() {
            tick.tick().await;
            let job = Job::new(&work, format!("key-{}", n % 7), format!("job {n}").into_bytes())
                .at(Utc::now() + chrono::Duration::milliseconds(1500));
            n += 1;
            run_at.extend(enqueue_retrying(&producer, vec![job]).await.0);
        }
        run_at
    });
    // The kills (the fault schedule, not a wait for an outcome).
    for _ in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(apart.clone()))).await;
        scheduler.kill9_and_restart();
    }
    writing.cancel();
    let run_at = writer.await.unwrap();
    let ids: Vec<JobId> = run_at.keys().copied().collect();
    let fired = wait_until_fired(
        &cfg.kafka.brokers,
        &cfg.topics.work[0],
        &ids,
        Duration::from_secs(120),
    );
    drop(scheduler);
    let mut late: Vec<i64> = run_at.iter().map(|(id, at)| fired[id] - at).collect();
    late.sort_unstable();
    let pct = |q: f64| late[((late.len() - 1) as f64 * q) as usize];
    eprintln!(
        "kill loop ({protocol:?} protocol): {} jobs, lateness ms p50 {} p99 {} max {}",
        late.len(),
        pct(0.5),
        pct(0.99),
        late[late.len() - 1]
    );
    assert!(late[0] >= 0, "a job fired {} ms early", -late[0]);
    assert!(
        late[late.len() - 1] <= most_late,
        "a job fired {} ms late (more than {most_late} ms)",
        late[late.len() - 1]
    );
}

/// Wait until every one of `ids` has fired on `topic` (looking twice a
/// second); returns each fired job's first fire time.
fn wait_until_fired(brokers: &str, topic: &str, ids: &[JobId], timeout: Duration) -> HashMap<JobId, i64> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let fired = fire_times(brokers, topic);
        if ids.iter().all(|id| fired.contains_key(id)) {
            return fired;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} jobs fired within {timeout:?}",
            ids.iter().filter(|id| fired.contains_key(id)).count(),
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Each job's first fire on `topic`: job id → record timestamp (ms).
fn fire_times(brokers: &str, topic: &str) -> HashMap<JobId, i64> {
    let mut out = HashMap::new();
    for (m, j) in work_jobs(brokers, topic) {
        let ts = m.timestamp().to_millis().unwrap_or(i64::MAX);
        let first = out.entry(j.id).or_insert(ts);
        *first = (*first).min(ts);
    }
    out
}

/// Every record on work topic `topic` now, with the job it carries
/// (records that do not decode are left out).
fn work_jobs(brokers: &str, topic: &str) -> Vec<(rdkafka::message::OwnedMessage, Job)> {
    let n = record_count(brokers, topic) as usize;
    read_up_to(brokers, topic, n, Duration::from_secs(60))
        .into_iter()
        .filter_map(|m| {
            match wire::decode(&RecordView::from_message(&m), Context::Work, &Limits::default()) {
                Ok(Cmd::Schedule(j)) => Some((m, j)),
                _ => None,
            }
        })
        .collect()
}
