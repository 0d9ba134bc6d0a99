//! The README's main command against Apache Kafka: `kairos --brokers HOST
//! demo` runs the scheduler, a worker, a fair topic, a held key and a
//! worker in exactly-once mode on a real cluster (without `--brokers` it uses the in-process development broker),
//! and what it saw keeps the guarantees it prints. It works in topics and
//! groups of its own: a job waiting in the configured topics is not
//! touched, and the demo's topics are gone afterwards.

use std::time::Duration;

use crate::common::{wait_for, Broker, ChildGuard};

/// What `kairos demo --json` prints last (the fields checked here).
#[derive(Debug, serde::Deserialize)]
struct Summary {
    written: usize,
    done: usize,
    dead: usize,
    retries: usize,
    early: usize,
    overlaps: usize,
    out_of_order: usize,
    cancelled: usize,
    changes_ignored: usize,
    fair_waits: std::collections::BTreeMap<String, (usize, i64, i64)>,
    held_key: Vec<u32>,
    exactly_once: ExactlyOnce,
    recurring: Recurring,
    topics: Vec<String>,
}

/// The summary's recurring part.
#[derive(Debug, serde::Deserialize)]
struct Recurring {
    occurrences: usize,
    once: usize,
    extra: usize,
    listed: bool,
    skipped: u64,
}

/// The summary's exactly-once part.
#[derive(Debug, serde::Deserialize)]
struct ExactlyOnce {
    jobs: usize,
    once: usize,
    extra: usize,
    transactions: u64,
    held_key: Vec<u32>,
    parked: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_on_kafka_and_its_summary_keeps_the_guarantees() {
    let broker = Broker::shared();
    // Topics of the test's own; the demo adds its fair and held topics.
    let cfg = broker.config();
    // A job waiting in the configured topics, as another Kairos on the
    // cluster would have it: the demo must not fire it.
    kairos::topics::init(&cfg).await.unwrap();
    let theirs = &cfg.topics.work[0].clone();
    let producer = kairos::Producer::new(&cfg).unwrap();
    let due = chrono::Utc::now() + chrono::Duration::seconds(1);
    producer
        .enqueue(kairos::Job::new(theirs, "theirs", b"x".to_vec()).at(due))
        .await
        .unwrap();
    // The command a newcomer runs, on this cluster, its summary as JSON.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kairos.toml");
    std::fs::write(&file, toml::to_string(&cfg).unwrap()).unwrap();
    let out_path = dir.path().join("demo.out");
    let mut child = ChildGuard(
        std::process::Command::new(env!("CARGO_BIN_EXE_kairos"))
            .arg("--config")
            .arg(&file)
            .args(["--brokers", &broker.bootstrap()])
            .args([
                "demo",
                "--jobs",
                "120",
                "--keys",
                "12",
                "--max-delay",
                "4s",
                "--json",
            ])
            .stdout(std::fs::File::create(&out_path).unwrap())
            .spawn()
            .expect("kairos demo starts"),
    );
    let status = wait_for("the demo to end", Duration::from_secs(300), || {
        child.try_wait().expect("the demo's status")
    });
    let out = std::fs::read_to_string(&out_path).unwrap();
    assert!(status.success(), "the demo failed ({status}):\n{out}");
    let last = out.lines().last().expect("the demo printed its summary");
    let s: Summary = serde_json::from_str(last).expect("the summary as JSON");
    assert_eq!(s.written, 120);
    assert_eq!(s.done + s.dead, s.written - s.cancelled, "every job ended: {s:?}");
    assert!(
        s.dead > 0 && s.retries > 0,
        "some jobs failed and were retried: {s:?}"
    );
    assert_eq!(
        (s.early, s.overlaps, s.out_of_order, s.changes_ignored),
        (0, 0, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.held_key, vec![1, 2, 2, 2, 3, 4, 5], "the held key's starts");
    let e = &s.exactly_once;
    assert!(
        e.jobs > 0 && e.once == e.jobs && e.extra == 0 && e.transactions > 0,
        "each exactly-once job's follow-up read back once, in transactions: {e:?}"
    );
    assert_eq!(
        (e.held_key.as_slice(), e.parked > 0),
        ([7, 7, 17, 27, 37, 47].as_slice(), true),
        "in exactly-once mode too, the held key's jobs waited, parked, and ran in order: {e:?}"
    );
    let r = &s.recurring;
    assert!(
        r.occurrences > 0 && r.once == r.occurrences && r.extra == 0 && r.listed,
        "each occurrence of the recurring schedule fired once, and /schedules listed its last: {r:?}"
    );
    // Each occurrence's job takes 2.5 s and they come 1 s apart: the
    // second comes while the first runs, and is skipped (overlap = skip).
    assert!(
        r.skipped >= 1,
        "an occurrence skipped while the one before ran: {r:?}"
    );
    assert!(
        s.fair_waits.len() >= 2,
        "both tenants' jobs started: {:?}",
        s.fair_waits
    );
    assert_eq!(
        crate::common::record_count(&broker.bootstrap(), theirs),
        0,
        "the job in the configured topics was fired"
    );
    assert!(
        s.topics.len() >= 6 && s.topics.iter().all(|t| t.starts_with("kairos-demo-")),
        "the demo's own topics: {:?}",
        s.topics
    );
    let existing = topics_on(&broker.bootstrap());
    let left: Vec<&String> = s.topics.iter().filter(|t| existing.contains(*t)).collect();
    assert!(left.is_empty(), "the demo left its topics behind: {left:?}");
}

/// The topics the cluster has.
fn topics_on(brokers: &str) -> Vec<String> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("client");
    let md = c
        .fetch_metadata(None, std::time::Duration::from_secs(10))
        .expect("metadata");
    md.topics().iter().map(|t| t.name().to_string()).collect()
}
