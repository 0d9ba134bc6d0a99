//! A scheduler fenced out of its group joins again with a new consumer and
//! keeps firing. A static member whose session timed out (its broker
//! stalled or restarted) rejoins as itself, and a request still carrying its
//! old membership is refused with `FencedInstanceId`, which librdkafka makes
//! fatal for the client. The test produces the same refusal on demand: a
//! second consumer joins once under the scheduler's instance id.

use std::time::Duration;

use crate::common::{read_n, wait_for, Broker};
use kairos::scheduler::Scheduler;
use kairos::{Job, Producer};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_fenced_out_of_its_group_joins_again_and_keeps_firing() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = crate::common::system::config(broker, dir.path());
    cfg.scheduler.static_membership = true;
    cfg.scheduler.instance_id = "fenced-once".into();
    kairos::topics::init(&cfg).await.unwrap();
    let s = Scheduler::builder(&cfg).build().expect("scheduler");
    let handle = s.handle();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(s.run_until(async {
        let _ = stopped.await;
    }));
    wait_for("the scheduler to own its partitions", T, || {
        (handle.stats().owned.len() == 3).then_some(())
    });

    // A twin joins under the scheduler's instance id: the group fences the
    // scheduler's membership.
    let twin: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &cfg.kafka.brokers)
        .set("group.id", &cfg.scheduler.group_id)
        .set("group.instance.id", "fenced-once")
        .set("session.timeout.ms", "6000")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .create()
        .expect("twin");
    twin.subscribe(&[&cfg.topics.schedule]).expect("subscribe");
    // The scheduler is fenced once the twin holds the partitions, or once
    // the scheduler, joining again as itself, has fenced the twin in turn.
    wait_for("the scheduler to be fenced out", T, || {
        twin.poll(Duration::from_millis(50));
        let twin_assigned = twin.assignment().is_ok_and(|a| a.count() > 0);
        let twin_fenced = twin.client().fatal_error().is_some();
        let fenced = handle.stats().owned.is_empty() || twin_assigned || twin_fenced;
        (fenced || task.is_finished()).then_some(())
    });
    drop(twin);
    assert!(!task.is_finished(), "the scheduler stopped on being fenced");

    // It joins again as itself and fires a job written now.
    wait_for("the scheduler to own its partitions again", T, || {
        (handle.stats().owned.len() == 3).then_some(())
    });
    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let id = producer
        .enqueue(Job::new(&work, "k", b"after the fence".to_vec()))
        // Ahead of now, so that it goes through the scheduler (a job due
        // now is written straight to its work topic).
        .at(chrono::Utc::now() + chrono::Duration::seconds(1))
        .await
        .unwrap();
    let fired = read_n(&cfg.kafka.brokers, &work, 1, T);
    assert_eq!(super::scheduler::job_of(&fired[0]).id, id);
    let _ = stop.send(());
    task.await
        .unwrap()
        .expect("the scheduler ran on and stopped cleanly");
}
