//! The dead-letter topic for operators, against a real broker: `kairos dlq
//! list` shows every dead letter with its reason (jobs and records that
//! never were jobs), filters by reason and origin topic; `kairos dlq replay`
//! writes the dead jobs back to their work topic with their ids, keys,
//! payloads and headers, attempt 1, and a worker runs them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::system::{config, kairos_json, run};
use crate::common::{wait_for, Broker};
use kairos::dlq::{self, Filter};
use kairos::worker::Outcome;
use kairos::{Job, JobId, Producer};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _};

const T: Duration = Duration::from_secs(30);

/// What `dlq::list` finds for `filter` (read off the runtime's threads).
async fn dead_letters(cfg: &kairos::Config, filter: Filter) -> Vec<dlq::DeadEntry> {
    let cfg = cfg.clone();
    tokio::task::spawn_blocking(move || dlq::list(&cfg, &filter))
        .await
        .unwrap()
        .expect("list the dead-letter topic")
}

/// A replayed run: its attempt and its `trace-id` header.
type Ran = (u32, Option<Vec<u8>>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_jobs_are_listed_with_their_reason_and_replayed_to_their_work_topic() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();

    // Three jobs the handler refuses, one it takes, and a record that is
    // not a job at all (its attempt header does not parse).
    let producer = Producer::new(&cfg).unwrap();
    let mut dead_ids = HashSet::new();
    for i in 0..3 {
        let mut job = Job::new(&work, format!("k{i}"), format!("refuse {i}").into_bytes());
        job.headers
            .push(("trace-id".into(), Some(format!("t{i}").into_bytes())));
        dead_ids.insert(producer.enqueue(job).await.unwrap());
    }
    producer
        .enqueue(Job::new(&work, "k9", b"take".to_vec()))
        .await
        .unwrap();
    let raw: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .create()
        .unwrap();
    let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
        key: "kairos-attempt",
        value: Some("abc"),
    });
    raw.send(BaseRecord::to(&work).key("bad").payload("x").headers(headers))
        .map_err(|(e, _)| e)
        .unwrap();
    raw.flush(T).unwrap();

    let system = run(&cfg, false, |job: Job, _ctx| async move {
        if job.payload.starts_with(b"refuse") {
            Outcome::dead("refused: bad input")
        } else {
            Outcome::done()
        }
    });
    wait_for("four dead letters", T, || {
        (system.worker.stats().dead_lettered == 4).then_some(())
    });
    system.stop().await;

    // List: all four, the jobs with their ids, the other with why.
    let all = dead_letters(&cfg, Filter::default()).await;
    assert_eq!(all.len(), 4, "{all:#?}");
    let listed: HashSet<JobId> = all.iter().filter_map(|e| e.job.as_ref().map(|j| j.id)).collect();
    assert_eq!(listed, dead_ids);
    let not_job: Vec<_> = all.iter().filter(|e| e.job.is_none()).collect();
    assert_eq!(not_job.len(), 1);
    assert!(
        not_job[0]
            .not_a_job
            .as_deref()
            .unwrap()
            .contains("kairos-attempt"),
        "{not_job:?}"
    );
    assert!(all.iter().all(|e| e.origin_topic == work));
    let refused = Filter {
        reason: Some("bad input".into()),
        ..Filter::default()
    };
    let only = dead_letters(&cfg, refused).await;
    assert_eq!(only.len(), 3);
    let elsewhere = Filter {
        origin_topic: Some("some.other.topic".into()),
        ..Filter::default()
    };
    let none = dead_letters(&cfg, elsewhere).await;
    assert!(none.is_empty());

    // The command line says the same, as JSON.
    let listed = kairos_json(&cfg, dir.path(), &["dlq", "list", "--json"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(4), "{listed}");

    // Replay everything: the three jobs go back; the record that never was
    // a job stays where it is.
    let mut seen_progress = 0;
    let report = dlq::replay(&cfg, &Filter::default(), false, |done, _| seen_progress = done)
        .await
        .unwrap();
    assert_eq!((report.matched, report.replayed, report.not_jobs), (4, 3, 1));
    assert_eq!(seen_progress, 3);
    assert!(
        report.since_last_replay && report.earlier_not_read == 0,
        "{report:?}"
    );

    // The same group reads on from where it stopped: only the replays.
    let ran: Arc<Mutex<HashMap<JobId, Ran>>> = Arc::default();
    let seen = ran.clone();
    let system = run(&cfg, false, move |job: Job, _ctx| {
        let trace = job
            .headers
            .iter()
            .find(|(k, _)| k == "trace-id")
            .and_then(|(_, v)| v.clone());
        seen.lock().unwrap().insert(job.id, (job.attempt, trace));
        async { Outcome::done() }
    });
    wait_for("the three replays to run", T, || {
        (system.worker.stats().succeeded == 3).then_some(())
    });
    system.stop().await;
    {
        let ran = ran.lock().unwrap();
        assert_eq!(ran.keys().copied().collect::<HashSet<_>>(), dead_ids);
        for (attempt, trace) in ran.values() {
            assert_eq!(*attempt, 1, "attempt reset");
            assert!(
                trace.as_deref().is_some_and(|t| t.starts_with(b"t")),
                "headers kept"
            );
        }
    }

    // What a second replay does: without a filter, nothing (everything was
    // replayed); by job id, that job again; `again`, all of them again.
    let written = || crate::common::record_count(&cfg.kafka.brokers, &work);
    let before = written();
    let second = dlq::replay(&cfg, &Filter::default(), false, |_, _| {})
        .await
        .unwrap();
    assert_eq!((second.matched, second.replayed), (0, 0), "{second:?}");
    assert_eq!(second.earlier_not_read, 4, "{second:?}");
    let one = dead_ids.iter().next().unwrap().to_string();
    let by_id = Filter {
        job_ids: vec![one.clone()],
        ..Filter::default()
    };
    let picked = dlq::replay(&cfg, &by_id, false, |_, _| {}).await.unwrap();
    assert_eq!((picked.matched, picked.replayed), (1, 1), "{picked:?}");
    assert!(!picked.since_last_replay);
    let future = Filter {
        since_ms: Some(chrono::Utc::now().timestamp_millis() + 60_000),
        ..Filter::default()
    };
    let none = dlq::replay(&cfg, &future, false, |_, _| {}).await.unwrap();
    assert_eq!(none.matched, 0, "dead letters are not from the future: {none:?}");
    let again = dlq::replay(&cfg, &Filter::default(), true, |_, _| {})
        .await
        .unwrap();
    assert_eq!((again.matched, again.replayed), (4, 3), "{again:?}");
    assert_eq!(written() - before, 4, "one job by id, then the three again");
    // The command line's report says what a second replay does.
    let out = crate::common::system::kairos_text(&cfg, dir.path(), &["dlq", "replay"]);
    assert!(
        out.contains("0 jobs replayed") && out.contains("a second replay replays only what dies from now on"),
        "{out}"
    );

    // The newest dead letters, read from the ends: at most 2 per partition.
    let cfg2 = cfg.clone();
    let newest = tokio::task::spawn_blocking(move || dlq::newest(&cfg2, 2))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(newest.total, 4);
    assert_eq!(newest.entries.len(), 2, "{newest:?}");
    assert!(
        newest.read <= 2 * cfg.topics.dead_letter_partitions as usize,
        "read {} records for the newest 2",
        newest.read
    );
    let all = dead_letters(&cfg, Filter::default()).await;
    let mut times: Vec<i64> = all.iter().filter_map(|e| e.dead_at_ms).collect();
    times.sort_unstable();
    assert!(
        newest.entries.iter().all(|e| e.dead_at_ms >= Some(times[2])),
        "the two newest: {newest:?}"
    );
    assert!(newest
        .entries
        .iter()
        .all(|e| e.job.as_ref().is_none_or(|j| j.payload.is_empty())));
}
