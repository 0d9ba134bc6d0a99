//! The scheduler against a real broker: jobs fire no earlier than their
//! run-at and in order; cancel and reschedule work; malformed records are
//! dead-lettered; a scheduler process killed with SIGKILL while ingesting
//! and firing loses no job; a partition moving between two instances loses
//! nothing.

use std::collections::{HashMap, HashSet};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::system::enqueue_all;
use crate::common::{header, read_exactly, read_n, read_up_to, record_count, wait_for, Broker, ChildGuard};
use chrono::{TimeZone, Utc};
use kairos::scheduler::Scheduler;
use kairos::wire::{self, Command as Cmd, Context, Limits, RecordView};
use kairos::{Config, Job, JobId, Producer};
use rdkafka::message::OwnedMessage;
use rdkafka::Message as _;

const T: Duration = Duration::from_secs(30);

pub(crate) fn job_of(m: &OwnedMessage) -> Job {
    match wire::decode(&RecordView::from_message(m), Context::Work, &Limits::default()) {
        Ok(Cmd::Schedule(j)) => j,
        other => panic!("fired record does not decode: {other:?}"),
    }
}

pub(crate) struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kairos::scheduler::SchedulerError>>,
    pub(crate) handle: kairos::scheduler::SchedulerHandle,
}

pub(crate) fn start(cfg: &Config) -> Running {
    start_with_clock(cfg, kairos::clock::system())
}

pub(crate) fn start_with_clock(cfg: &Config, clock: kairos::clock::SharedClock) -> Running {
    let s = Scheduler::builder(cfg).clock(clock).build().expect("scheduler");
    let handle = s.handle();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(s.run_until(async {
        let _ = rx.await;
    }));
    Running {
        stop: Some(tx),
        task,
        handle,
    }
}

impl Running {
    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().expect("scheduler ran cleanly");
    }
}

/// A broker, topics, and a scheduler that owns every schedule partition.
async fn started() -> (&'static Broker, tempfile::TempDir, Config, Running) {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = crate::common::system::config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let running = start(&cfg);
    wait_owned(&running, 3);
    (broker, dir, cfg, running)
}

pub(crate) fn wait_owned(r: &Running, n: usize) {
    wait_for("scheduler to own its partitions", T, || {
        (r.handle.stats().owned.len() == n).then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_fire_no_earlier_than_run_at_and_in_run_at_order() {
    let (_broker, _dir, cfg, running) = started().await;
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let base = Utc::now() + chrono::Duration::milliseconds(1500);
    // Written in reverse run-at order, two keys: the scheduler must reorder.
    // Up to 4.4 s ahead: past the cascade point (about 1 s ahead with the
    // tests' 500 ms window), so most go through the far buckets.
    let mut expected: HashMap<JobId, chrono::DateTime<Utc>> = HashMap::new();
    for i in (0..20).rev() {
        let key = if i % 2 == 0 { "even" } else { "odd" };
        let at = base + chrono::Duration::milliseconds(150 * i);
        let id = producer
            .enqueue(Job::new(&work, key, format!("{i}").into_bytes()))
            .at(at)
            .await
            .unwrap();
        expected.insert(id, at);
    }
    let fired = read_n(&cfg.kafka.brokers, &work, 20, T);
    let mut last_per_key: HashMap<Vec<u8>, i64> = HashMap::new();
    for m in &fired {
        let job = job_of(m);
        let run_at = expected[&job.id];
        assert_eq!(job.run_at, kairos::job::truncate_to_millis(run_at));
        let written = m.timestamp().to_millis().unwrap();
        assert!(
            written >= run_at.timestamp_millis(),
            "job {} fired {} ms early",
            job.id,
            run_at.timestamp_millis() - written
        );
        let prev = last_per_key.insert(job.key.clone(), job.run_at.timestamp_millis());
        assert!(
            prev.is_none_or(|p| p <= job.run_at.timestamp_millis()),
            "out of run-at order"
        );
    }
    assert_eq!(record_count(&cfg.kafka.brokers, &work), 20);
    wait_for("pending to drain", T, || {
        (running.handle.stats().pending == 0).then_some(())
    });
    running.stop().await;
    // Everything ingested is committed, and not one record further.
    assert_eq!(
        crate::common::committed(&cfg.kafka.brokers, &cfg.scheduler.group_id, &cfg.topics.schedule),
        record_count(&cfg.kafka.brokers, &cfg.topics.schedule)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_reschedule_take_effect() {
    let (_broker, _dir, cfg, running) = started().await;
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let at = Utc::now() + chrono::Duration::seconds(2);
    // One key, so one partition and a defined firing order.
    let doomed = producer
        .enqueue(Job::new(&work, "k", b"cancelled".to_vec()))
        .at(at)
        .await
        .unwrap();
    let moved = producer
        .enqueue(Job::new(&work, "k", b"moved".to_vec()))
        .at(at)
        .await
        .unwrap();
    let sentinel = producer
        .enqueue(Job::new(&work, "k", b"sentinel".to_vec()))
        .at(at + chrono::Duration::milliseconds(200))
        .await
        .unwrap();
    producer.cancel(doomed).await.unwrap();
    let far = Utc.with_ymd_and_hms(9999, 12, 31, 0, 0, 0).unwrap();
    producer.reschedule(moved, far).await.unwrap();
    // Cancelling something unknown is harmless.
    producer.cancel(JobId::new()).await.unwrap();
    // The same id sent twice (an idempotent re-send with new content): the
    // second replaces the first, which would have fired first.
    let dup = Job::new(&work, "k", b"first version".to_vec());
    producer.enqueue(dup.clone()).at(at).await.unwrap();
    let replaced = Job {
        payload: b"second version".to_vec(),
        ..dup.clone()
    };
    producer
        .enqueue(replaced)
        .at(at + chrono::Duration::milliseconds(100))
        .await
        .unwrap();
    let fired = read_n(&cfg.kafka.brokers, &work, 2, T);
    let first = job_of(&fired[0]);
    assert_eq!(
        (first.id, first.payload.as_slice()),
        (dup.id, &b"second version"[..])
    );
    assert_eq!(job_of(&fired[1]).id, sentinel, "then only the sentinel fires");
    // Had the cancel, the reschedule or the replacement not taken effect,
    // those jobs (due before the sentinel, same partition) would sit before it.
    assert_eq!(record_count(&cfg.kafka.brokers, &work), 2);
    let st = running.handle.stats();
    assert_eq!(st.pending, 1, "the rescheduled job waits for year 9999");
    assert_eq!(st.cancelled, 1, "cancels counted: {st:?}");
    running.stop().await;
}

/// Two parks of one job (a worker parked it twice behind its held key,
/// each under a number of its own) and the job's retry are three jobs to
/// the scheduler: each fires, with the job's own id. Kept under one id, the
/// later would replace the earlier, and the held key would wait for a park
/// number that never comes back. One park number is of the narrow form,
/// one wide (a hold's identity in its top bits, stored as format 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parks_of_one_job_and_its_retry_each_fire_with_the_jobs_own_id() {
    let (_broker, _dir, cfg, running) = started().await;
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let at = Utc::now() + chrono::Duration::seconds(1);
    let job = Job::new(&work, "k", b"held".to_vec());
    let park = |seq| Job {
        parked: Some(seq),
        ..job.clone()
    };
    let retry = Job {
        attempt: 2,
        ..job.clone()
    };
    let wide = (0x2bad_cafe << 32) | 2;
    for (j, ms) in [(park(1), 0), (park(wide), 100), (retry, 200)] {
        producer
            .enqueue(j)
            .at(at + chrono::Duration::milliseconds(ms))
            .await
            .unwrap();
    }
    let fired = read_n(&cfg.kafka.brokers, &work, 3, T);
    let seen: Vec<(JobId, Option<u64>, u32)> = fired
        .iter()
        .map(job_of)
        .map(|j| (j.id, j.parked, j.attempt))
        .collect();
    assert_eq!(
        seen,
        vec![(job.id, Some(1), 1), (job.id, Some(wide), 1), (job.id, None, 2)]
    );
    wait_for("pending to drain", T, || {
        (running.handle.stats().pending == 0).then_some(())
    });
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_dead_lettered_and_past_due_jobs_fire_at_once() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let (_broker, _dir, cfg, running) = started().await;
    let work = cfg.topics.work[0].clone();
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    let send = |key: Option<&'static str>, headers: Vec<(&'static str, String)>| {
        let mut hs = rdkafka::message::OwnedHeaders::new();
        for (k, v) in &headers {
            hs = hs.insert(rdkafka::message::Header {
                key: k,
                value: Some(v),
            });
        }
        let topic = cfg.topics.schedule.clone();
        let plain = plain.clone();
        async move {
            let mut rec = FutureRecord::<str, str>::to(&topic)
                .payload("p")
                .headers(hs)
                .partition(0);
            if let Some(k) = key {
                rec = rec.key(k);
            }
            plain.send(rec, Duration::from_secs(10)).await.unwrap();
        }
    };
    send(
        Some("k"),
        vec![("kairos-topic", work.clone()), ("kairos-run-at", "soon".into())],
    )
    .await;
    send(None, vec![("kairos-topic", work.clone())]).await;
    send(Some("k"), vec![("kairos-run-at", "0".into())]).await;
    // A valid job long past due (1970), after the bad ones on the same partition.
    send(
        Some("k"),
        vec![("kairos-topic", work.clone()), ("kairos-run-at", "1000".into())],
    )
    .await;
    let dead = read_n(&cfg.kafka.brokers, &cfg.topics.dead_letter, 3, T);
    let reasons: Vec<String> = dead
        .iter()
        .map(|m| String::from_utf8(header(m, "kairos-dead-reason").unwrap().to_vec()).unwrap())
        .collect();
    assert!(reasons[0].contains("kairos-run-at"), "{reasons:?}");
    assert!(reasons[1].contains("no key"), "{reasons:?}");
    assert!(reasons[2].contains("kairos-topic"), "{reasons:?}");
    for m in &dead {
        assert_eq!(header(m, "kairos-origin-partition"), Some(&b"0"[..]));
    }
    let fired = read_n(&cfg.kafka.brokers, &work, 1, T);
    assert_eq!(job_of(&fired[0]).run_at.timestamp_millis(), 1000);
    running.stop().await;
}

/// Jobs already due when the scheduler reads them fire straight from memory:
/// no changelog record, nothing stored, and their schedule offsets are
/// committed once they fired. A due job that replaces a pending one still
/// goes through the store, so the old one never fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_due_on_arrival_fire_from_memory_and_are_committed_after_firing() {
    let (_broker, _dir, cfg, running) = started().await;
    let work = cfg.topics.work[0].clone();
    let raw = kairos::kafka::producer(&cfg.kafka, "test-writer").unwrap();
    let write = |job: &Job| {
        let rec = wire::encode(job, &cfg.topics.schedule);
        let raw = raw.clone();
        async move { kairos::kafka::send(&raw, &rec, None).await.unwrap() }
    };
    // One job far ahead: pending, with one changelog record.
    let later = Job::new(&work, "k-0", b"later".to_vec()).at(Utc::now() + chrono::Duration::hours(1));
    write(&later).await;
    wait_for("the future job to be pending", T, || {
        (running.handle.stats().pending == 1).then_some(())
    });
    // 200 jobs already due, and one due job replacing the pending one.
    let past = Utc::now() - chrono::Duration::seconds(1);
    let mut want: HashSet<JobId> = HashSet::new();
    for i in 0..200 {
        let j = Job::new(&work, format!("k-{i}"), b"due".to_vec()).at(past);
        want.insert(j.id);
        write(&j).await;
    }
    let replacing = later.clone().at(past);
    want.insert(replacing.id);
    write(&replacing).await;
    let fired = read_n(&cfg.kafka.brokers, &work, want.len(), T);
    let got: HashSet<JobId> = fired.iter().map(|m| job_of(m).id).collect();
    assert_eq!(got, want, "every due job fired once");
    // The schedule topic is committed to its end once everything fired.
    let written = record_count(&cfg.kafka.brokers, &cfg.topics.schedule);
    assert_eq!(written, 202);
    wait_for("the schedule topic to be committed to its end", T, || {
        (crate::common::committed(&cfg.kafka.brokers, &cfg.scheduler.group_id, &cfg.topics.schedule)
            == written)
            .then_some(())
    });
    assert_eq!(running.handle.stats().pending, 0, "the replaced job is gone");
    // The changelog saw only the stored job: its put, the replacement's put
    // and the replacement's tombstone. The 200 direct jobs wrote nothing
    // (beside how far each partition is handled, a record or two per batch).
    let n = record_count(&cfg.kafka.brokers, &cfg.topics.changelog) as usize;
    let jobs = read_up_to(&cfg.kafka.brokers, &cfg.topics.changelog, n, T)
        .iter()
        .filter(|m| m.key().is_some_and(|k| k.len() == 16))
        .count();
    assert!((1..=3).contains(&jobs), "{jobs} changelog records of jobs");
    running.stop().await;
}

/// A `kairos scheduler` process with its configuration in a file beside its store.
pub(crate) fn spawn_scheduler(cfg: &Config) -> ChildGuard {
    let toml = toml::to_string(cfg).unwrap();
    let path = cfg.scheduler.data_dir.with_extension("toml");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, toml).unwrap();
    Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["--config", path.to_str().unwrap(), "scheduler"])
        .env("KAIROS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .map(ChildGuard)
        .expect("spawn kairos scheduler")
}

/// Every scheduled id fired at least once and never early; returns duplicates.
pub(crate) fn check_fired(cfg: &Config, expected: &HashMap<JobId, i64>) -> usize {
    let work = &cfg.topics.work[0];
    let all = wait_for("every job to fire", Duration::from_secs(90), || {
        let n = record_count(&cfg.kafka.brokers, work) as usize;
        let recs = read_up_to(&cfg.kafka.brokers, work, n, T);
        let ids: HashSet<JobId> = recs.iter().map(|m| job_of(m).id).collect();
        expected.keys().all(|id| ids.contains(id)).then_some(recs)
    });
    fires(&all, expected).values().map(|n| n - 1).sum()
}

/// Per job id, how many work records of it `recs` holds; asserts none
/// fired before its run-at (`expected`).
pub(crate) fn fires(recs: &[OwnedMessage], expected: &HashMap<JobId, i64>) -> HashMap<JobId, usize> {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_killed_with_sigkill_loses_no_job() {
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        producer,
    } = set_up(|_| {}).await;
    let mut child = spawn_scheduler(&cfg);
    let mut expected: HashMap<JobId, i64> = HashMap::new();
    // 3 rounds: write 600 jobs due over the next 3 seconds, kill -9 the
    // scheduler once it has fired some (it is ingesting and firing), restart
    // it on the same store.
    for round in 0..3 {
        let before = record_count(&cfg.kafka.brokers, &work);
        let start = Utc::now() + chrono::Duration::milliseconds(500);
        let jobs = (0..600)
            .map(|i| {
                let at = start + chrono::Duration::milliseconds(i * 5);
                Job::new(
                    &work,
                    format!("key-{}", i % 37),
                    format!("{round}-{i}").into_bytes(),
                )
                .at(at)
            })
            .collect();
        expected.extend(enqueue_all(&producer, jobs).await);
        wait_for("some jobs to fire", T, || {
            (record_count(&cfg.kafka.brokers, &work) > before).then_some(())
        });
        drop(child); // SIGKILL
        child = spawn_scheduler(&cfg);
    }
    let dups = check_fired(&cfg, &expected);
    eprintln!(
        "fired {} jobs, {} duplicates after 3 kill -9",
        expected.len(),
        dups
    );
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_moving_between_two_instances_loses_nothing() {
    a_partition_moving_between_two_instances(kairos::config::GroupProtocol::Classic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_moving_between_two_instances_loses_nothing_under_the_consumer_protocol() {
    a_partition_moving_between_two_instances(kairos::config::GroupProtocol::Consumer).await;
}

async fn a_partition_moving_between_two_instances(protocol: kairos::config::GroupProtocol) {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg_a = crate::common::system::config(broker, &dir.path().join("a"));
    if protocol == kairos::config::GroupProtocol::Consumer {
        crate::common::system::consumer_protocol(&mut cfg_a).await;
    }
    kairos::topics::init(&cfg_a).await.unwrap();
    let mut cfg_b = cfg_a.clone();
    cfg_b.scheduler.data_dir = dir.path().join("b");
    let work = cfg_a.topics.work[0].clone();
    let producer = Producer::new(&cfg_a).unwrap();
    let a = start(&cfg_a);
    wait_owned(&a, 3);
    // Due after the partitions have moved twice (a few seconds each).
    let at = Utc::now() + chrono::Duration::seconds(15);
    let jobs = (0..500)
        .map(|i| Job::new(&work, format!("key-{i}"), b"x".to_vec()).at(at))
        .collect();
    let expected = enqueue_all(&producer, jobs).await;
    wait_for("A to hold every job", T, || {
        (a.handle.stats().pending == 500).then_some(())
    });
    // B joins: some partitions move to B, which rebuilds them from the changelog.
    let b = start(&cfg_b);
    wait_for("partitions to split between A and B", T, || {
        let (sa, sb) = (a.handle.stats(), b.handle.stats());
        (sa.owned.len() + sb.owned.len() == 3 && !sb.owned.is_empty()).then_some(())
    });
    let (sa, sb) = (a.handle.stats(), b.handle.stats());
    assert_eq!(sa.pending + sb.pending, 500, "A {sa:?} B {sb:?}");
    // A leaves: everything ends on B.
    a.stop().await;
    wait_owned(&b, 3);
    assert_eq!(b.handle.stats().pending, 500);
    let dups = check_fired(&cfg_a, &expected);
    assert_eq!(dups, 0, "no fire was in flight while partitions moved");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_its_store_and_a_new_instance_rebuilds_from_the_changelog() {
    let SetUp {
        _broker,
        dir,
        cfg,
        work,
        producer,
    } = set_up(|_| {}).await;
    let first = start(&cfg);
    wait_owned(&first, 3);
    let at = Utc::now() + chrono::Duration::days(1);
    let jobs = (0..200)
        .map(|i| Job::new(&work, format!("key-{i}"), b"x".to_vec()).at(at))
        .collect();
    enqueue_all(&producer, jobs).await;
    wait_for("all pending", T, || {
        (first.handle.stats().pending == 200).then_some(())
    });
    first.stop().await;

    // Same store: the checkpoint is at the changelog's end, nothing to replay.
    let again = start(&cfg);
    wait_owned(&again, 3);
    let st = again.handle.stats();
    assert_eq!((st.pending, st.replayed), (200, 0), "{st:?}");
    again.stop().await;

    // A new instance with an empty store rebuilds every job from the changelog.
    let mut fresh_cfg = cfg.clone();
    fresh_cfg.scheduler.data_dir = dir.path().join("b");
    let fresh = start(&fresh_cfg);
    wait_owned(&fresh, 3);
    let st = fresh.handle.stats();
    assert_eq!((st.pending, st.replayed), (200, 200), "{st:?}");
    fresh.stop().await;
}

/// A changelog written inside Kafka transactions (one committed, one
/// aborted) is caught up past their markers: a new instance owns its
/// partitions, with the committed put rebuilt and the aborted one not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changelog_written_in_transactions_is_caught_up_past_their_markers() {
    let SetUp {
        _broker, cfg, work, ..
    } = set_up(|_| {}).await;
    let writer = crate::common::TransactionalWriter::new(&cfg.kafka.brokers, "txn-changelog");
    let at = Utc::now() + chrono::Duration::days(1);
    let aborted = Job::new(&work, "k", b"aborted".to_vec()).at(at);
    let committed = Job::new(&work, "k", b"committed".to_vec()).at(at);
    for (job, seq, commit) in [(&aborted, 0, false), (&committed, 1, true)] {
        writer.write(&changelog_put(&cfg, job, seq), 0, commit).await;
    }
    let s = start(&cfg);
    wait_owned(&s, 3);
    let st = s.handle.stats();
    assert_eq!((st.pending, st.replayed), (1, 1), "{st:?}");
    s.stop().await;
}

/// A put of `job` as a scheduler writes it to the changelog.
fn changelog_put(cfg: &Config, job: &Job, seq: u64) -> wire::OwnedRecord {
    wire::OwnedRecord {
        topic: cfg.topics.changelog.clone(),
        key: job.id.as_bytes().to_vec(),
        value: Some(
            kairos::scheduler::stored::StoredJob {
                job: job.clone(),
                seq,
            }
            .encode(),
        ),
        headers: Vec::new(),
    }
}

/// A transaction open on the changelog when a scheduler takes its
/// partitions (a previous owner committing a round) is waited out: the
/// scheduler owns none of them while it is open, and has its put once it
/// commits. An owner that read only to the last stable offset would own
/// them at once, without the put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_waits_out_a_transaction_open_on_the_changelog() {
    let SetUp {
        _broker, cfg, work, ..
    } = set_up(|_| {}).await;
    let writer = crate::common::TransactionalWriter::new(&cfg.kafka.brokers, "txn-open");
    let job = Job::new(&work, "k", b"in flight".to_vec()).at(Utc::now() + chrono::Duration::days(1));
    writer.open(&changelog_put(&cfg, &job, 0), 0).await;
    let s = start(&cfg);
    // Long enough for a scheduler to join, read and own three partitions
    // (two to three seconds here); it must not while the transaction is open.
    let owned = crate::common::wait_until(Duration::from_secs(8), || {
        (!s.handle.stats().owned.is_empty()).then_some(())
    });
    assert!(
        owned.is_none(),
        "owned partitions past an open transaction: {:?}",
        s.handle.stats()
    );
    writer.end(true);
    wait_owned(&s, 3);
    let st = s.handle.stats();
    assert_eq!((st.pending, st.replayed), (1, 1), "{st:?}");
    s.stop().await;
}

/// A broker, a configuration (its store under `dir/a`, tuned by `tune`
/// before its topics are created), the topics, and a producer.
pub(crate) struct SetUp {
    /// The shared broker.
    pub(crate) _broker: &'static Broker,
    /// Kept alive for the test (the stores live under it).
    pub(crate) dir: tempfile::TempDir,
    pub(crate) cfg: Config,
    pub(crate) work: String,
    pub(crate) producer: Producer,
}

pub(crate) async fn set_up(tune: impl FnOnce(&mut Config)) -> SetUp {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = crate::common::system::config(broker, &dir.path().join("a"));
    tune(&mut cfg);
    kairos::topics::init(&cfg).await.unwrap();
    SetUp {
        work: cfg.topics.work[0].clone(),
        producer: Producer::new(&cfg).unwrap(),
        _broker: broker,
        dir,
        cfg,
    }
}

/// `n` jobs on keys `key-0`.. due at `at`.
pub(crate) fn due_at(work: &str, n: usize, at: chrono::DateTime<Utc>) -> Vec<Job> {
    (0..n)
        .map(|i| Job::new(work, format!("key-{i}"), b"x".to_vec()).at(at))
        .collect()
}

/// How the first scheduler goes away in [`changes_written_while_the_scheduler_is_down_win`].
#[derive(Clone, Copy, Debug)]
enum Down {
    /// SIGTERM, as in a deploy; it comes back on the same store.
    Term,
    /// SIGKILL; it comes back on the same store.
    Kill,
    /// SIGKILL; another instance, with an empty store, takes its partitions.
    Moved,
}

/// The rule: a cancel or reschedule acknowledged before the job's run-at
/// wins, also when the scheduler was down at the run-at and comes back
/// (or another instance takes over) with the changes still unread in the
/// schedule topic. `forged`: a record stamped an hour ahead by its producer
/// leads the backlog on every schedule partition.
async fn changes_written_while_the_scheduler_is_down_win(down: Down, forged: bool) {
    let SetUp {
        _broker,
        dir,
        cfg,
        work,
        producer,
    } = set_up(|_| {}).await;
    let first = spawn_scheduler(&cfg);
    let run_at = Utc::now() + chrono::Duration::seconds(6);
    let jobs = due_at(&work, 30, run_at);
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    enqueue_all(&producer, jobs).await;
    let written = record_count(&cfg.kafka.brokers, &cfg.topics.schedule);
    wait_for("the jobs to be stored and committed", T, || {
        (crate::common::committed(&cfg.kafka.brokers, &cfg.scheduler.group_id, &cfg.topics.schedule)
            == written)
            .then_some(())
    });
    match down {
        Down::Term => {
            let pid = first.0.id().to_string();
            let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
            assert!(status.success());
            let mut first = first;
            let exit = first.0.wait().unwrap();
            assert!(exit.success(), "clean stop: {exit:?}");
        }
        Down::Kill | Down::Moved => drop(first),
    }
    let (cancelled, moved, controls) = (&ids[..10], &ids[10..20], &ids[20..]);
    let new_at = kairos::job::truncate_to_millis(run_at + chrono::Duration::seconds(3));
    if forged {
        write_stamped_ahead(&cfg, chrono::Duration::hours(1)).await;
    }
    // Other producers went on meanwhile: the changes sit behind a backlog.
    let backlog: Vec<Job> = (0..3000)
        .map(|i| {
            Job::new(&work, format!("key-{}", i % 30), b"later".to_vec())
                .at(Utc::now() + chrono::Duration::days(1))
        })
        .collect();
    enqueue_all(&producer, backlog).await;
    for id in cancelled {
        producer.cancel(*id).await.unwrap();
    }
    for id in moved {
        producer.reschedule(*id, new_at).await.unwrap();
    }
    assert!(
        Utc::now() < run_at,
        "the changes were acknowledged before the run-at"
    );
    // Back after the run-at, reading the backlog in small batches (so the
    // changes are read well after the due jobs could have fired).
    let back = (run_at - Utc::now()).to_std().unwrap_or_default() + Duration::from_millis(500);
    tokio::time::sleep(back).await;
    let mut again = cfg.clone();
    again.scheduler.ingest_batch = 50;
    if let Down::Moved = down {
        again.scheduler.data_dir = dir.path().join("b");
    }
    let _second = spawn_scheduler(&again);
    // The controls and the rescheduled jobs fire; nothing else does.
    let want: HashSet<JobId> = moved.iter().chain(controls).copied().collect();
    let fired = wait_for(
        "the controls and rescheduled jobs to fire",
        Duration::from_secs(60),
        || {
            let n = record_count(&cfg.kafka.brokers, &work) as usize;
            let recs = read_up_to(&cfg.kafka.brokers, &work, n, T);
            let got: HashSet<JobId> = recs.iter().map(|m| job_of(m).id).collect();
            want.is_subset(&got).then_some(recs)
        },
    );
    let mut seen: HashMap<JobId, usize> = HashMap::new();
    for m in &fired {
        let job = job_of(m);
        *seen.entry(job.id).or_default() += 1;
        assert!(
            !cancelled.contains(&job.id),
            "{down:?}: cancelled job {} fired",
            job.id
        );
        if moved.contains(&job.id) {
            assert_eq!(job.run_at, new_at, "{down:?}: fired with its old run-at");
            assert!(
                m.timestamp().to_millis().unwrap() >= new_at.timestamp_millis(),
                "{down:?}: rescheduled job fired before its new time"
            );
        }
    }
    assert!(seen.values().all(|n| *n == 1), "{down:?}: fired twice: {seen:?}");
    assert_eq!(fired.len(), 20, "{down:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_written_while_the_scheduler_was_stopped_win() {
    changes_written_while_the_scheduler_is_down_win(Down::Term, false).await;
}

/// The same with a record stamped an hour ahead (its CreateTime set by its
/// producer) on every schedule partition, before the backlog and the
/// changes: the scheduler takes no producer's time as proof that a
/// partition is read, so the cancels still win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_stamped_an_hour_ahead_does_not_let_due_jobs_beat_their_cancels() {
    changes_written_while_the_scheduler_is_down_win(Down::Term, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_written_while_the_scheduler_was_killed_win() {
    changes_written_while_the_scheduler_is_down_win(Down::Kill, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_written_while_the_partitions_moved_win() {
    changes_written_while_the_scheduler_is_down_win(Down::Moved, false).await;
}

/// On every schedule partition, a valid schedule record (a job due in a day)
/// whose CreateTime its producer set `ahead` of now.
async fn write_stamped_ahead(cfg: &Config, ahead: chrono::Duration) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    let stamp = (Utc::now() + ahead).timestamp_millis();
    let run_at = wire::format_time(Utc::now() + chrono::Duration::days(1));
    for p in 0..cfg.topics.schedule_partitions {
        let id = JobId::new().to_string();
        let hs = [
            ("kairos-version", "1"),
            ("kairos-id", id.as_str()),
            ("kairos-run-at", run_at.as_str()),
            ("kairos-topic", cfg.topics.work[0].as_str()),
        ]
        .into_iter()
        .fold(rdkafka::message::OwnedHeaders::new(), |hs, (key, v)| {
            hs.insert(rdkafka::message::Header { key, value: Some(v) })
        });
        let rec = FutureRecord::<str, str>::to(&cfg.topics.schedule)
            .key("forged")
            .payload("x")
            .headers(hs)
            .partition(p)
            .timestamp(stamp);
        plain
            .send(rec, Duration::from_secs(10))
            .await
            .expect("the stamped record written");
    }
}

/// A cancel written before the job's run-at, behind a backlog that ingest is
/// still working through when the run-at comes: the job waits for the
/// cancel and never fires. The scheduler's clock is driven by hand, so the
/// run-at comes while the backlog is surely unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_behind_a_backlog_still_wins() {
    let SetUp {
        _broker,
        dir: _dir,
        cfg,
        work,
        producer,
    } = set_up(|cfg| {
        // Small batches: each costs a changelog write and an fsync, so ingest lags.
        cfg.scheduler.ingest_batch = 10;
    })
    .await;
    let clock = kairos::ManualClock::new(Utc::now());
    let running = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    wait_owned(&running, 3);
    let run_at = Utc::now() + chrono::Duration::hours(1);
    let doomed = producer
        .enqueue(Job::new(&work, "k", b"doomed".to_vec()))
        .at(run_at)
        .await
        .unwrap();
    wait_for("the job to be pending", T, || {
        (running.handle.stats().pending == 1).then_some(())
    });
    // The backlog, on the job's partition (same key), then the cancel.
    let backlog: Vec<Job> = (0..3000)
        .map(|i| Job::new(&work, "k", format!("{i}").into_bytes()).at(Utc::now() + chrono::Duration::days(1)))
        .collect();
    enqueue_all(&producer, backlog).await;
    producer.cancel(doomed).await.unwrap();
    let total = record_count(&cfg.kafka.brokers, &cfg.topics.schedule) as u64;
    // The run-at comes while ingest is behind.
    clock.set(run_at + chrono::Duration::hours(1));
    running.handle.wake();
    let ingested = running.handle.stats().ingested;
    assert!(
        ingested < total,
        "ingest was behind at the run-at ({ingested} of {total})"
    );
    wait_for("ingest to read everything", Duration::from_secs(120), || {
        (running.handle.stats().ingested == total).then_some(())
    });
    let st = running.handle.stats();
    assert_eq!(st.cancelled, 1, "{st:?}");
    running.stop().await;
    assert_eq!(
        record_count(&cfg.kafka.brokers, &work),
        0,
        "the cancelled job fired"
    );
}

/// A scheduler killed after its jobs fired but before their schedule
/// offsets were committed: its successor (the same store, or another
/// instance rebuilding from the changelog) reads those records again and
/// skips them, instead of firing their jobs a second time.
async fn records_read_again_after_a_kill_do_not_fire_again(fresh_store: bool) {
    let SetUp {
        _broker,
        dir,
        cfg,
        work,
        producer,
    } = set_up(|cfg| {
        // No commit before the kill.
        cfg.kafka
            .consumer
            .insert("auto.commit.interval.ms".into(), "600000".into());
    })
    .await;
    let first = spawn_scheduler(&cfg);
    let expected = enqueue_all(
        &producer,
        due_at(&work, 200, Utc::now() + chrono::Duration::seconds(3)),
    )
    .await;
    read_n(&cfg.kafka.brokers, &work, expected.len(), T);
    // Their deletions are in the changelog (the scheduler dying before that
    // is the documented duplicate window, not this one).
    wait_for("the fired jobs' tombstones", T, || {
        let n = record_count(&cfg.kafka.brokers, &cfg.topics.changelog) as usize;
        let tombs = read_up_to(&cfg.kafka.brokers, &cfg.topics.changelog, n, T)
            .iter()
            .filter(|m| m.key().is_some_and(|k| k.len() == 16) && m.payload().is_none())
            .count();
        (tombs == expected.len()).then_some(())
    });
    let written = record_count(&cfg.kafka.brokers, &cfg.topics.schedule);
    assert_eq!(
        crate::common::committed(&cfg.kafka.brokers, &cfg.scheduler.group_id, &cfg.topics.schedule),
        0,
        "nothing committed yet"
    );
    drop(first); // SIGKILL
    let mut next = cfg.clone();
    if fresh_store {
        next.scheduler.data_dir = dir.path().join("b");
    }
    let second = start(&next);
    let written = written as u64;
    let st = wait_for(
        "the successor to read the records again",
        Duration::from_secs(60),
        || {
            let st = second.handle.stats();
            (st.ingested == written && st.fired + st.skipped >= written).then_some(st)
        },
    );
    second.stop().await;
    assert_eq!((st.skipped, st.fired), (written, 0), "{st:?}");
    assert_eq!(check_fired(&cfg, &expected), 0, "fired again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_read_again_on_the_same_store_do_not_fire_again() {
    records_read_again_after_a_kill_do_not_fire_again(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_read_again_by_another_instance_do_not_fire_again() {
    records_read_again_after_a_kill_do_not_fire_again(true).await;
}

/// A store that comes back after the broker compacted its changelog does
/// not trust its copy: the changelog keeps a tombstone for its
/// `delete.retention.ms` (half a second here, a day as `topics init` makes
/// it), and once the broker has removed the tombstone of a job cancelled by
/// another instance meanwhile, replaying from the store's checkpoint would
/// not see the cancel and the job would come back and fire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_back_after_its_changelog_was_compacted_does_not_revive_a_cancelled_job() {
    let (setup, clock, base, cancelled) =
        stored_then_cancelled_elsewhere(chrono::Duration::seconds(100)).await;
    let SetUp {
        _broker,
        cfg,
        work,
        producer,
        ..
    } = &setup;
    // The broker compacts the changelog: the job's record goes, then its
    // tombstone.
    let changelog = &cfg.topics.changelog;
    crate::common::compact_soon(&cfg.kafka.brokers, changelog, Duration::from_millis(500)).await;
    compacted_away(cfg, &HashSet::from([cancelled.id])).await;
    // A control job due a second after the cancelled one, same partition.
    let control = Job::new(work.as_str(), "key-2", b"y".to_vec()).at(base + chrono::Duration::seconds(101));
    enqueue_all(producer, vec![control.clone()]).await;
    // The first instance comes back on its old store after both run-ats.
    clock.set(base + chrono::Duration::seconds(200));
    let again = start_with_clock(cfg, std::sync::Arc::new(clock.clone()));
    // Once the control has fired and nothing is left pending or in memory,
    // the cancelled job, had it come back, would have fired too.
    wait_for("the control to fire and nothing to be left", T, || {
        let st = again.handle.stats();
        (st.fired >= 1 && st.pending == 0 && st.in_memory == 0).then_some(())
    });
    let n = record_count(&cfg.kafka.brokers, work) as usize;
    let fired = read_n(&cfg.kafka.brokers, work, n, T);
    let ids: Vec<JobId> = fired.iter().map(|m| job_of(m).id).collect();
    assert_eq!(
        ids,
        vec![control.id],
        "only the control fires, not {}",
        cancelled.id
    );
    again.stop().await;
}

/// A partition's new owner, its store empty, rebuilds the partition from a
/// changelog the broker has compacted: the jobs still pending fire at their
/// run-at, and the jobs cancelled or fired before do not come back (their
/// records and tombstones are gone from the log). Time is a manual clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_owner_rebuilds_from_a_changelog_the_broker_compacted() {
    let setup = set_up(|c| {
        c.topics.schedule_partitions = 2;
        // The first instance hands its partitions over at once when it stops.
        c.scheduler.static_membership = false;
    })
    .await;
    let SetUp {
        cfg,
        work,
        producer,
        dir,
        ..
    } = &setup;
    let changelog = &cfg.topics.changelog;
    crate::common::compact_soon(&cfg.kafka.brokers, changelog, Duration::from_millis(500)).await;
    let base = Utc::now();
    let clock = kairos::ManualClock::new(base);
    let first = start_with_clock(cfg, std::sync::Arc::new(clock.clone()));
    wait_owned(&first, 2);
    let later = base + chrono::Duration::seconds(100);
    let job = |what: &str, i: usize, at| Job::new(work.as_str(), format!("{what}-{i}"), b"x".to_vec()).at(at);
    let kept: Vec<Job> = (0..20).map(|i| job("kept", i, later)).collect();
    let cancelled: Vec<Job> = (0..20).map(|i| job("cancelled", i, later)).collect();
    // Due before the others, but not yet by the producer's clock (the real
    // one), which sends jobs already due straight to the work topic.
    let soon: Vec<Job> = (0..20)
        .map(|i| job("soon", i, base + chrono::Duration::seconds(30)))
        .collect();
    let all: Vec<Job> = kept.iter().chain(&cancelled).chain(&soon).cloned().collect();
    enqueue_all(producer, all).await;
    wait_for("the jobs stored", T, || {
        (first.handle.stats().pending == 60).then_some(())
    });
    for j in &cancelled {
        producer.cancel(j.id).await.unwrap();
    }
    clock.set(base + chrono::Duration::seconds(31));
    wait_for("the cancels applied and the due jobs fired", T, || {
        let st = first.handle.stats();
        (st.cancelled == 20 && st.fired == 20).then_some(())
    });
    let gone: HashSet<JobId> = cancelled.iter().chain(&soon).map(|j| j.id).collect();
    compacted_away(cfg, &gone).await;
    first.stop().await;

    let mut other = cfg.clone();
    other.scheduler.data_dir = dir.path().join("b");
    let second = start_with_clock(&other, std::sync::Arc::new(clock.clone()));
    wait_owned(&second, 2);
    let st = second.handle.stats();
    assert_eq!(st.pending, 20, "rebuilt: the kept jobs alone ({st:?})");
    clock.set(later + chrono::Duration::seconds(1));
    wait_for("the kept jobs to fire", T, || {
        (second.handle.stats().fired == 20).then_some(())
    });
    second.stop().await;
    let fired: Vec<JobId> = read_exactly(&cfg.kafka.brokers, work, 40, T)
        .iter()
        .map(|m| job_of(m).id)
        .collect();
    let want: HashSet<JobId> = kept.iter().chain(&soon).map(|j| j.id).collect();
    assert_eq!(
        fired.iter().copied().collect::<HashSet<_>>(),
        want,
        "each kept and due job fired once"
    );
}

/// A store away longer than the changelog keeps tombstones (half of its
/// `delete.retention.ms`, a day from `topics init`, to spare) rebuilds its
/// partitions from the changelog instead of trusting its copy: compaction
/// may have removed the tombstones of jobs fired or cancelled meanwhile. A
/// store away an hour replays only what changed. Time is a manual clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_away_longer_than_tombstones_are_kept_rebuilds_from_the_changelog() {
    let (setup, clock, _, _) = stored_then_cancelled_elsewhere(chrono::Duration::days(3)).await;
    let cfg = &setup.cfg;
    // Back an hour later: only the tombstone is replayed.
    clock.advance(chrono::Duration::hours(1));
    let back = start_with_clock(cfg, std::sync::Arc::new(clock.clone()));
    wait_owned(&back, 1);
    let st = back.handle.stats();
    assert_eq!((st.pending, st.replayed), (0, 1), "{st:?}");
    back.stop().await;
    // Back two days later: the whole changelog is replayed.
    clock.advance(chrono::Duration::days(2));
    let late = start_with_clock(cfg, std::sync::Arc::new(clock.clone()));
    wait_owned(&late, 1);
    let st = late.handle.stats();
    assert_eq!((st.pending, st.replayed), (0, 2), "{st:?}");
    late.stop().await;
}

/// Wait until the broker's cleaner has removed every changelog record of
/// `ids`, puts and tombstones, and anything else (the log spans more
/// offsets than it holds records). A segment is cleaned only once a newer
/// one is written to, so meanwhile tombstones of ids no job has (what other
/// jobs' changes would be) keep every changelog partition rolling.
async fn compacted_away(cfg: &Config, ids: &HashSet<JobId>) {
    let brokers = &cfg.kafka.brokers;
    let topic = &cfg.topics.changelog;
    let filler: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (records, span) = crate::common::log_now(brokers, topic);
        let left = records
            .iter()
            .filter(|(_, k, _)| {
                <[u8; 16]>::try_from(&k[..]).is_ok_and(|k| ids.contains(&JobId::from_bytes(k)))
            })
            .count();
        if left == 0 && (records.len() as i64) < span {
            eprintln!(
                "changelog compacted: {} records left of {span} offsets",
                records.len()
            );
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the broker did not compact {topic} within 60 s: {left} records of the jobs left, {} records of {span}",
            records.len()
        );
        for p in 0..cfg.topics.schedule_partitions {
            let key = *JobId::new().as_bytes();
            let rec = rdkafka::producer::FutureRecord::<[u8], [u8]>::to(topic)
                .key(&key[..])
                .partition(p);
            filler
                .send(rec, Duration::from_secs(10))
                .await
                .expect("filler tombstone");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Two instances on one schedule partition, each with its own store, on a
/// manual clock: the first stores a job due `due` from now and stops; the
/// second cancels it (a tombstone in the changelog) and stops. Returns the
/// set-up, the clock, its start and the job.
async fn stored_then_cancelled_elsewhere(
    due: chrono::Duration,
) -> (SetUp, kairos::ManualClock, chrono::DateTime<Utc>, Job) {
    let setup = set_up(|c| {
        c.topics.schedule_partitions = 1;
        // Each instance hands its partition over at once when it stops.
        c.scheduler.static_membership = false;
    })
    .await;
    let base = Utc::now();
    let clock = kairos::ManualClock::new(base);
    let first = start_with_clock(&setup.cfg, std::sync::Arc::new(clock.clone()));
    wait_owned(&first, 1);
    let job = Job::new(&setup.work, "key-1", b"x".to_vec()).at(base + due);
    enqueue_all(&setup.producer, vec![job.clone()]).await;
    wait_for("the job stored", T, || {
        (first.handle.stats().pending == 1).then_some(())
    });
    first.stop().await;
    let mut other = setup.cfg.clone();
    other.scheduler.data_dir = setup.dir.path().join("b");
    let second = start_with_clock(&other, std::sync::Arc::new(clock.clone()));
    wait_owned(&second, 1);
    setup.producer.cancel(job.id).await.unwrap();
    wait_for("the cancel applied", T, || {
        (second.handle.stats().cancelled == 1).then_some(())
    });
    second.stop().await;
    (setup, clock, base, job)
}
