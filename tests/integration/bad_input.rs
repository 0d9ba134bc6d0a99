//! A corpus of malformed records fed through a running scheduler and worker:
//! missing and duplicated headers, garbage run-at, huge and empty payloads,
//! keys of 0 bytes and (nearly) 1 MiB, an unknown target topic. Each ends in the
//! dead-letter topic with its reason; nothing crashes; the good job written
//! after them on the same partition still runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::system::{config, run};
use crate::common::{header, read_n, wait_for, Broker};
use kairos::worker::Outcome;
use kairos::Job;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message as _;

const T: Duration = Duration::from_secs(60);

struct Bad {
    name: &'static str,
    key: Option<Vec<u8>>,
    value: Vec<u8>,
    headers: Vec<(&'static str, String)>,
    /// A fragment the dead-letter reason must contain.
    reason: &'static str,
}

fn bad(
    name: &'static str,
    key: Option<&[u8]>,
    value: &[u8],
    headers: Vec<(&'static str, String)>,
    reason: &'static str,
) -> Bad {
    Bad {
        name,
        key: key.map(<[u8]>::to_vec),
        value: value.to_vec(),
        headers,
        reason,
    }
}

async fn send(p: &FutureProducer, topic: &str, b: &Bad) -> Result<(), rdkafka::error::KafkaError> {
    let mut hs = OwnedHeaders::new();
    for (k, v) in &b.headers {
        hs = hs.insert(Header {
            key: k,
            value: Some(v),
        });
    }
    let mut rec = FutureRecord::<[u8], [u8]>::to(topic)
        .payload(&b.value)
        .headers(hs)
        .partition(0);
    if let Some(k) = &b.key {
        rec = rec.key(k);
    }
    p.send(rec, Duration::from_secs(20))
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_malformed_record_is_dead_lettered_with_its_reason_and_nothing_after_it_is_skipped() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let ran: Arc<Mutex<Vec<String>>> = Default::default();
    let r = ran.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let r = r.clone();
        async move {
            r.lock()
                .unwrap()
                .push(String::from_utf8_lossy(&job.payload).into_owned());
            Outcome::done()
        }
    });
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .set("message.max.bytes", "3000000")
        .create()
        .unwrap();
    let huge = vec![b'x'; 1_000_001];
    // A key of a full MiB does not fit Kafka's default record limit (1,048,588
    // bytes): the broker refuses it before any consumer sees it. The largest
    // key that gets through is what reaches Kairos.
    let mib_key = vec![b'k'; 1_000_000];
    let to = |t: &str| ("kairos-topic", t.to_string());
    let schedule_corpus = vec![
        bad(
            "no target topic",
            Some(b"k"),
            b"p",
            vec![("kairos-run-at", "0".into())],
            "kairos-topic` is required",
        ),
        bad(
            "duplicated header",
            Some(b"k"),
            b"p",
            vec![to(&work), to(&work)],
            "appears more than once",
        ),
        bad(
            "garbage run-at",
            Some(b"k"),
            b"p",
            vec![to(&work), ("kairos-run-at", "soonish".into())],
            "kairos-run-at",
        ),
        bad(
            "unknown header",
            Some(b"k"),
            b"p",
            vec![to(&work), ("kairos-runat", "0".into())],
            "not part of the wire contract",
        ),
        bad("empty payload", Some(b"k"), b"", vec![to(&work)], "empty payload"),
        bad(
            "huge payload",
            Some(b"k"),
            &huge,
            vec![to(&work)],
            "payload is 1000001 bytes",
        ),
        bad("key of 0 bytes", Some(b""), b"p", vec![to(&work)], "no key"),
        bad("no key at all", None, b"p", vec![to(&work)], "no key"),
        bad(
            "key of 1 MiB",
            Some(&mib_key),
            b"p",
            vec![to(&work)],
            "key is 1000000 bytes",
        ),
        bad(
            "unknown target topic",
            Some(b"k"),
            b"p",
            vec![to("no-such-topic"), ("kairos-run-at", "0".into())],
            "work topic `no-such-topic` does not exist",
        ),
    ];
    let work_corpus = vec![
        bad(
            "garbage run-at",
            Some(b"w"),
            b"p",
            vec![("kairos-run-at", "the 12th of never".into())],
            "kairos-run-at",
        ),
        bad(
            "bad attempt",
            Some(b"w"),
            b"p",
            vec![("kairos-attempt", "-1".into())],
            "kairos-attempt",
        ),
        bad(
            "cancel on a work topic",
            Some(b"w"),
            b"p",
            vec![("kairos-op", "cancel".into())],
            "only valid on the schedule topic",
        ),
        bad(
            "huge payload",
            Some(b"w"),
            &huge,
            vec![],
            "payload is 1000001 bytes",
        ),
        bad(
            "key of 1 MiB",
            Some(&mib_key),
            b"p",
            vec![],
            "key is 1000000 bytes",
        ),
    ];
    // Everything on partition 0 of each topic, then one good job behind it.
    for b in &schedule_corpus {
        send(&plain, &cfg.topics.schedule, b)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", b.name));
    }
    let good = |name: &str, topic: &str| Bad {
        name: "good",
        key: Some(b"k".to_vec()),
        value: name.as_bytes().to_vec(),
        headers: vec![("kairos-topic", topic.to_string()), ("kairos-run-at", "0".into())],
        reason: "",
    };
    send(&plain, &cfg.topics.schedule, &good("good via schedule", &work))
        .await
        .unwrap();
    for b in &work_corpus {
        send(&plain, &work, b)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", b.name));
    }
    send(&plain, &work, &good("good via work", &work)).await.unwrap();

    let expected = schedule_corpus.len() + work_corpus.len();
    let dead = read_n(&cfg.kafka.brokers, &cfg.topics.dead_letter, expected, T);
    let mut reasons: HashMap<(String, i64), String> = HashMap::new();
    for m in &dead {
        let text = |h| String::from_utf8(header(m, h).unwrap().to_vec()).unwrap();
        let origin = (
            text("kairos-origin-topic"),
            text("kairos-origin-offset").parse().unwrap(),
        );
        reasons.insert(origin, text("kairos-dead-reason"));
        assert!(
            m.payload().is_none_or(|p| p.len() <= 1_000_000),
            "dead letters fit the limits"
        );
    }
    for (topic, corpus) in [(&cfg.topics.schedule, &schedule_corpus), (&work, &work_corpus)] {
        for (offset, b) in corpus.iter().enumerate() {
            let reason = reasons
                .get(&(topic.clone(), offset as i64))
                .unwrap_or_else(|| panic!("{} on {topic} was not dead-lettered", b.name));
            assert!(
                reason.contains(b.reason),
                "{}: reason {reason:?} lacks {:?}",
                b.name,
                b.reason
            );
        }
    }
    wait_for("both good jobs to run", T, || {
        (ran.lock().unwrap().len() == 2).then_some(())
    });
    let mut ran = ran.lock().unwrap().clone();
    ran.sort();
    assert_eq!(ran, ["good via schedule", "good via work"]);
    sys.stop().await;
}
