//! The wire contract and producer API against a real broker: jobs written
//! through `Producer` and through a plain Kafka producer that sets only the
//! documented headers decode to identical jobs; malformed records give the
//! right typed errors; `topics init` is safe to run twice.

use std::time::Duration;

use crate::common::{read_exactly, Broker};
use chrono::{TimeZone, Utc};
use kairos::clock::ManualClock;
use kairos::topics::{self, TopicOutcome};
use kairos::wire::{self, Command, Context, DecodeError, HeaderProblem, Limits, RecordView};
use kairos::{Job, JobId, ProduceError, Producer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{ClientConfig, Message as _};

const T: Duration = Duration::from_secs(20);

fn decode(m: &OwnedMessage, ctx: Context) -> Result<Command, DecodeError> {
    let view = RecordView::from_message(m);
    wire::decode(&view, ctx, &Limits::default())
}

fn decode_job(m: &OwnedMessage, ctx: Context) -> Job {
    match decode(m, ctx) {
        Ok(Command::Schedule(job)) => job,
        other => panic!("expected a job, got {other:?}"),
    }
}

async fn setup() -> (&'static Broker, kairos::Config) {
    let broker = Broker::shared();
    let cfg = broker.config();
    topics::init(&cfg).await.expect("topics init");
    (broker, cfg)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_init_is_safe_to_run_twice() {
    let broker = Broker::shared();
    let cfg = broker.config();
    let first = topics::init(&cfg).await.expect("first init");
    assert_eq!(first.len(), 7);
    assert!(
        first.iter().all(|r| r.outcome == TopicOutcome::Created),
        "{first:?}"
    );
    let second = topics::init(&cfg).await.expect("second init");
    assert!(
        second.iter().all(|r| r.outcome == TopicOutcome::AlreadyExists),
        "{second:?}"
    );
    let names: Vec<_> = second.iter().map(|r| r.name.clone()).collect();
    assert_eq!(
        names,
        vec![
            cfg.topics.schedule.clone(),
            cfg.topics.changelog.clone(),
            cfg.topics.dead_letter.clone(),
            cfg.topics.schedules.clone(),
            cfg.topics.schedule_cursors.clone(),
            cfg.topics.held.clone(),
            cfg.topics.work[0].clone()
        ]
    );
    // The partition counts Kairos relies on are really there.
    let p = kairos::kafka::producer(&cfg.kafka, "t").unwrap();
    for (topic, n) in [
        (&cfg.topics.schedule, 3),
        (&cfg.topics.changelog, 3),
        (&cfg.topics.dead_letter, 1),
        (&cfg.topics.schedules, 3),
        (&cfg.topics.schedule_cursors, 3),
        (&cfg.topics.held, 3),
        (&cfg.topics.work[0], 3),
    ] {
        assert_eq!(
            kairos::kafka::partition_count(&p, topic, T).await.unwrap(),
            n,
            "{topic}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_init_refuses_a_changelog_with_other_partitions() {
    let broker = Broker::shared();
    let mut cfg = broker.config();
    topics::init(&cfg).await.unwrap();
    // Same topic names, but now asking for more schedule partitions: the
    // topics exist with 3, so the check must still pass; then make a
    // mismatch by pointing the changelog at the 1-partition dead-letter topic.
    cfg.topics.schedule_partitions = 5;
    topics::init(&cfg).await.expect("existing topics are left alone");
    cfg.topics.changelog = cfg.topics.dead_letter.clone();
    let err = topics::check_partitions(&cfg).await.unwrap_err();
    assert!(
        matches!(err, topics::TopicsError::PartitionMismatch { .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_routes_due_jobs_to_work_and_future_jobs_to_schedule() {
    let (_broker, cfg) = setup().await;
    let now = Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap();
    let clock = ManualClock::new(now);
    let inner = kairos::kafka::producer(&cfg.kafka, "test").unwrap();
    let producer = Producer::from_parts(inner, &cfg, std::sync::Arc::new(clock.clone())).unwrap();
    let work = cfg.topics.work[0].clone();

    let due = Job::new(&work, "user-1", b"now".to_vec())
        .at(now)
        .tenant("acme")
        .max_attempts(4)
        .header("trace", "t-1");
    let due_id = producer.enqueue(due.clone()).await.unwrap();
    assert_eq!(due_id, due.id);

    let later = Job::new(&work, "user-1", b"later".to_vec());
    let later_id = producer
        .enqueue(later.clone())
        .after(Duration::from_secs(90))
        .await
        .unwrap();
    let far = Job::new(&work, "user-2", b"far".to_vec());
    let far_at = Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap();
    producer.enqueue(far.clone()).at(far_at).await.unwrap();

    let got = read_exactly(&cfg.kafka.brokers, &work, 1, T);
    assert_eq!(decode_job(&got[0], Context::Work), due);
    assert_eq!(got[0].key(), Some(&b"user-1"[..]));

    let mut scheduled: Vec<Job> = read_exactly(&cfg.kafka.brokers, &cfg.topics.schedule, 2, T)
        .iter()
        .map(|m| decode_job(m, Context::Schedule))
        .collect();
    scheduled.sort_by_key(|j| j.run_at);
    let later_expected = Job {
        run_at: now + chrono::Duration::seconds(90),
        ..later
    };
    assert_eq!(scheduled[0], later_expected);
    assert_eq!(scheduled[0].id, later_id);
    assert_eq!(
        scheduled[1],
        Job {
            run_at: far_at,
            ..far
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_kafka_producer_with_documented_headers_makes_identical_jobs() {
    let (_broker, cfg) = setup().await;
    let work = cfg.topics.work[0].clone();
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    let id: JobId = "0190a5f2-7b6c-7d2e-9f00-123456789abc".parse().unwrap();
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "kairos-id",
            value: Some(&id.to_string()),
        })
        .insert(Header {
            key: "kairos-run-at",
            value: Some("1893456000000"),
        })
        .insert(Header {
            key: "kairos-topic",
            value: Some(&work),
        })
        .insert(Header {
            key: "kairos-tenant",
            value: Some("acme"),
        })
        .insert(Header {
            key: "kairos-max-attempts",
            value: Some("3"),
        })
        .insert(Header {
            key: "app-header",
            value: Some("kept"),
        });
    plain
        .send(
            FutureRecord::to(&cfg.topics.schedule)
                .key("user-9")
                .payload("from another client")
                .headers(headers),
            Timeout::After(T),
        )
        .await
        .unwrap();
    // The same job through the Rust API.
    let producer = Producer::new(&cfg).unwrap();
    let mut rust_job = Job::new(&work, "user-9", b"from another client".to_vec())
        .id(id)
        .tenant("acme")
        .max_attempts(3)
        .header("app-header", "kept");
    rust_job.run_at = Utc.timestamp_millis_opt(1_893_456_000_000).unwrap();
    producer.enqueue(rust_job.clone()).await.unwrap();

    let got = read_exactly(&cfg.kafka.brokers, &cfg.topics.schedule, 2, T);
    let jobs: Vec<Job> = got.iter().map(|m| decode_job(m, Context::Schedule)).collect();
    assert_eq!(jobs[0], rust_job);
    assert_eq!(jobs[1], rust_job);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_with_no_headers_is_a_job_with_a_stable_id() {
    let (_broker, cfg) = setup().await;
    let work = cfg.topics.work[0].clone();
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    plain
        .send(FutureRecord::to(&work).key("k").payload("p"), Timeout::After(T))
        .await
        .unwrap();
    let first = decode_job(&read_exactly(&cfg.kafka.brokers, &work, 1, T)[0], Context::Work);
    let again = decode_job(&read_exactly(&cfg.kafka.brokers, &work, 1, T)[0], Context::Work);
    assert_eq!(
        first, again,
        "re-reading a record gives the same job, id included"
    );
    assert_eq!(first.topic, work);
    assert_eq!(first.attempt, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_yield_typed_errors() {
    let (_broker, cfg) = setup().await;
    let topic = cfg.topics.schedule.clone();
    let plain: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    type Case = (
        Option<&'static str>,
        &'static str,
        Vec<(&'static str, &'static str)>,
        DecodeError,
    );
    let work = cfg.topics.work[0].clone();
    let cases: Vec<Case> = vec![
        (
            Some("k"),
            "p",
            vec![("kairos-topic", "jobs"), ("kairos-run-at", "next tuesday")],
            DecodeError::BadHeader {
                name: "kairos-run-at",
                problem: HeaderProblem::BadTime("next tuesday".into()),
            },
        ),
        (
            Some("k"),
            "p",
            vec![("kairos-topic", "jobs"), ("kairos-attempt", "-3")],
            DecodeError::BadHeader {
                name: "kairos-attempt",
                problem: HeaderProblem::TooSmall { value: -3, min: 1 },
            },
        ),
        (
            Some("k"),
            "p",
            vec![("kairos-topic", "a"), ("kairos-topic", "b")],
            DecodeError::DuplicateHeader("kairos-topic"),
        ),
        (
            Some("k"),
            "p",
            vec![("kairos-topic", "jobs"), ("kairos-version", "7")],
            DecodeError::UnknownVersion("7".into()),
        ),
        (None, "p", vec![("kairos-topic", "jobs")], DecodeError::MissingKey),
        (
            Some("k"),
            "",
            vec![("kairos-topic", "jobs")],
            DecodeError::EmptyPayload,
        ),
        (
            Some("k"),
            "p",
            vec![("kairos-run-at", "0")],
            DecodeError::MissingHeader {
                name: "kairos-topic",
                context: "on the schedule topic (where should the job fire?)",
            },
        ),
    ];
    for (key, payload, headers, _) in &cases {
        let mut hs = OwnedHeaders::new();
        for (k, v) in headers {
            let v = if *v == "jobs" { work.as_str() } else { v };
            hs = hs.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        let mut rec = FutureRecord::<str, str>::to(&topic).payload(*payload).headers(hs);
        if let Some(k) = key {
            rec = rec.key(*k);
        }
        // Keep the cases in one partition so they come back in order.
        plain.send(rec.partition(0), Timeout::After(T)).await.unwrap();
    }
    let got = read_exactly(&cfg.kafka.brokers, &topic, cases.len(), T);
    for (m, (_, _, _, expected)) in got.iter().zip(&cases) {
        assert_eq!(decode(m, Context::Schedule).unwrap_err(), *expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_reschedule_reach_every_schedule_partition() {
    let (_broker, cfg) = setup().await;
    let producer = Producer::new(&cfg).unwrap();
    let id = JobId::new();
    producer.cancel(id).await.unwrap();
    let at = Utc.with_ymd_and_hms(2031, 6, 1, 12, 0, 0).unwrap();
    producer.reschedule(id, at).await.unwrap();
    let got = read_exactly(&cfg.kafka.brokers, &cfg.topics.schedule, 6, T);
    let mut partitions: Vec<(i32, Command)> = got
        .iter()
        .map(|m| (m.partition(), decode(m, Context::Schedule).unwrap()))
        .collect();
    partitions.sort_by_key(|(p, c)| (*p, matches!(c, Command::Reschedule { .. })));
    let expected: Vec<(i32, Command)> = (0..3)
        .flat_map(|p| {
            [
                (p, Command::Cancel(id)),
                (p, Command::Reschedule { id, run_at: at }),
            ]
        })
        .collect();
    assert_eq!(partitions, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_refuses_jobs_a_consumer_would_dead_letter() {
    let (_broker, cfg) = setup().await;
    let producer = Producer::new(&cfg).unwrap();
    let work = cfg.topics.work[0].clone();
    let err = producer
        .enqueue(Job::new(&work, "", b"p".to_vec()))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ProduceError::InvalidJob {
                reason: DecodeError::MissingKey,
                ..
            }
        ),
        "{err}"
    );
    let err = producer
        .enqueue(Job::new(&work, "k", Vec::new()))
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        ProduceError::InvalidJob {
            reason: DecodeError::EmptyPayload,
            ..
        }
    ));
    let err = producer
        .enqueue(Job::new(&work, "k", b"p".to_vec()).header("kairos-runat", "0"))
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        ProduceError::InvalidJob {
            reason: DecodeError::UnknownHeader(_),
            ..
        }
    ));
    let err = producer
        .enqueue(Job::new("no-such-topic", "k", b"p".to_vec()))
        .after(Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ProduceError::UnknownTopic { ref topic } if topic == "no-such-topic"),
        "{err}"
    );
    assert!(err.is_permanent());
    assert_eq!(crate::common::record_count(&cfg.kafka.brokers, &work), 0);
    assert_eq!(
        crate::common::record_count(&cfg.kafka.brokers, &cfg.topics.schedule),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_enqueues_of_one_key_reach_the_work_topic_in_call_order() {
    let (_broker, cfg) = setup().await;
    let work = cfg.topics.work[0].clone();
    // A fresh producer: its topic check has nothing cached, so every write
    // below waits for the first look-up; they must still go out in order.
    let producer = Producer::new(&cfg).unwrap();
    let jobs: Vec<Job> = (0..50)
        .map(|i| Job::new(&work, "one-key", format!("{i}").into_bytes()))
        .collect();
    let writes = jobs
        .iter()
        .map(|j| std::future::IntoFuture::into_future(producer.enqueue(j.clone())));
    for r in futures::future::join_all(writes).await {
        r.unwrap();
    }
    let got: Vec<JobId> = read_exactly(&cfg.kafka.brokers, &work, 50, T)
        .iter()
        .map(|m| decode_job(m, Context::Work).id)
        .collect();
    assert_eq!(got, jobs.iter().map(|j| j.id).collect::<Vec<_>>());
}
