//! The README's main command against Apache Kafka: `kairos --brokers HOST
//! demo` runs the scheduler, a worker, a fair topic and a held key on a real
//! cluster (without `--brokers` it uses the in-process development broker),
//! and what it saw keeps the guarantees it prints. It works in topics and
//! groups of its own: a job waiting in the configured topics is not
//! touched, and the demo's topics are gone afterwards.

use crate::common::Broker;

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
    let opts = kairos::demo::DemoOptions {
        jobs: 120,
        keys: 12,
        max_delay: std::time::Duration::from_secs(4),
    };
    let s = kairos::demo::run(cfg, opts, Some(broker.bootstrap()))
        .await
        .expect("the demo ran");
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
