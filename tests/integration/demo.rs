//! The README's main command against Apache Kafka: `kairos --brokers HOST
//! demo` runs the scheduler, a worker, a fair topic and a held key on a real
//! cluster (without `--brokers` it uses the in-process development broker),
//! and what it saw keeps the guarantees it prints.

use crate::common::Broker;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_on_kafka_and_its_summary_keeps_the_guarantees() {
    let broker = Broker::shared();
    // Topics of the test's own; the demo adds its fair and held topics.
    let cfg = broker.config();
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
}
