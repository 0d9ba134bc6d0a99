//! A fire batch: due jobs handed to librdkafka in order by the dispatcher
//! ([`start_fire`]), their writes then awaited by the finisher.

use std::sync::Arc;

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use super::Shared;
use crate::hash::{HashMap, HashSet};
use crate::kafka;
use crate::scheduler::store::DueKey;
use crate::scheduler::stored::StoredJob;

/// Due jobs handed to librdkafka, waiting for the finisher.
pub(super) struct FireBatch {
    pub(super) due: Vec<(DueKey, StoredJob)>,
    /// Which of `due` are direct jobs (not in the store, nor the
    /// changelog), with when each entered the window.
    pub(super) direct: HashMap<DueKey, i64>,
    pub(super) writes: FireWrites,
    /// The partitions of `due`, each counted once in the fire rounds in flight ([`super::jobs::SchedulerJobs`]).
    pub(super) parts: HashSet<i32>,
    /// Its room in the finisher's queue, given back once it is finished.
    pub(super) room: tokio::sync::OwnedSemaphorePermit,
}

/// The writes of a fire batch, one per job, in firing order.
pub(super) type FireWrites = Vec<FireWrite>;

/// A due job's work-topic write.
pub(super) enum FireWrite {
    /// Handed to librdkafka (or failed at once): its acknowledgement.
    Sent(
        std::pin::Pin<
            Box<
                dyn std::future::Future<
                        Output = Result<rdkafka::producer::future_producer::Delivery, KafkaError>,
                    > + Send,
            >,
        >,
    ),
    /// Exactly once: the finisher writes it, in its round's transaction.
    InTransaction,
}

/// Hand a batch of due jobs to librdkafka, in order (in exactly-once mode,
/// leave them to the finisher's transaction). Jobs for work topics that do
/// not exist are not written (librdkafka would only time out on them):
/// their write fails at once and [`finish_fire`](super::finish::finish_fire) dead-letters them.
pub(super) async fn start_fire(shared: &Arc<Shared>, due: &[(DueKey, StoredJob)]) -> FireWrites {
    // Whether each work topic is missing, asked once per batch. Jobs in a row
    // mostly share a topic: the answer for the last one is kept at hand.
    let mut missing: HashMap<&str, Result<bool, KafkaError>> = HashMap::default();
    let mut last: Option<(&str, Result<bool, KafkaError>)> = None;
    let mut writes: FireWrites = Vec::with_capacity(due.len());
    for (_, s) in due {
        let topic = s.job.topic.as_str();
        let state = match &last {
            Some((t, m)) if *t == topic => m,
            _ => {
                let m = match missing.get(topic) {
                    Some(m) => m.clone(),
                    None => {
                        let m = shared.kafka.topic_check.exists(topic).await.map(|e| !e);
                        missing.insert(topic, m.clone());
                        m
                    }
                };
                &last.insert((topic, m)).1
            }
        };
        match state {
            Ok(true) => {
                let e = KafkaError::MessageProduction(RDKafkaErrorCode::UnknownTopicOrPartition);
                writes.push(FireWrite::Sent(Box::pin(async move { Err(e) })));
            }
            Ok(false) if shared.kafka.txn.is_some() => writes.push(FireWrite::InTransaction),
            Ok(false) => {
                writes.push(FireWrite::Sent(Box::pin(
                    kafka::enqueue_job(&shared.kafka.producer, &s.job).await,
                )));
            }
            Err(e) => {
                let e = e.clone();
                writes.push(FireWrite::Sent(Box::pin(async move { Err(e) })));
            }
        }
    }
    writes
}
