//! The worker against a real broker: same-key jobs never overlap and keep
//! their order while other keys run in parallel; retries back off and end in
//! the dead-letter topic; follow-ups run at their run-at; a panicking handler
//! and malformed records do not stop the worker; a job read before its run-at
//! goes back to the scheduler.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::system::{config, enqueue_all, run};
use crate::common::{header, read_n, wait_for, Broker};
use chrono::Utc;
use kairos::worker::Outcome;
use kairos::{Job, Producer};

const T: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
struct Run {
    key: String,
    seq: u32,
    start: Instant,
    end: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_jobs_never_overlap_and_keep_order_while_keys_run_in_parallel() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.worker.concurrency = 16;
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    // 10 keys x 20 jobs; the payload is the job's position within its key.
    let mut jobs = Vec::new();
    for seq in 0..20u32 {
        for k in 0..10 {
            jobs.push(Job::new(&work, format!("key-{k}"), seq.to_string().into_bytes()));
        }
    }
    // Written one key-round at a time so that per-key order is defined.
    for chunk in jobs.chunks(10) {
        enqueue_all(&producer, chunk.to_vec()).await;
    }
    let runs: Arc<Mutex<Vec<Run>>> = Default::default();
    let r = runs.clone();
    let sys = run(&cfg, false, move |job: Job, _ctx| {
        let runs = r.clone();
        async move {
            let start = Instant::now();
            tokio::time::sleep(Duration::from_millis(5)).await;
            let seq: u32 = String::from_utf8(job.payload).unwrap().parse().unwrap();
            runs.lock().unwrap().push(Run {
                key: String::from_utf8(job.key).unwrap(),
                seq,
                start,
                end: Instant::now(),
            });
            Outcome::done()
        }
    });
    wait_for("200 jobs to run", T, || {
        (runs.lock().unwrap().len() >= 200).then_some(())
    });
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 200);
    let mut by_key: HashMap<String, Vec<Run>> = HashMap::new();
    for r in &runs {
        by_key.entry(r.key.clone()).or_default().push(r.clone());
    }
    for (key, mut rs) in by_key {
        rs.sort_by_key(|r| r.start);
        let seqs: Vec<u32> = rs.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, (0..20).collect::<Vec<_>>(), "key {key} ran out of order");
        for w in rs.windows(2) {
            assert!(
                w[1].start >= w[0].end,
                "key {key}: jobs {} and {} overlapped",
                w[0].seq,
                w[1].seq
            );
        }
    }
    // Other keys did run in parallel: some pair of runs of different keys overlapped.
    let overlapping = runs.iter().any(|a| {
        runs.iter()
            .any(|b| a.key != b.key && a.start < b.end && b.start < a.end)
    });
    assert!(overlapping, "no two keys ever ran at the same time");
    wait_for("offsets to settle", T, || {
        (sys.worker.stats().open == 0).then_some(())
    });
    sys.stop().await;
    assert_eq!(
        crate::common::committed(&cfg.kafka.brokers, &cfg.worker.group_id, &work),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_back_off_through_the_scheduler_and_end_in_the_dead_letter_topic() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let attempts: crate::common::Recorded<(u32, Instant, Option<String>)> = Default::default();
    let a = attempts.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let a = a.clone();
        async move {
            a.lock()
                .unwrap()
                .push((job.attempt, Instant::now(), job.last_error.clone()));
            Outcome::retry(format!("boom on attempt {}", job.attempt))
        }
    });
    let producer = Producer::new(&cfg).unwrap();
    let id = producer
        .enqueue(Job::new(&work, "k", b"fails".to_vec()).max_attempts(3))
        .await
        .unwrap();
    let dead = read_n(&cfg.kafka.brokers, &cfg.topics.dead_letter, 1, T);
    let reason = String::from_utf8(header(&dead[0], "kairos-dead-reason").unwrap().to_vec()).unwrap();
    assert_eq!(reason, "gave up after 3 attempts: boom on attempt 3");
    assert_eq!(header(&dead[0], "kairos-id"), Some(id.to_string().as_bytes()));
    assert_eq!(header(&dead[0], "kairos-attempt"), Some(&b"3"[..]));
    assert_eq!(header(&dead[0], "kairos-origin-topic"), Some(work.as_bytes()));
    let a = attempts.lock().unwrap().clone();
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(a[1].2.as_deref(), Some("boom on attempt 1"));
    // Backoff with jitter: attempt n waits between half and all of 300ms * 2^(n-1).
    assert!(
        a[1].1 - a[0].1 >= Duration::from_millis(150),
        "{:?}",
        a[1].1 - a[0].1
    );
    assert!(
        a[2].1 - a[1].1 >= Duration::from_millis(300),
        "{:?}",
        a[2].1 - a[1].1
    );
    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_ups_run_at_their_run_at() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let seen: crate::common::Recorded<(String, chrono::DateTime<Utc>, chrono::DateTime<Utc>)> =
        Default::default();
    let s = seen.clone();
    let w = work.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let s = s.clone();
        let w = w.clone();
        async move {
            let payload = String::from_utf8(job.payload.clone()).unwrap();
            s.lock().unwrap().push((payload.clone(), job.run_at, Utc::now()));
            if payload == "first" {
                let next = Job::new(&w, job.key.clone(), b"follow-up".to_vec())
                    .at(Utc::now() + chrono::Duration::milliseconds(1500));
                Outcome::done_with(vec![next])
            } else {
                Outcome::done()
            }
        }
    });
    Producer::new(&cfg)
        .unwrap()
        .enqueue(Job::new(&work, "k", b"first".to_vec()))
        .await
        .unwrap();
    wait_for("the follow-up to run", T, || {
        (seen.lock().unwrap().len() == 2).then_some(())
    });
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[1].0, "follow-up");
    assert!(
        seen[1].2 >= seen[1].1,
        "follow-up ran {} early",
        seen[1].1 - seen[1].2
    );
    assert!(seen[1].1 - seen[0].2 >= chrono::Duration::milliseconds(1400));
    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_and_malformed_records_do_not_stop_the_worker() {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let done: Arc<Mutex<Vec<String>>> = Default::default();
    let d = done.clone();
    let sys = run(&cfg, false, move |job: Job, _ctx| {
        let d = d.clone();
        async move {
            let p = String::from_utf8(job.payload).unwrap();
            if p == "panic" {
                panic!("handler bug");
            }
            d.lock().unwrap().push(p);
            Outcome::done()
        }
    });
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    // All on partition 0, in this order: a panic (one attempt allowed),
    // a record with a garbage run-at, a keyless record, then a good job.
    let mut hs = rdkafka::message::OwnedHeaders::new();
    hs = hs.insert(rdkafka::message::Header {
        key: "kairos-max-attempts",
        value: Some("1"),
    });
    let sends = [
        FutureRecord::<str, str>::to(&work)
            .key("k1")
            .payload("panic")
            .headers(hs),
        FutureRecord::<str, str>::to(&work)
            .key("k2")
            .payload("x")
            .headers(
                rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                    key: "kairos-run-at",
                    value: Some("yesterday-ish"),
                }),
            ),
        FutureRecord::<str, str>::to(&work).payload("no key"),
        FutureRecord::<str, str>::to(&work).key("k3").payload("good"),
    ];
    for rec in sends {
        plain
            .send(rec.partition(0), Duration::from_secs(10))
            .await
            .unwrap();
    }
    let dead = read_n(&cfg.kafka.brokers, &cfg.topics.dead_letter, 3, T);
    let mut reasons: Vec<String> = dead
        .iter()
        .map(|m| String::from_utf8(header(m, "kairos-dead-reason").unwrap().to_vec()).unwrap())
        .collect();
    reasons.sort();
    assert!(
        reasons[0].starts_with("gave up after 1 attempts: handler panicked: handler bug"),
        "{reasons:?}"
    );
    assert!(reasons[1].contains("kairos-run-at"), "{reasons:?}");
    assert!(reasons[2].contains("no key"), "{reasons:?}");
    wait_for("the good job", T, || {
        (done.lock().unwrap().as_slice() == ["good"]).then_some(())
    });
    let st = sys.worker.stats();
    assert_eq!(st.panicked, 1);
    wait_for("offsets to settle", T, || {
        (sys.worker.stats().open == 0).then_some(())
    });
    sys.stop().await;
    assert_eq!(
        crate::common::committed(&cfg.kafka.brokers, &cfg.worker.group_id, &work),
        4
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_read_before_its_run_at_goes_to_the_scheduler_and_runs_on_time() {
    read_before_its_run_at(kairos::config::OnFailure::Overtake).await;
}

/// On a hold-key topic the hand-over goes through the worker's keeper, in
/// order with the partition's parked jobs (a hold never counts past a
/// hand-over Kafka may not have).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_read_before_its_run_at_on_a_hold_key_topic_goes_to_the_scheduler_and_runs_on_time() {
    read_before_its_run_at(kairos::config::OnFailure::HoldKey).await;
}

async fn read_before_its_run_at(on_failure: kairos::config::OnFailure) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.worker.on_failure = on_failure;
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let ran: crate::common::Recorded<(chrono::DateTime<Utc>, chrono::DateTime<Utc>)> = Default::default();
    let r = ran.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let r = r.clone();
        async move {
            r.lock().unwrap().push((job.run_at, Utc::now()));
            Outcome::done()
        }
    });
    // Once the worker owns the work partitions (a join slowed down by a
    // busy machine would otherwise read the job after its run-at), a
    // foreign producer writes a future job straight to the work topic.
    let partitions = cfg.topics.work_partitions as usize;
    wait_for("the worker to own the work partitions", T, || {
        (sys.worker.stats().owned == partitions).then_some(())
    });
    let at = Utc::now() + chrono::Duration::seconds(3);
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    let ms = at.timestamp_millis().to_string();
    let hs = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
        key: "kairos-run-at",
        value: Some(&ms),
    });
    plain
        .send(
            FutureRecord::<str, str>::to(&work)
                .key("k")
                .payload("later")
                .headers(hs),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    wait_for("the job to run", T, || {
        (ran.lock().unwrap().len() == 1).then_some(())
    });
    let (run_at, started) = ran.lock().unwrap()[0];
    assert!(started >= run_at, "ran {} early", run_at - started);
    let st = sys.worker.stats();
    assert_eq!(st.handed_to_scheduler, 1, "{st:?}");
    sys.stop().await;
}

/// A job delivered before its run-at but within its early allowance
/// (`kairos-early`) runs at once; one delivered before its allowance waits
/// for the scheduler, and runs no earlier than the allowance lets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_within_its_early_allowance_runs_before_its_run_at_and_one_beyond_it_waits() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    // (key, run-at, started)
    type Run = (String, chrono::DateTime<Utc>, chrono::DateTime<Utc>);
    let ran: crate::common::Recorded<Run> = Default::default();
    let r = ran.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let r = r.clone();
        async move {
            let key = String::from_utf8_lossy(&job.key).to_string();
            r.lock().unwrap().push((key, job.run_at, Utc::now()));
            Outcome::done()
        }
    });
    let allowed = Job::new(&work, "allowed", b"x".to_vec())
        .at(Utc::now() + chrono::Duration::seconds(30))
        .early(Duration::from_secs(60));
    let beyond = Job::new(&work, "beyond", b"x".to_vec())
        .at(Utc::now() + chrono::Duration::seconds(4))
        .early(Duration::from_millis(500));
    // Written straight to the work topic (as an early release delivers
    // them; the producer routes a future job to the scheduler).
    let plain: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    for job in [&allowed, &beyond] {
        let rec = kairos::wire::encode(job, &work);
        plain
            .send(
                rdkafka::producer::FutureRecord::<[u8], [u8]>::to(&work)
                    .key(&rec.key)
                    .payload(rec.value.as_deref().unwrap_or_default())
                    .headers(rec.kafka_headers()),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    wait_for("both jobs to run", T, || {
        (ran.lock().unwrap().len() == 2).then_some(())
    });
    let runs = ran.lock().unwrap().clone();
    let of = |key: &str| {
        runs.iter()
            .find(|(k, _, _)| k == key)
            .cloned()
            .unwrap_or_else(|| panic!("no run of {key}: {runs:?}"))
    };
    let (_, run_at, started) = of("allowed");
    assert!(
        started < run_at - chrono::Duration::seconds(20),
        "ran early, within its allowance"
    );
    let (_, run_at, started) = of("beyond");
    assert!(
        started >= run_at - chrono::Duration::milliseconds(500),
        "never earlier than its allowance: {} early",
        run_at - started
    );
    assert_eq!(
        sys.worker.stats().handed_to_scheduler,
        1,
        "only `beyond` went to the scheduler"
    );
    sys.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_ignores_cancellation_is_released_at_the_deadline_and_its_job_runs_again() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.worker.revocation_deadline = Duration::from_secs(1);
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    // Worker A hangs on the job for 12 s and ignores its cancellation token.
    let a_runs: crate::common::Recorded<(kairos::JobId, Instant, Instant)> = Default::default();
    let a = a_runs.clone();
    let sys_a = run(&cfg, false, move |job: Job, _ctx| {
        let a = a.clone();
        async move {
            let start = Instant::now();
            tokio::time::sleep(Duration::from_secs(12)).await; // deaf to cancellation
            a.lock().unwrap().push((job.id, start, Instant::now()));
            Outcome::done()
        }
    });
    let producer = Producer::new(&cfg).unwrap();
    let id = producer
        .enqueue(Job::new(&work, "k", b"hang".to_vec()))
        .await
        .unwrap();
    wait_for("A to start the job", T, || {
        (sys_a.worker.stats().started == 1).then_some(())
    });
    // A shuts down: it releases its partitions after the deadline, not after the handler.
    let released = Instant::now();
    sys_a.stop().await;
    let took = released.elapsed();
    assert!(
        took < Duration::from_secs(4),
        "release waited {took:?}, past the 1 s deadline"
    );
    // B takes over and runs the job again: it was never finished, so never committed.
    let b_runs: crate::common::Recorded<(kairos::JobId, Instant)> = Default::default();
    let b = b_runs.clone();
    let sys_b = run(&cfg, false, move |job: Job, _ctx| {
        let b = b.clone();
        async move {
            b.lock().unwrap().push((job.id, Instant::now()));
            Outcome::done()
        }
    });
    wait_for("B to run the job", T, || {
        (!b_runs.lock().unwrap().is_empty()).then_some(())
    });
    let (b_id, b_start) = b_runs.lock().unwrap()[0];
    assert_eq!(b_id, id);
    // This is the documented limit: A's run was still going when B started.
    wait_for("A's run to end", T, || {
        (!a_runs.lock().unwrap().is_empty()).then_some(())
    });
    let (_, _, a_end) = a_runs.lock().unwrap()[0];
    assert!(
        b_start < a_end,
        "the overlap past the deadline is the documented case"
    );
    sys_b.stop().await;
}

/// A worker that has not heard from the group coordinator for half its
/// session timeout starts no job: its partitions may have moved without it
/// knowing (its session can expire on the coordinator meanwhile), and a job
/// it started then could run beside the new owner's run of the same key.
/// It starts the rest once the coordinator answers again. The broker is
/// stopped (SIGSTOP) for 5 s, less than the 6 s session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_out_of_touch_with_the_coordinator_for_half_its_session_starts_no_job() {
    let broker = Broker::own();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&broker, dir.path());
    cfg.worker.concurrency = 1;
    assert_eq!(cfg.worker.session_timeout, Duration::from_secs(6));
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let jobs = (0..150)
        .map(|i| Job::new(&work, format!("key-{i}"), b"x".to_vec()))
        .collect();
    enqueue_all(&producer, jobs).await;
    let starts: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let s = starts.clone();
    let sys = run(&cfg, false, move |_job: Job, _ctx| {
        let s = s.clone();
        async move {
            s.lock().unwrap().push(Instant::now());
            // Each job takes 100 ms: 150 jobs outlast the broker's stop.
            tokio::time::sleep(Duration::from_millis(100)).await;
            Outcome::done()
        }
    });
    wait_for("the first jobs to start", T, || {
        (starts.lock().unwrap().len() >= 5).then_some(())
    });
    let pid = broker.node_pid(0).expect("the broker runs").to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap();
        assert!(ok.success(), "kill {sig} {pid}");
    };
    signal("-STOP");
    let stopped = Instant::now();
    // The fault lasts 5 s; meanwhile the worker says it is out of touch.
    let mut said = false;
    while stopped.elapsed() < Duration::from_secs(5) {
        said |= sys.worker.stats().out_of_touch;
        std::thread::sleep(Duration::from_millis(50));
    }
    let resumed = Instant::now();
    signal("-CONT");
    wait_for("the worker to be in touch again", T, || {
        (!sys.worker.stats().out_of_touch).then_some(())
    });
    wait_for("every job to start", Duration::from_secs(60), || {
        (starts.lock().unwrap().len() >= 150).then_some(())
    });
    sys.stop().await;
    let starts = starts.lock().unwrap().clone();
    let between = |from: Instant, to: Instant| starts.iter().filter(|t| **t >= from && **t < to).count();
    // The coordinator's last answer came before the stop: 3 s later (half
    // the session) nothing starts. 300 ms for a commit answered just before.
    let ran_on = between(stopped, stopped + Duration::from_millis(2500));
    let late = between(stopped + Duration::from_millis(3300), resumed);
    assert!(
        ran_on >= 10,
        "the worker ran on while it had heard lately: {ran_on} starts"
    );
    assert_eq!(
        late, 0,
        "jobs started with no answer from the coordinator for over 3 s"
    );
    assert!(said, "the worker's stats never said it was out of touch");
}

/// `kairos-if-busy: skip`: a first attempt read while a job of its key runs
/// is finished without running; one that asks to queue waits its turn, and
/// a skip-job of an idle key runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_skips_when_its_key_is_busy_is_skipped_while_an_earlier_one_runs() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.worker.concurrency = 4;
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let ran: crate::common::Recorded<String> = Default::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    let (r, g) = (ran.clone(), gate.clone());
    let sys = run(&cfg, false, move |job: Job, _ctx| {
        let (ran, gate) = (r.clone(), g.clone());
        async move {
            let name = String::from_utf8(job.payload).unwrap();
            ran.lock().unwrap().push(name.clone());
            if name == "first" {
                gate.notified().await;
            }
            Outcome::done()
        }
    });
    producer
        .enqueue(Job::new(&work, "report", b"first".to_vec()))
        .await
        .unwrap();
    wait_for("the first job to start", T, || {
        (ran.lock().unwrap().len() == 1).then_some(())
    });
    let skip = |payload: &str, key: &str| {
        let mut j = Job::new(&work, key, payload.as_bytes().to_vec());
        j.skip_if_busy = true;
        j
    };
    enqueue_all(
        &producer,
        vec![
            skip("skipped", "report"),
            Job::new(&work, "report", b"queued".to_vec()),
            skip("skipped-too", "report"),
            skip("idle-key", "other"),
        ],
    )
    .await;
    wait_for("two jobs skipped and the idle key's run", T, || {
        let s = sys.worker.stats();
        (s.skipped == 2 && ran.lock().unwrap().contains(&"idle-key".to_string())).then_some(())
    });
    gate.notify_one();
    wait_for("the queued job to run and offsets to settle", T, || {
        let s = sys.worker.stats();
        (s.succeeded == 3 && s.open == 0).then_some(())
    });
    let mut ran = ran.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, ["first", "idle-key", "queued"]);
    assert_eq!(sys.worker.stats().skipped, 2);
    sys.stop().await;
    assert_eq!(
        crate::common::committed(&cfg.kafka.brokers, &cfg.worker.group_id, &work),
        5,
        "skipped jobs are committed like finished ones"
    );
}
