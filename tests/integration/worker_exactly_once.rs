//! The worker's exactly-once mode (`worker.exactly_once`) against Kafka:
//! each job's writes (follow-ups, retries, dead letters) appear once to a
//! read_committed reader, also when a worker process is killed with
//! SIGKILL while settling, and at each step of a transaction; a
//! read_uncommitted reader in the same run sees the copies of aborted
//! transactions, so a duplicate would show there if one were committed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kairos::worker::Outcome;
use kairos::{Config, Job, JobId};
use rdkafka::Message as _;

use crate::common::system::{enqueue_all, run};
use crate::common::{
    committed, header, read_all, record_count, set_topic_config, unique, wait_for, ChildGuard,
};
use crate::scheduler::{set_up, SetUp};

/// How long a test waits for what it expects.
const T: Duration = Duration::from_secs(90);

/// A set-up whose worker settles in transactions, consumes the first work
/// topic and writes follow-ups to the second (`follow`).
async fn eos() -> (SetUp, String) {
    let follow = unique("follow-ups");
    let s = set_up(|cfg| {
        cfg.worker.exactly_once = true;
        cfg.worker.transaction_timeout = Duration::from_secs(10);
        cfg.worker.transactional_id = unique("worker-txn");
        cfg.topics.work.push(follow.clone());
        cfg.worker.topics = vec![cfg.topics.work[0].clone()];
    })
    .await;
    (s, follow)
}

/// Per job id named in a follow-up's payload (`follow-up of ID`), how many
/// follow-ups of it `topic` holds for a reader at `isolation`.
fn follow_ups(cfg: &Config, topic: &str, isolation: &str) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for m in read_all(&cfg.kafka.brokers, topic, isolation, T) {
        let text = String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned();
        let of = text.strip_prefix("follow-up of ").unwrap_or(&text).to_string();
        *n.entry(of).or_default() += 1;
    }
    n
}

/// Wait until every job of `ids` has its follow-up as read_committed
/// readers see it; then check each has exactly one. Returns the follow-ups
/// a read_uncommitted reader sees beyond those (copies in transactions
/// that aborted).
fn check_follow_ups_once(cfg: &Config, topic: &str, ids: &[JobId]) -> usize {
    let seen = wait_for("every follow-up", T, || {
        let n = follow_ups(cfg, topic, "read_committed");
        ids.iter().all(|id| n.contains_key(&id.to_string())).then_some(n)
    });
    let twice: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
    assert!(
        twice.is_empty(),
        "{} jobs wrote their follow-up more than once, among them {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    assert_eq!(seen.len(), ids.len(), "only the jobs written wrote follow-ups");
    let all: usize = follow_ups(cfg, topic, "read_uncommitted").values().sum();
    all - ids.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_exactly_once_worker_writes_each_outcome_once() {
    let (s, follow) = eos().await;
    let cfg = &s.cfg;
    let work = s.work.clone();
    let (to, missing) = (follow.clone(), unique("no-such-topic"));
    let system = run(cfg, false, move |job: Job, _ctx| {
        let (to, missing) = (to.clone(), missing.clone());
        async move {
            match job.payload.as_slice() {
                b"follow" => Outcome::done_with(vec![Job::new(
                    to,
                    job.key.clone(),
                    format!("follow-up of {}", job.id),
                )]),
                b"retry" => Outcome::retry_after(Duration::from_secs(3600), "later"),
                b"dead" => Outcome::dead("asked to"),
                // A follow-up to a topic that does not exist: the job is
                // dead-lettered instead, and nothing else of it is written.
                _ => Outcome::done_with(vec![Job::new(missing, job.key.clone(), "lost")]),
            }
        }
    });
    let kinds: [&[u8]; 4] = [b"follow", b"retry", b"dead", b"unwritable"];
    let jobs: Vec<Job> = (0..400)
        .map(|i| Job::new(work.as_str(), format!("key-{}", i % 23), kinds[i % 4].to_vec()))
        .collect();
    let followed: Vec<JobId> = jobs
        .iter()
        .filter(|j| j.payload == b"follow")
        .map(|j| j.id)
        .collect();
    enqueue_all(&s.producer, jobs).await;
    let extra = check_follow_ups_once(cfg, &follow, &followed);
    assert_eq!(extra, 0, "no transaction aborted here");
    // The retries went to the schedule topic, once each.
    let retries = wait_for("the retries", T, || {
        let recs = read_all(&cfg.kafka.brokers, &cfg.topics.schedule, "read_committed", T);
        (recs.len() >= 100).then_some(recs)
    });
    assert_eq!(retries.len(), 100, "each retry once");
    // Dead letters: the dead jobs and the unwritable ones, once each.
    let dead = wait_for("the dead letters", T, || {
        let recs = read_all(&cfg.kafka.brokers, &cfg.topics.dead_letter, "read_committed", T);
        (recs.len() >= 200).then_some(recs)
    });
    assert_eq!(dead.len(), 200, "each dead letter once");
    // Everything read is committed, by transactions only.
    wait_for("the offsets committed", T, || {
        (committed(&cfg.kafka.brokers, &cfg.worker.group_id, &work) == 400).then_some(())
    });
    let stats = system.worker.stats();
    assert!(stats.transactions > 0, "{stats:?}");
    assert_eq!(stats.transactions_aborted, 0, "{stats:?}");
    system.stop().await;
}

/// A follow-up its topic refuses (larger than the topic takes, within
/// what the client sends) would abort every round: its job is
/// dead-lettered with the refusal instead, alone, and the jobs whose
/// follow-ups failed in the same batches write theirs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_whose_follow_up_kafka_refuses_is_dead_lettered_alone_and_the_round_commits() {
    let (s, follow) = eos().await;
    let cfg = &s.cfg;
    let work = s.work.clone();
    // A batch of the small follow-ups fits; the big one, alone or in a
    // batch, does not.
    set_topic_config(&cfg.kafka.brokers, &follow, &[("max.message.bytes", "65536")]).await;
    let to = follow.clone();
    let system = run(cfg, false, move |job: Job, _ctx| {
        let to = to.clone();
        async move {
            let payload = match job.payload.as_slice() {
                b"big" => vec![b'x'; 128 * 1024],
                _ => format!("follow-up of {}", job.id).into_bytes(),
            };
            Outcome::done_with(vec![Job::new(to, job.key.clone(), payload)])
        }
    });
    let jobs: Vec<Job> = (0..300)
        .map(|i| {
            let payload: &[u8] = if i % 50 == 7 { b"big" } else { b"small" };
            Job::new(work.as_str(), format!("key-{}", i % 11), payload.to_vec())
        })
        .collect();
    let (big, small): (Vec<&Job>, Vec<&Job>) = jobs.iter().partition(|j| j.payload == b"big");
    let (big, small): (Vec<JobId>, Vec<JobId>) = (
        big.iter().map(|j| j.id).collect(),
        small.iter().map(|j| j.id).collect(),
    );
    enqueue_all(&s.producer, jobs).await;
    check_follow_ups_once(cfg, &follow, &small);
    let dead = wait_for("the dead letters", T, || {
        let recs = read_all(&cfg.kafka.brokers, &cfg.topics.dead_letter, "read_committed", T);
        (recs.len() >= big.len()).then_some(recs)
    });
    let text = |m: &rdkafka::message::OwnedMessage, h| {
        String::from_utf8_lossy(header(m, h).unwrap_or_default()).into_owned()
    };
    let mut dead_ids: Vec<String> = dead.iter().map(|m| text(m, "kairos-id")).collect();
    dead_ids.sort();
    let mut want: Vec<String> = big.iter().map(JobId::to_string).collect();
    want.sort();
    assert_eq!(dead_ids, want, "the refused jobs, each dead-lettered once");
    for m in &dead {
        let reason = text(m, "kairos-dead-reason");
        assert!(
            reason.contains("refused by Kafka") && reason.contains("too large"),
            "{reason}"
        );
    }
    wait_for("the offsets committed", T, || {
        (committed(&cfg.kafka.brokers, &cfg.worker.group_id, &work) == 300).then_some(())
    });
    let stats = system.worker.stats();
    assert_eq!(stats.refused, big.len() as u64, "{stats:?}");
    assert!(stats.transactions_aborted > 0, "{stats:?}");
    system.stop().await;
}

/// Refused jobs are read back by one reader: each position asked gets its
/// own record, whatever the order asked in, on topics whose partition
/// numbers are the same, and a position asked twice gets it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_read_back_at_each_position_asked_by_one_reader() {
    let (s, follow) = eos().await;
    let cfg = &s.cfg;
    let topics = [s.work.as_str(), follow.as_str()];
    let raw: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    // Ten records in partition 0 and 1 of both topics: payload names them.
    let mut at = HashMap::new();
    for topic in topics {
        for partition in 0..2 {
            for i in 0..10 {
                let payload = format!("{topic}/{partition}/{i}");
                let rec = rdkafka::producer::FutureRecord::to(topic)
                    .partition(partition)
                    .key("k")
                    .payload(&payload);
                let d = raw.send(rec, Duration::from_secs(10)).await.unwrap();
                at.insert((topic.to_string(), d.partition, d.offset), payload);
            }
        }
    }
    let mut asked: Vec<(&str, i32, i64)> = at.keys().map(|(t, p, o)| (t.as_str(), *p, *o)).collect();
    asked.sort_by_key(|(t, p, o)| (std::cmp::Reverse(*o), *p, *t));
    // Every third, and one twice.
    let mut asked: Vec<(&str, i32, i64)> = asked.into_iter().step_by(3).collect();
    asked.push(asked[2]);
    let brokers = cfg.kafka.clone();
    let positions: Vec<(String, i32, i64)> = asked.iter().map(|(t, p, o)| (t.to_string(), *p, *o)).collect();
    let got = tokio::task::spawn_blocking(move || {
        let positions: Vec<(&str, i32, i64)> =
            positions.iter().map(|(t, p, o)| (t.as_str(), *p, *o)).collect();
        kairos::kafka::read_each(&brokers, "read-each-test", &positions, T, |m| {
            String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned()
        })
    })
    .await
    .unwrap()
    .expect("read back");
    let want: Vec<Option<String>> = asked
        .iter()
        .map(|(t, p, o)| at.get(&(t.to_string(), *p, *o)).cloned())
        .collect();
    assert_eq!(got.len(), asked.len());
    assert!(want.iter().all(Option::is_some), "{want:?}");
    assert_eq!(got, want);
}

/// Holds are read back to the log's end: the records committed after a
/// transaction left open (a worker killed in it) are read once it ends, not
/// passed over as past the end, which a read_committed reader is told is
/// the open transaction's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_to_the_log_end_waits_out_an_open_transaction_and_reads_what_came_after() {
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
    let (s, topic) = eos().await;
    let brokers = s.cfg.kafka.brokers.clone();
    let client = |txn: Option<&str>| {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &brokers);
        if let Some(id) = txn {
            c.set("transactional.id", id);
        }
        c.create::<FutureProducer>().unwrap()
    };
    let send = |p: &FutureProducer, text: &'static str| {
        let p = p.clone();
        let topic = topic.clone();
        async move {
            let rec = FutureRecord::to(&topic).partition(0).key("k").payload(text);
            p.send(rec, Duration::from_secs(10)).await.unwrap();
        }
    };
    let (plain, txn) = (client(None), client(Some(&unique("open-txn"))));
    send(&plain, "before").await;
    txn.init_transactions(Duration::from_secs(30)).unwrap();
    txn.begin_transaction().unwrap();
    send(&txn, "aborted").await;
    send(&plain, "after").await;
    let read = |to_log_end: bool, seen: Option<std::sync::mpsc::Sender<()>>| {
        let (kafka, topic) = (s.cfg.kafka.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            let mut got = Vec::new();
            let each = |m: &rdkafka::message::BorrowedMessage<'_>| {
                got.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
                if let Some(seen) = &seen {
                    let _ = seen.send(());
                }
            };
            let read = match to_log_end {
                false => kairos::kafka::read_to_end(&kafka, "stable", &topic, Some(&[0]), T, each),
                true => kairos::kafka::read_to_log_end(&kafka, "log-end", &topic, Some(&[0]), T, each),
            };
            read.map(|()| got)
        })
    };
    let stable = read(false, None).await.unwrap().unwrap();
    assert_eq!(
        stable,
        vec!["before"],
        "read_committed's end is the open transaction's start"
    );
    let (seen, first) = std::sync::mpsc::channel();
    let waiting = read(true, Some(seen));
    // It has read what comes before the transaction, and waits.
    first.recv_timeout(T).expect("the first record");
    assert!(!waiting.is_finished(), "it read on past an open transaction");
    txn.abort_transaction(Duration::from_secs(30)).unwrap();
    let got = waiting.await.unwrap().expect("read to the log's end");
    assert_eq!(got, vec!["before", "after"]);
}

/// A `kairos worker` process on `cfg`, optionally told to hang at a step
/// of its first transaction with records; its stderr goes to `log`.
fn spawn_worker(cfg: &Config, dir: &Path, hang_at: Option<&str>) -> (ChildGuard, PathBuf) {
    let path = dir.join(format!("{}.toml", unique("worker")));
    std::fs::write(&path, toml::to_string(cfg).unwrap()).unwrap();
    let log = path.with_extension("log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kairos"));
    cmd.args(["--config", path.to_str().unwrap(), "worker"])
        .env("KAIROS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    if let Some(step) = hang_at {
        cmd.env("KAIROS_WORKER_HANG_AT", step);
    }
    (ChildGuard(cmd.spawn().expect("spawn kairos worker")), log)
}

/// `n` example jobs on 17 keys that each write a follow-up to `follow`.
fn with_follow_ups(work: &str, follow: &str, n: usize, work_ms: u64) -> Vec<Job> {
    (0..n)
        .map(|i| {
            let payload = format!("job {i} work={work_ms} then={follow}");
            Job::new(work, format!("key-{}", i % 17), payload)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_worker_killed_with_sigkill_writes_each_follow_up_once() {
    let (s, follow) = eos().await;
    let mut cfg = s.cfg.clone();
    cfg.worker.concurrency = 16;
    let jobs = with_follow_ups(&s.work, &follow, 3_000, 20);
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    enqueue_all(&s.producer, jobs).await;
    // Two kills, at a quarter and at half of the follow-ups written; a
    // restart with the same transactional id aborts what the killed one
    // left open.
    for share in [4, 2] {
        let (mut worker, _) = spawn_worker(&cfg, s.dir.path(), None);
        let at = ids.len() / share;
        wait_for("follow-ups written", T, || {
            (record_count(&cfg.kafka.brokers, &follow) as usize >= at).then_some(())
        });
        worker.kill().unwrap();
        worker.wait().unwrap();
    }
    let (mut worker, _) = spawn_worker(&cfg, s.dir.path(), None);
    wait_for("every offset committed", T, || {
        (committed(&cfg.kafka.brokers, &cfg.worker.group_id, &s.work) == ids.len() as i64).then_some(())
    });
    let extra = check_follow_ups_once(&cfg, &follow, &ids);
    println!("follow-ups of aborted transactions (read_uncommitted only): {extra}");
    worker.kill().unwrap();
}

/// Kill a worker with SIGKILL at `step` of its first transaction with
/// records, start another with the same transactional id, and check each
/// job wrote its follow-up once; returns the aborted copies seen.
async fn killed_at(step: &str) -> usize {
    let (s, follow) = eos().await;
    let jobs = with_follow_ups(&s.work, &follow, 40, 0);
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    enqueue_all(&s.producer, jobs).await;
    let (mut first, log) = spawn_worker(&s.cfg, s.dir.path(), Some(step));
    let marker = format!("kairos: hanging at {step}");
    wait_for("the worker to reach the step", T, || {
        std::fs::read_to_string(&log)
            .ok()?
            .contains(&marker)
            .then_some(())
    });
    first.kill().unwrap();
    first.wait().unwrap();
    let (mut second, _) = spawn_worker(&s.cfg, s.dir.path(), None);
    // Once every offset is committed, nothing of these jobs is written any
    // more: a copy committed late would show in the count.
    wait_for("every offset committed", T, || {
        (committed(&s.cfg.kafka.brokers, &s.cfg.worker.group_id, &s.work) == 40).then_some(())
    });
    let extra = check_follow_ups_once(&s.cfg, &follow, &ids);
    second.kill().unwrap();
    extra
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_before_its_transaction_writes_each_follow_up_once() {
    assert_eq!(
        killed_at("before").await,
        0,
        "nothing was written before the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_inside_its_transaction_writes_each_follow_up_once() {
    let aborted = killed_at("inside").await;
    assert!(
        aborted > 0,
        "the killed transaction's follow-ups were written (and aborted)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_its_transaction_writes_each_follow_up_once() {
    assert_eq!(
        killed_at("after").await,
        0,
        "the committed jobs did not run again"
    );
}

/// A zombie: a worker paused (SIGSTOP) past its session while running jobs
/// and holding writes for its next transaction; another worker (its own
/// transactional id) takes the partitions and runs every job; the first is
/// resumed, finishes its runs and tries to commit them, but its offsets
/// carry a group generation the group has moved on from, so nothing of it
/// commits. read_committed: each follow-up once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_resumed_after_its_partitions_moved_commits_no_write() {
    let (s, follow) = eos().await;
    let jobs = with_follow_ups(&s.work, &follow, 300, 300);
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    enqueue_all(&s.producer, jobs).await;
    let (mut zombie, _) = spawn_worker(&s.cfg, s.dir.path(), None);
    wait_for("some follow-ups committed", T, || {
        (follow_ups(&s.cfg, &follow, "read_committed").len() >= 20).then_some(())
    });
    signal(&zombie, "STOP");
    let mut other = s.cfg.clone();
    other.worker.transactional_id = unique("other-txn");
    let (mut taker, _) = spawn_worker(&other, s.dir.path(), None);
    wait_for("the other worker to run every job", T, || {
        (committed(&s.cfg.kafka.brokers, &s.cfg.worker.group_id, &s.work) == 300).then_some(())
    });
    let before = follow_ups(&s.cfg, &follow, "read_uncommitted")
        .values()
        .sum::<usize>();
    signal(&zombie, "CONT");
    // The zombie's runs end at once (their sleeps are over) and its next
    // transaction, or its release, tries to commit them.
    let tried = crate::common::wait_until(Duration::from_secs(15), || {
        let now: usize = follow_ups(&s.cfg, &follow, "read_uncommitted").values().sum();
        (now > before).then_some(())
    });
    let aborted = check_follow_ups_once(&s.cfg, &follow, &ids);
    match tried {
        Some(()) => eprintln!("300 follow-ups once; the zombie's copies aborted ({aborted} aborted in all)"),
        None => eprintln!("300 follow-ups once; the zombie wrote nothing after it resumed"),
    }
    zombie.kill().unwrap();
    taker.kill().unwrap();
}

/// Send `signal` (`STOP`, `CONT`) to a child process.
fn signal(child: &std::process::Child, signal: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill -{signal}");
}
