//! Worker processes joining, leaving gracefully and being killed with SIGKILL
//! while 100,000 jobs over 10,000 keys flow: no job lost, no two jobs of a
//! key running at once (across processes), each key's jobs first completed
//! in the order they were written. Runs are recorded by the example handler
//! in an event file shared by the processes; the checker reads it at the end.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::IntoFuture;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{events, wait_for, Broker, ChildGuard};
use kairos::config::GroupProtocol;
use kairos::{Config, Job, JobId, Producer};

const KEYS: usize = 10_000;
const PER_KEY: usize = 10;

/// A worker process, killed with SIGKILL when dropped.
struct WorkerProc {
    child: ChildGuard,
}

impl WorkerProc {
    fn spawn(config: &Path, events: &Path) -> WorkerProc {
        let child = Command::new(env!("CARGO_BIN_EXE_kairos"))
            .args([
                "--config",
                config.to_str().unwrap(),
                "worker",
                "--events",
                events.to_str().unwrap(),
            ])
            .env("KAIROS_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn kairos worker");
        WorkerProc {
            child: ChildGuard(child),
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL; returns the time of death in Unix nanoseconds.
    fn kill9(mut self) -> (u32, u128) {
        let pid = self.pid();
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        (pid, now_nanos())
    }

    /// SIGTERM and wait for the graceful exit.
    fn terminate(mut self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        let code = self.child.wait().unwrap();
        assert!(code.success(), "worker exited with {code}");
    }
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_joining_leaving_and_killed_lose_nothing_and_never_overlap_a_key() {
    workers_joining_leaving_and_killed(GroupProtocol::Classic).await;
}

/// The same under the consumer group protocol (KIP-848): the broker
/// assigns the partitions and moves them incrementally; the group's session
/// is 6 s (a group config, see `common::system::consumer_protocol`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_consumer_protocol_workers_joining_leaving_and_killed_lose_nothing_and_never_overlap_a_key()
{
    workers_joining_leaving_and_killed(GroupProtocol::Consumer).await;
}

/// Both protocols measure time-sensitive overlaps: one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn workers_joining_leaving_and_killed(protocol: GroupProtocol) {
    let _one = ONE_AT_A_TIME.lock().await;
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: Config = common::system::config(broker, dir.path());
    if protocol == GroupProtocol::Consumer {
        common::system::consumer_protocol(&mut cfg).await;
    }
    cfg.topics.work_partitions = 12;
    cfg.worker.concurrency = 64;
    cfg.worker.revocation_deadline = Duration::from_secs(10);
    kairos::topics::init(&cfg).await.unwrap();
    let config_path = dir.path().join("worker.toml");
    std::fs::write(&config_path, toml::to_string(&cfg).unwrap()).unwrap();
    let events = dir.path().join("events.log");
    let work = cfg.topics.work[0].clone();

    let mut w1 = Some(WorkerProc::spawn(&config_path, &events));
    let mut w2 = Some(WorkerProc::spawn(&config_path, &events));
    let mut others: Vec<WorkerProc> = Vec::new();
    let mut kills: HashMap<u32, u128> = HashMap::new();

    let producer = Producer::new(&cfg).unwrap();
    // Each key's jobs are written round by round, so their order is defined.
    let mut written: HashMap<JobId, (String, usize)> = HashMap::new();
    for round in 0..PER_KEY {
        let jobs: Vec<Job> = (0..KEYS)
            .map(|k| {
                Job::new(
                    &work,
                    format!("key-{k}"),
                    format!("seq={round} work=1").into_bytes(),
                )
            })
            .collect();
        let writes = jobs.iter().map(|j| producer.enqueue(j.clone()).into_future());
        for (j, r) in jobs.iter().zip(futures::future::join_all(writes).await) {
            r.unwrap();
            written.insert(j.id, (String::from_utf8(j.key.clone()).unwrap(), round));
        }
        match round {
            2 => others.push(WorkerProc::spawn(&config_path, &events)), // a member joins
            4 => {
                // Kill one while it is busy.
                let (pid, at) = w1.take().unwrap().kill9();
                kills.insert(pid, at);
            }
            6 => w2.take().unwrap().terminate(), // a member leaves gracefully
            7 => others.push(WorkerProc::spawn(&config_path, &events)), // a replacement joins
            _ => {}
        }
    }

    let started = Instant::now();
    let evs = wait_for("every job to complete", Duration::from_secs(240), || {
        let evs = events::read(&events);
        let done: HashSet<JobId> = evs.iter().filter(|e| !e.start).map(|e| e.id).collect();
        written.keys().all(|id| done.contains(id)).then_some(evs)
    });
    eprintln!(
        "all {} jobs completed {:?} after the last write",
        written.len(),
        started.elapsed()
    );
    for w in others {
        w.terminate();
    }

    // Runs per key; a run cut by the kill ends at the kill.
    let runs = events::runs_by_key(&evs, &kills);
    let unfinished_runs = evs.iter().filter(|e| e.start).count() - evs.iter().filter(|e| !e.start).count();
    let overlapping = events::overlaps(&runs);
    for (key, a, b) in overlapping.iter().take(5) {
        eprintln!("overlap on {key}: {a:?} and {b:?}");
    }
    let overlaps = overlapping.len();
    // Per-key order of first completions.
    let mut first_end: HashMap<JobId, u128> = HashMap::new();
    for e in evs.iter().filter(|e| !e.start) {
        first_end.entry(e.id).or_insert(e.nanos);
    }
    let mut by_key: HashMap<&str, Vec<(u128, usize)>> = HashMap::new();
    for (id, (key, seq)) in &written {
        by_key.entry(key).or_default().push((first_end[id], *seq));
    }
    let mut out_of_order = 0;
    for runs in by_key.values_mut() {
        runs.sort();
        out_of_order += runs.windows(2).filter(|w| w[1].1 < w[0].1).count();
    }
    let completions = evs.iter().filter(|e| !e.start).count();
    let duplicates = completions - written.len();
    eprintln!(
        "{protocol:?} protocol: checked {} jobs over {KEYS} keys: 0 lost, {overlaps} overlaps, {out_of_order} out of order, \
         {duplicates} duplicate runs (re-delivery after the kill), {unfinished_runs} runs cut by the kill",
        written.len()
    );
    assert_eq!(overlaps, 0, "two jobs of a key ran at the same time");
    assert_eq!(out_of_order, 0, "a key's jobs completed out of order");
    drop(w1);
    drop(w2);
}
