//! Exactly-once mode (`scheduler.exactly_once`): every Kafka write of the
//! scheduler goes into a transaction of one transactional producer, owned
//! by a thread of its own (`kairos-txn`), whose blocking calls stay off the
//! async runtime.
//!
//! Writers (the apply lanes' persists, the finisher's fire rounds) hand
//! their records over as a [`Submission`], in the order they decided them
//! (under the changelog order lock), and wait for its answer. The thread
//! takes every submission waiting, begins a transaction, writes their
//! records in submission order, adds the consumer group's schedule offsets,
//! and commits. Every writer then learns the same outcome: all of its
//! records committed, or none (aborted: the writer does its work again).
//!
//! The offsets make a zombie harmless (KIP-447): they commit only with the
//! group generation the ingest consumer is in, so a scheduler the group
//! moved on from (paused past its session, cut off) cannot commit a fire
//! or a put any more. Each transaction names every partition owned, at the
//! offset last stored for it, so even a round with nothing new to commit
//! is checked.

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::producer::future_producer::Delivery;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{debug, warn};

use super::SchedulerError;
use crate::hash::HashMap;
use crate::kafka::{self, Transactional, TxnError};
use crate::sync::Lock;
use crate::wire::OwnedRecord;

/// Most records one transaction takes from the submissions waiting (a
/// submission is never split).
const MOST_RECORDS: usize = 50_000;

/// Why a submission's records were not committed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{reason}")]
pub(super) struct NotCommitted {
    /// The producer cannot go on: the scheduler must stop.
    pub(super) fatal: bool,
    /// What happened.
    pub(super) reason: String,
}

/// The answer to a submission: each record's acknowledgement, in order.
pub(super) type Outcome = Result<Vec<Delivery>, NotCommitted>;

/// Records to write in one transaction (pinned to a partition, or placed by key).
struct Submission {
    records: Vec<(OwnedRecord, Option<i32>)>,
    reply: tokio::sync::oneshot::Sender<Outcome>,
}

/// What the commit of offsets needs, kept up to date by ingest.
#[derive(Default)]
struct Fence {
    /// The ingest consumer's group generation (taken anew at every rebalance).
    group: Option<Arc<ConsumerGroupMetadata>>,
    /// Per owned partition, the next schedule offset to read once
    /// everything stored is committed.
    offsets: HashMap<i32, i64>,
}

/// The scheduler's transactional writes (see the module doc).
pub(super) struct Transactions {
    inbox: Mutex<Sender<Submission>>,
    fence: Arc<Mutex<Fence>>,
}

impl Transactions {
    /// Create the producer (`transactional_id`), initialise its
    /// transactions (fencing an earlier producer with the same id and
    /// aborting what it left open) and start the thread. Blocks.
    pub(super) fn start(
        cfg: &crate::config::Config,
        transactional_id: &str,
    ) -> Result<Transactions, SchedulerError> {
        let producer = Transactional::new(
            &cfg.kafka,
            "kairos-scheduler-txn",
            transactional_id,
            cfg.scheduler.transaction_timeout,
        )
        .map_err(|e| SchedulerError::Fatal(format!("transactions of {transactional_id}: {e}")))?;
        let (inbox, rx) = std::sync::mpsc::channel();
        let fence = Arc::new(Mutex::new(Fence::default()));
        let (f, t) = (fence.clone(), cfg.topics.schedule.clone());
        std::thread::Builder::new()
            .name("kairos-txn".into())
            .spawn(move || run(&producer, &rx, &f, &t))
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        Ok(Transactions {
            inbox: Mutex::new(inbox),
            fence,
        })
    }

    /// Hand `records` over for the next transaction; the answer comes once
    /// it has committed or aborted.
    pub(super) fn submit(
        &self,
        records: Vec<(OwnedRecord, Option<i32>)>,
    ) -> tokio::sync::oneshot::Receiver<Outcome> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if let Err(e) = self.inbox.locked().send(Submission { records, reply }) {
            let _ = e.0.reply.send(Err(NotCommitted {
                fatal: true,
                reason: "the transaction thread is gone".into(),
            }));
        }
        answer
    }

    /// The ingest consumer's current group generation.
    pub(super) fn set_group(&self, group: Option<ConsumerGroupMetadata>) {
        self.fence.locked().group = group.map(Arc::new);
    }

    /// Partition `p` is owned, read from `next` on.
    pub(super) fn assigned(&self, p: i32, next: i64) {
        self.fence.locked().offsets.insert(p, next);
    }

    /// Partition `p`'s records below `next` are handled (stored for commit).
    pub(super) fn stored(&self, p: i32, next: i64) {
        if let Some(o) = self.fence.locked().offsets.get_mut(&p) {
            *o = (*o).max(next);
        }
    }

    /// Partitions `parts` are no longer owned.
    pub(super) fn revoked(&self, parts: &[i32]) {
        let f = &mut *self.fence.locked();
        for p in parts {
            f.offsets.remove(p);
        }
    }
}

/// The thread: one transaction per turn, of every submission waiting.
fn run(producer: &Transactional, rx: &Receiver<Submission>, fence: &Mutex<Fence>, topic: &str) {
    let mut broken: Option<String> = None;
    while let Ok(first) = rx.recv() {
        let mut subs = vec![first];
        let mut records = subs[0].records.len();
        while records < MOST_RECORDS {
            let Ok(s) = rx.try_recv() else { break };
            records += s.records.len();
            subs.push(s);
        }
        if let Some(reason) = &broken {
            answer(
                subs,
                &NotCommitted {
                    fatal: true,
                    reason: reason.clone(),
                },
            );
            continue;
        }
        match round(producer, &subs, fence, topic) {
            Ok(acks) => {
                for (s, a) in subs.into_iter().zip(acks) {
                    let _ = s.reply.send(Ok(a));
                }
            }
            Err(e) => {
                let fatal = matches!(e, TxnError::Fatal(_));
                let reason = e.to_string();
                if fatal {
                    broken = Some(reason.clone());
                }
                answer(subs, &NotCommitted { fatal, reason });
            }
        }
    }
}

fn answer(subs: Vec<Submission>, why: &NotCommitted) {
    for s in subs {
        let _ = s.reply.send(Err(why.clone()));
    }
}

/// One transaction: begin, write, add the offsets, commit; on any failure,
/// abort (an abort that fails is fatal).
fn round(
    producer: &Transactional,
    subs: &[Submission],
    fence: &Mutex<Fence>,
    topic: &str,
) -> Result<Vec<Vec<Delivery>>, TxnError> {
    producer.begin()?;
    let written = write(producer, subs).and_then(|acks| {
        commit_offsets(producer, fence, topic)?;
        producer.commit()?;
        Ok(acks)
    });
    match written {
        Ok(acks) => {
            debug!(submissions = subs.len(), "transaction committed");
            Ok(acks)
        }
        Err(TxnError::Fatal(e)) => Err(TxnError::Fatal(e)),
        Err(e) => {
            warn!(error = %e, "transaction aborted; its writers do their work again");
            producer.abort()?;
            Err(e)
        }
    }
}

/// Write every submission's records in order and wait for their acknowledgements.
fn write(producer: &Transactional, subs: &[Submission]) -> Result<Vec<Vec<Delivery>>, TxnError> {
    let p = producer.producer();
    let pending: Vec<Vec<_>> = subs
        .iter()
        .map(|s| {
            let recs: Vec<(&OwnedRecord, Option<i32>)> = s.records.iter().map(|(r, p)| (r, *p)).collect();
            futures::executor::block_on(kafka::enqueue_all(p, &recs))
        })
        .collect();
    let mut out = Vec::with_capacity(subs.len());
    let mut failed = None;
    for acks in pending {
        let results = futures::executor::block_on(futures::future::join_all(acks));
        let mut delivered = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(d) => delivered.push(d),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        out.push(delivered);
    }
    match failed {
        Some(e) => Err(TxnError::Abortable(e)),
        None => Ok(out),
    }
}

/// Add the owned partitions' offsets to the transaction, with the group
/// generation they were read in. Nothing owned (or no generation yet):
/// nothing to add.
fn commit_offsets(producer: &Transactional, fence: &Mutex<Fence>, topic: &str) -> Result<(), TxnError> {
    let (tpl, group) = {
        let f = fence.locked();
        let Some(group) = f.group.clone() else {
            return Ok(());
        };
        let mut tpl = TopicPartitionList::new();
        for (p, next) in &f.offsets {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*next))
                .map_err(TxnError::Abortable)?;
        }
        (tpl, group)
    };
    if tpl.count() == 0 {
        return Ok(());
    }
    producer.send_offsets(&tpl, &group)
}

/// How long [`Transactions`]' writers back off after an abort.
pub(super) const AFTER_ABORT: Duration = Duration::from_millis(200);
