//! The admin endpoints of a running scheduler and worker, over real HTTP on
//! 127.0.0.1: `/metrics` counts what the services did (checked against
//! their own counters and the jobs written), `/status` says the same as
//! JSON, `/healthz` and `/readyz` answer; and a token, when set, is required.
//! `kairos stats` shows each topic's records and its consumer group's lag,
//! and the jobs the scheduler holds by when they come due; `kairos job ID`
//! finds a pending job.

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crate::common::system::{config, enqueue_all, kairos_json};
use crate::common::{wait_for, Broker};
use chrono::Utc;
use kairos::admin::{Admin, Metrics, Source};
use kairos::config::AdminConfig;
use kairos::scheduler::Scheduler;
use kairos::worker::Outcome;
use kairos::{Job, Producer, Worker};
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(30);

/// `GET path` with an optional bearer token: (status, body).
fn get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    kairos::admin::get(addr, path, token).expect("GET from the admin endpoint")
}

/// The value of the sample `name` (a whole line's first field) in metrics text.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
}

fn local() -> AdminConfig {
    AdminConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        token: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_and_the_worker_report_their_work_on_their_admin_endpoints() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.scheduler.admin = local();
    cfg.worker.admin = local();
    // A fair topic (no jobs on it), so that the fair-dispatch metrics the
    // dashboard queries are served.
    let fair = format!("{}.fair", cfg.topics.work[0]);
    cfg.topics.work.push(fair.clone());
    cfg.fair.topics = vec![fair];
    kairos::topics::init(&cfg).await.unwrap();
    let stop = CancellationToken::new();
    let scheduler = Scheduler::builder(&cfg).build().unwrap();
    let s_addr = scheduler.admin_addr().expect("scheduler endpoint bound");
    let s_handle = scheduler.handle();
    // Keys `retry-*` fail their first attempt (retried through the
    // scheduler), keys `dead-*` die at once; the rest succeed.
    let worker = Worker::builder(&cfg)
        .build(|job: Job, _ctx| async move {
            if job.key.starts_with(b"dead-") {
                Outcome::dead("told to die")
            } else if job.key.starts_with(b"retry-") && job.attempt == 1 {
                Outcome::retry("first attempt fails")
            } else {
                Outcome::done()
            }
        })
        .unwrap();
    let w_addr = worker.admin_addr().expect("worker endpoint bound");
    let w_handle = worker.handle();
    let st = stop.clone();
    let s_task = tokio::spawn(scheduler.run_until(async move { st.cancelled().await }));
    let st = stop.clone();
    let w_task = tokio::spawn(worker.run_until(async move { st.cancelled().await }));

    for addr in [s_addr, w_addr] {
        wait_for("the endpoint to be ready", T, || {
            (get(addr, "/readyz", None) == (200, "ready\n".into())).then_some(())
        });
        assert_eq!(get(addr, "/healthz", None), (200, "ok\n".into()));
        assert_eq!(get(addr, "/nothing-here", None).0, 404);
    }
    // 30 jobs through the scheduler (due in 3 s: beyond the producer's
    // early tolerance, so they are not written straight to work), 10 now.
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let at = Utc::now() + chrono::Duration::seconds(3);
    // Of the 40, 4 are retried once and 3 die.
    let key = |i: usize| match i {
        0..4 => format!("retry-{i}"),
        4..7 => format!("dead-{i}"),
        _ => format!("k{}", i % 7),
    };
    let jobs: Vec<Job> = (0..40)
        .map(|i| {
            let job = Job::new(&work, key(i), b"x".to_vec());
            if i < 30 {
                job.at(at)
            } else {
                job
            }
        })
        .collect();
    // Written at once, so none of the delayed ones comes within the early
    // tolerance by the time it is written.
    enqueue_all(&producer, jobs).await;
    wait_for("37 jobs done, 3 dead", T, || {
        let s = w_handle.stats();
        (s.succeeded == 37 && s.dead_lettered == 3).then_some(())
    });
    // A fire is counted once its batch is tombstoned, just after the worker
    // may have run it. The 4 retries go through the scheduler too.
    wait_for("the scheduler to count 34 fires, 0 pending", T, || {
        let s = s_handle.stats();
        (s.fired == 34 && s.pending == 0).then_some(())
    });

    let (code, text) = get(s_addr, "/metrics", None);
    assert_eq!(code, 200);
    let fired = s_handle.stats().fired;
    assert_eq!(
        fired, 34,
        "the scheduler fired the 30 future jobs and the 4 retries"
    );
    assert_eq!(sample(&text, "kairos_scheduler_fired_total"), fired as f64);
    assert_eq!(
        sample(&text, "kairos_scheduler_fire_lateness_seconds_count"),
        fired as f64
    );
    assert_eq!(sample(&text, "kairos_scheduler_partitions_owned"), 3.0);
    assert_eq!(
        sample(&text, "kairos_scheduler_pending_jobs{partition=\"0\"}"),
        0.0
    );
    assert!(sample(&text, "kairos_scheduler_ingested_total") >= 30.0);
    assert!(sample(&text, "kairos_scheduler_catch_up_seconds_count") >= 1.0);
    assert!(sample(&text, "kairos_scheduler_rebalances_total{kind=\"assigned\"}") >= 1.0);
    assert!(sample(&text, "kairos_scheduler_store_bytes") > 0.0);
    let (code, status) = get(s_addr, "/status", None);
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&status).expect("/status is JSON");
    assert_eq!(status["role"], "scheduler");
    assert_eq!(status["stats"]["fired"], fired);
    assert_eq!(status["partitions"].as_array().map(Vec::len), Some(3));

    let (code, text) = get(w_addr, "/metrics", None);
    assert_eq!(code, 200);
    assert_eq!(sample(&text, "kairos_worker_succeeded_total"), 37.0);
    assert_eq!(sample(&text, "kairos_worker_retried_total"), 4.0);
    assert_eq!(sample(&text, "kairos_worker_dead_lettered_total"), 3.0);
    assert_eq!(
        sample(&text, "kairos_worker_started_total"),
        44.0,
        "40 jobs and 4 retries"
    );
    assert_eq!(
        sample(&text, "kairos_worker_started_total"),
        w_handle.stats().started as f64
    );
    assert_eq!(
        sample(&text, "kairos_worker_start_delay_seconds_count"),
        w_handle.stats().started as f64
    );
    assert_eq!(
        sample(&text, "kairos_worker_job_duration_seconds_count"),
        w_handle.stats().started as f64
    );
    let by_topic = |outcome: &str| {
        sample(
            &text,
            &format!("kairos_worker_topic_jobs_total{{topic=\"{work}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(by_topic("succeeded"), 37.0);
    assert_eq!(by_topic("started"), 44.0);
    assert_eq!(by_topic("retried"), 4.0);
    assert_eq!(by_topic("dead_lettered"), 3.0);
    assert!(sample(&text, "kairos_worker_rebalances_total{kind=\"assigned\"}") >= 1.0);
    assert_eq!(
        sample(&text, "kairos_worker_uncommitted_records"),
        0.0,
        "every job read is finished"
    );
    assert_eq!(sample(&text, "kairos_worker_running_jobs"), 0.0);
    let (_, status) = get(w_addr, "/status", None);
    let status: serde_json::Value = serde_json::from_str(&status).expect("/status is JSON");
    assert_eq!(status["role"], "worker");
    assert_eq!(status["stats"]["succeeded"], 37);

    // kairos stats asks both endpoints: nothing held or running now.
    let mut file_cfg = cfg.clone();
    file_cfg.scheduler.admin.listen = Some(s_addr);
    file_cfg.worker.admin.listen = Some(w_addr);
    let shown = kairos_json(&file_cfg, dir.path(), &["stats", "--json"]);
    assert_eq!(shown["scheduler"]["pending"], 0, "{shown}");
    assert_eq!(
        shown["workers"]["asked"],
        serde_json::json!([w_addr.to_string()]),
        "{shown}"
    );
    assert_eq!(shown["workers"]["open"], 0, "{shown}");
    assert_eq!(shown["workers"]["running_by_topic"][work.as_str()], 0, "{shown}");
    let by_topic = &status["by_topic"][0];
    assert_eq!(
        (&by_topic["topic"], &by_topic["started"]),
        (&serde_json::json!(work), &serde_json::json!(44))
    );

    // Every metric the shipped Grafana dashboard queries is served (the
    // schedule lag once measured, every 5 s).
    wait_for("the schedule lag measured", T, || {
        get(s_addr, "/metrics", None)
            .1
            .contains("kairos_scheduler_schedule_lag_records{")
            .then_some(())
    });
    let served = get(s_addr, "/metrics", None).1 + &get(w_addr, "/metrics", None).1;
    let dashboard =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/grafana/kairos.json")).unwrap();
    let dashboard: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the Grafana dashboard is JSON");
    let mut queried = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for name in expr
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("kairos_"))
            {
                queried += 1;
                assert!(
                    served.contains(name),
                    "the dashboard queries {name}, which is not served"
                );
            }
        }
    }
    assert!(queried >= 10, "{queried} metrics queried");

    stop.cancel();
    s_task.await.unwrap().expect("scheduler ran cleanly");
    w_task.await.unwrap().expect("worker ran cleanly");
    assert!(
        TcpStream::connect(s_addr).is_err(),
        "the endpoint stops with its service"
    );
}

/// A stand-in service (the auth check does not depend on what is served).
struct Stub;

impl Source for Stub {
    fn metrics(&self) -> Metrics {
        let mut m = Metrics::default();
        m.counter("kairos_stub_calls", "Calls.", 1);
        m
    }
    fn status(&self) -> serde_json::Value {
        serde_json::json!({"role": "stub"})
    }
    fn ready(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_token_set_a_request_without_it_is_refused() {
    let cfg = AdminConfig {
        token: Some("s3cret".into()),
        ..local()
    };
    let admin = Admin::bind(&cfg).unwrap().expect("listen is set");
    let addr = admin.local_addr();
    let stop = CancellationToken::new();
    let served = admin.serve(Arc::new(Stub), stop.clone());
    for path in ["/metrics", "/status", "/healthz", "/readyz"] {
        let (code, body) = tokio::task::spawn_blocking(move || get(addr, path, None))
            .await
            .unwrap();
        assert_eq!(code, 401, "{path} without a token");
        assert!(
            !body.contains("kairos_stub") && !body.contains("stub"),
            "{path} leaked: {body}"
        );
        let (code, _) = tokio::task::spawn_blocking(move || get(addr, path, Some("wrong")))
            .await
            .unwrap();
        assert_eq!(code, 401, "{path} with a wrong token");
        let (code, _) = tokio::task::spawn_blocking(move || get(addr, path, Some("s3cret")))
            .await
            .unwrap();
        assert_eq!(code, 200, "{path} with the token");
    }
    let (_, text) = tokio::task::spawn_blocking(move || get(addr, "/metrics", Some("s3cret")))
        .await
        .unwrap();
    assert!(text.contains("kairos_stub_calls_total 1\n"), "{text}");
    stop.cancel();
    served.await.unwrap();
}

#[test]
fn an_endpoint_bound_beyond_loopback_needs_a_token() {
    let mut cfg = kairos::Config::default();
    cfg.scheduler.admin.listen = Some("0.0.0.0:9464".parse().unwrap());
    let err = cfg.validate().expect_err("no token");
    assert!(err.to_string().contains("scheduler.admin.token"), "{err}");
    cfg.scheduler.admin.token = Some("t".into());
    cfg.validate().expect("with a token");
    cfg.worker.admin.listen = Some("[::]:9465".parse().unwrap());
    let err = cfg.validate().expect_err("the worker's has none");
    assert!(err.to_string().contains("worker.admin.token"), "{err}");
    cfg.worker.admin.listen = Some("[::1]:9465".parse().unwrap());
    cfg.validate().expect("loopback needs none");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kairos_stats_shows_each_topics_records_and_its_groups_lag() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    for i in 0..12 {
        producer
            .enqueue(Job::new(&work, format!("k{i}"), b"x".to_vec()))
            .await
            .unwrap();
    }
    let figures = |cfg: &kairos::Config| {
        let cfg = cfg.clone();
        move || kairos::overview::topics(&cfg).unwrap()
    };
    // No worker yet: all 12 wait.
    let shown = kairos_json(&cfg, dir.path(), &["stats", "--json"]);
    assert!(
        shown["scheduler"]["asked"].as_array().unwrap().is_empty(),
        "no endpoint configured: {shown}"
    );
    let by_role = |role: &str| {
        shown["topics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["role"] == role)
            .unwrap_or_else(|| panic!("no {role} topic in {shown}"))
            .clone()
    };
    assert_eq!(by_role("work")["records"], 12);
    assert_eq!(by_role("work")["lag"], 12);
    assert_eq!(by_role("work")["group"], cfg.worker.group_id.as_str());
    assert_eq!(by_role("schedule")["records"], 0);
    assert_eq!(by_role("dead-letter")["records"], 0);
    assert!(by_role("dead-letter")["lag"].is_null());
    // A worker runs them; the lag drops to 0 once its offsets are committed.
    let system = crate::common::system::run(&cfg, false, |_job: Job, _ctx| async { Outcome::done() });
    wait_for("12 jobs done", T, || {
        (system.worker.stats().succeeded == 12).then_some(())
    });
    let read = figures(&cfg);
    wait_for("the work topic's lag to reach 0", T, || {
        let f = read();
        let w = f.iter().find(|t| t.role == "work").unwrap();
        (w.lag == Some(0) && w.records == 12).then_some(())
    });
    system.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kairos_stats_counts_the_jobs_held_by_when_they_come_due_and_kairos_job_finds_one() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.scheduler.admin = local();
    kairos::topics::init(&cfg).await.unwrap();
    let stop = CancellationToken::new();
    let scheduler = Scheduler::builder(&cfg).build().unwrap();
    let addr = scheduler.admin_addr().expect("endpoint bound");
    let handle = scheduler.handle();
    let st = stop.clone();
    let task = tokio::spawn(scheduler.run_until(async move { st.cancelled().await }));
    // No worker: 5 jobs within a minute, 7 within an hour, 3 within a day,
    // 2 in a month; none comes due during the test, so nothing fires.
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let now = Utc::now();
    let spans = [(45, 5), (1_800, 7), (40_000, 3), (30 * 86_400, 2)];
    let mut jobs = Vec::new();
    for (secs, n) in spans {
        for i in 0..n {
            jobs.push(
                Job::new(&work, format!("k{secs}-{i}"), b"x".to_vec())
                    .at(now + chrono::Duration::seconds(secs)),
            );
        }
    }
    let tenant_job = Job::new(&work, "acct-9", b"hello".to_vec())
        .at(now + chrono::Duration::seconds(1_800))
        .tenant("acme");
    let id = tenant_job.id.to_string();
    jobs.push(tenant_job);
    enqueue_all(&producer, jobs).await;
    wait_for("18 jobs pending", T, || {
        (handle.stats().pending == 18).then_some(())
    });

    let mut file_cfg = cfg.clone();
    file_cfg.scheduler.admin.listen = Some(addr);
    let shown = kairos_json(&file_cfg, dir.path(), &["stats", "--json"]);
    let held = &shown["scheduler"];
    assert_eq!(held["asked"], serde_json::json!([addr.to_string()]), "{shown}");
    assert_eq!(held["pending"], 18, "{shown}");
    let due = |span: &str| {
        held["pending_by_due"][span]
            .as_u64()
            .unwrap_or_else(|| panic!("{span}: {shown}"))
    };
    // Near jobs count exactly; a far job counts at its store bucket's start,
    // which may lie in an earlier span (the 30-minute ones before the
    // minute is out), never a later one.
    assert_eq!(due("now"), 0, "{shown}");
    assert!(due("1m") >= 5, "{shown}");
    assert_eq!(due("1m") + due("1h"), 13, "{shown}");
    assert_eq!((due("1d"), due("later")), (3, 2), "{shown}");
    // Per topic, every job read: exact (the two topics of this test).
    let shown = kairos_json(&file_cfg, dir.path(), &["stats", "--json", "--by-topic"]);
    let per = &shown["scheduler"]["by_topic"];
    assert_eq!(per[work.as_str()]["1m"], 5, "{shown}");
    assert_eq!(per[work.as_str()]["1h"], 8, "{shown}");
    assert_eq!(per[work.as_str()]["1d"], 3, "{shown}");
    assert_eq!(per[work.as_str()]["later"], 2, "{shown}");
    let (_, text) = get(addr, "/metrics", None);
    let metric = |span: &str| {
        sample(
            &text,
            &format!("kairos_scheduler_pending_due_jobs{{due=\"{span}\"}}"),
        )
    };
    assert_eq!(metric("1m") + metric("1h"), 13.0);
    assert_eq!(metric("later"), 2.0);

    let job = kairos_json(&file_cfg, dir.path(), &["job", &id, "--json"]);
    assert_eq!(job["id"], id.as_str());
    assert_eq!(job["key"], "acct-9");
    assert_eq!(job["tenant"], "acme");
    assert_eq!(job["topic"], work.as_str());
    assert_eq!(job["attempt"], 1);
    assert_eq!(job["payload_bytes"], 5);
    let missing = kairos::JobId::new().to_string();
    let (code, _) = get(addr, &format!("/jobs/{missing}"), None);
    assert_eq!(code, 404);
    let (code, body) = get(addr, "/jobs/not-an-id", None);
    assert_eq!(code, 400, "{body}");
    let err = kairos::overview::find_job(&file_cfg, &[addr], &missing).expect("asked");
    assert!(err.is_none());
    stop.cancel();
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_shows_the_runs_going_on_and_the_records_a_crash_would_repeat() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.worker.admin = local();
    kairos::topics::init(&cfg).await.unwrap();
    // Three jobs of three keys hold their runs until let go.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let worker = Worker::builder(&cfg)
        .build(move |_job: Job, _ctx| {
            let g = g.clone();
            async move {
                let _permit = g.acquire().await.expect("gate open");
                Outcome::done()
            }
        })
        .unwrap();
    let addr = worker.admin_addr().expect("endpoint bound");
    let handle = worker.handle();
    let stop = CancellationToken::new();
    let st = stop.clone();
    let task = tokio::spawn(worker.run_until(async move { st.cancelled().await }));
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let jobs = (0..3)
        .map(|i| Job::new(&work, format!("held-{i}"), b"x".to_vec()))
        .collect();
    enqueue_all(&producer, jobs).await;
    wait_for("3 runs going on", T, || {
        let (_, text) = get(addr, "/metrics", None);
        (sample(&text, "kairos_worker_running_jobs") == 3.0).then_some(text)
    });
    let (_, text) = get(addr, "/metrics", None);
    assert_eq!(sample(&text, "kairos_worker_open_jobs"), 3.0);
    assert!(
        sample(&text, "kairos_worker_uncommitted_records") >= 3.0,
        "{text}"
    );
    gate.add_permits(3);
    wait_for("3 jobs done", T, || (handle.stats().succeeded == 3).then_some(()));
    let (_, text) = get(addr, "/metrics", None);
    assert_eq!(sample(&text, "kairos_worker_running_jobs"), 0.0);
    stop.cancel();
    task.await.unwrap().unwrap();
}
