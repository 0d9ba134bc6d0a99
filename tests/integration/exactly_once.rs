//! The scheduler's exactly-once mode (`scheduler.exactly_once`) against
//! Kafka: each job fires once as a read_committed consumer sees it, also
//! when the scheduler is killed with SIGKILL while firing; a
//! read_uncommitted reader in the same run sees the copies of aborted
//! transactions, so a duplicate would show there if one were committed.

use std::collections::HashMap;
use std::time::Duration;

use chrono::Utc;
use kairos::{Config, Job, JobId};
use rdkafka::message::OwnedMessage;
use rdkafka::Message as _;

use crate::common::system::enqueue_all;
use crate::common::{read_all, wait_for};
use crate::scheduler::{job_of, set_up, spawn_scheduler, SetUp};

/// How long a test waits for the jobs it wrote to fire.
const T: Duration = Duration::from_secs(90);

/// Per job id, how many work records of it `recs` holds; asserts none
/// fired before its run-at (`expected`).
fn fires(recs: &[OwnedMessage], expected: &HashMap<JobId, i64>) -> HashMap<JobId, usize> {
    let mut n: HashMap<JobId, usize> = HashMap::new();
    for m in recs {
        let j = job_of(m);
        let run_at = expected[&j.id];
        assert!(
            m.timestamp().to_millis().unwrap() >= run_at,
            "job {} fired early",
            j.id
        );
        *n.entry(j.id).or_default() += 1;
    }
    n
}

/// Wait until every job of `expected` is in the work topic as
/// read_committed readers see it; then check each is there exactly once.
/// Returns the work records a read_uncommitted reader sees beyond that
/// (copies written in transactions that aborted).
fn check_exactly_once(cfg: &Config, expected: &HashMap<JobId, i64>) -> usize {
    let work = &cfg.topics.work[0];
    let committed = wait_for("every job to fire", T, || {
        let recs = read_all(&cfg.kafka.brokers, work, "read_committed", T);
        let n = fires(&recs, expected);
        expected.keys().all(|id| n.contains_key(id)).then_some(n)
    });
    let twice: Vec<_> = committed.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "fired more than once: {twice:?}");
    assert_eq!(committed.len(), expected.len(), "only the jobs written fired");
    let all = read_all(&cfg.kafka.brokers, work, "read_uncommitted", T);
    all.len() - expected.len()
}

/// Jobs due over the next seconds fire once each, in transactions: none
/// straight from memory, and the store is left empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_scheduler_fires_each_job_once() {
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        producer,
    } = set_up(|c| c.scheduler.exactly_once = true).await;
    let child = spawn_scheduler(&cfg);
    let start = Utc::now() + chrono::Duration::milliseconds(1500);
    let jobs = (0..300)
        .map(|i| {
            Job::new(&work, format!("key-{}", i % 17), format!("{i}").into_bytes())
                .at(start + chrono::Duration::milliseconds(i * 5))
        })
        .collect();
    let expected = enqueue_all(&producer, jobs).await;
    let aborted = check_exactly_once(&cfg, &expected);
    assert_eq!(aborted, 0, "no transaction aborted without faults");
    drop(child);
}

/// The SIGKILL test of the at-least-once scheduler, in exactly-once mode:
/// killed three times while firing and restarted on its store, it fires
/// every job exactly once as read_committed readers see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_scheduler_killed_with_sigkill_fires_each_job_once() {
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        producer,
    } = set_up(|c| c.scheduler.exactly_once = true).await;
    let mut child = spawn_scheduler(&cfg);
    let mut expected: HashMap<JobId, i64> = HashMap::new();
    for round in 0..3 {
        let before = read_all(&cfg.kafka.brokers, &work, "read_committed", T).len();
        let start = Utc::now() + chrono::Duration::milliseconds(500);
        let jobs = (0..600)
            .map(|i| {
                Job::new(
                    &work,
                    format!("key-{}", i % 37),
                    format!("{round}-{i}").into_bytes(),
                )
                .at(start + chrono::Duration::milliseconds(i * 5))
            })
            .collect();
        expected.extend(enqueue_all(&producer, jobs).await);
        wait_for("some jobs to fire", T, || {
            (read_all(&cfg.kafka.brokers, &work, "read_committed", T).len() > before).then_some(())
        });
        drop(child); // SIGKILL
        child = spawn_scheduler(&cfg);
    }
    let aborted = check_exactly_once(&cfg, &expected);
    eprintln!(
        "fired {} jobs exactly once after 3 kill -9; {aborted} copies in aborted transactions",
        expected.len()
    );
    drop(child);
}

/// What the fence of exactly-once mode rests on (KIP-447), through
/// [`kairos::kafka::Transactional`]: a transaction that adds offsets with
/// the group generation of a member the group has moved on from cannot
/// commit; it is aborted, and read_committed readers never see its records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_with_a_stale_group_generation_aborts() {
    use kairos::kafka::{Transactional, TxnError};
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{Offset, TopicPartitionList};
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        ..
    } = set_up(|_| {}).await;
    let group = crate::common::unique("fence");
    let member = || -> BaseConsumer {
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &cfg.kafka.brokers)
            .set("group.id", &group)
            .set("session.timeout.ms", "6000")
            .create()
            .expect("member");
        c.subscribe(&[&cfg.topics.schedule]).expect("subscribe");
        c
    };
    let assigned = |c: &BaseConsumer| {
        wait_for("an assignment", T, || {
            c.poll(Duration::from_millis(50));
            (c.assignment().map(|a| a.count()).unwrap_or(0) > 0).then_some(())
        })
    };
    let first = member();
    assigned(&first);
    let stale = first.group_metadata().expect("group metadata");
    // A second member joins: the group moves to a new generation.
    let second = member();
    wait_for("the second member's assignment", T, || {
        first.poll(Duration::from_millis(50));
        second.poll(Duration::from_millis(50));
        (second.assignment().map(|a| a.count()).unwrap_or(0) > 0).then_some(())
    });
    let txn = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || {
            Transactional::new(
                &cfg.kafka,
                "fence-test",
                &crate::common::unique("fence-txn"),
                Duration::from_secs(15),
            )
        }
    })
    .await
    .unwrap()
    .expect("transactions initialised");
    txn.begin().expect("begin");
    let job = Job::new(&work, "k", b"zombie".to_vec());
    kairos::kafka::send(txn.producer(), &kairos::wire::encode(&job, &work), None)
        .await
        .expect("written");
    let mut offsets = TopicPartitionList::new();
    offsets
        .add_partition_offset(&cfg.topics.schedule, 0, Offset::Offset(0))
        .unwrap();
    let sent = tokio::task::spawn_blocking(move || {
        let r = txn.send_offsets(&offsets, &stale).and_then(|()| txn.commit());
        let aborted = matches!(r, Err(TxnError::Abortable(_))) && txn.abort().is_ok();
        (r.map_err(|e| e.to_string()), aborted)
    })
    .await
    .unwrap();
    assert!(sent.0.is_err(), "committed with a stale generation");
    assert!(sent.1, "abortable, and aborted: {:?}", sent.0);
    assert_eq!(read_all(&cfg.kafka.brokers, &work, "read_committed", T).len(), 0);
    assert_eq!(
        read_all(&cfg.kafka.brokers, &work, "read_uncommitted", T).len(),
        1
    );
}
