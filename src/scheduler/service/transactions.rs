//! Exactly-once mode (`scheduler.exactly_once`): every Kafka write of the
//! scheduler goes into a transaction of two transactional producers taken in
//! turn (see [`Thread::run`]), owned
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
use std::time::{Duration, Instant};

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::producer::future_producer::Delivery;
use tracing::{debug, warn};

use super::SchedulerError;
use crate::kafka::{self, Transactional, TxnError};
use crate::sync::Lock;
use crate::wire::OwnedRecord;
use fence::Fence;
use unapplied::Unapplied;
pub(super) use unapplied::{Applying, Pending};

mod fence;
mod unapplied;

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
    /// The schedule partitions the submission wrote for that this instance
    /// does not own now (let go, or lost with its group membership): no
    /// transaction commits for them, so the writer leaves them to their
    /// next owner instead of writing again.
    pub(super) not_owned: Vec<i32>,
}

/// The answer to a submission.
pub(super) type Outcome = Result<Committed, NotCommitted>;

/// A submission's records, committed.
pub(super) struct Committed {
    /// Each record's acknowledgement, in order.
    pub(super) acks: Vec<Delivery>,
    /// Its changelog records, not yet applied to the store.
    pub(super) pending: Pending,
}

/// The coming answer to a submission.
pub(super) struct Answer(tokio::sync::oneshot::Receiver<Outcome>);

impl Answer {
    /// Wait for it (the finisher's task).
    pub(super) async fn wait(self) -> Outcome {
        self.0.await.unwrap_or_else(|_| Err(NotCommitted::gone()))
    }

    /// Wait for it, blocking the thread (the apply lanes).
    pub(super) fn wait_blocking(self) -> Outcome {
        self.0
            .blocking_recv()
            .unwrap_or_else(|_| Err(NotCommitted::gone()))
    }
}

impl NotCommitted {
    /// The transaction thread ended (the scheduler is stopping).
    fn gone() -> NotCommitted {
        NotCommitted {
            fatal: true,
            reason: "the transaction thread is gone".into(),
            not_owned: Vec::new(),
        }
    }
}

/// Records to write in one transaction (pinned to a partition, or placed by key).
struct Submission {
    records: Vec<(OwnedRecord, Option<i32>)>,
    reply: tokio::sync::oneshot::Sender<Outcome>,
}

/// The scheduler's transactional writes (see the module doc).
pub(super) struct Transactions {
    inbox: Sender<Submission>,
    fence: Arc<Mutex<Fence>>,
    unapplied: Arc<Mutex<Unapplied>>,
}

impl Transactions {
    /// Create the producers (`transactional_id`, and the same with `-b`),
    /// initialise their transactions (fencing earlier producers with the
    /// same ids and aborting what they left open) and start the thread.
    /// Blocks.
    pub(super) fn start(
        cfg: &crate::config::Config,
        transactional_id: &str,
    ) -> Result<Transactions, SchedulerError> {
        let open = |id: String| {
            Transactional::new(
                &cfg.kafka,
                "kairos-scheduler-txn",
                &id,
                cfg.scheduler.transaction_timeout,
            )
            .map_err(|e| SchedulerError::Fatal(format!("transactions of {id}: {e}")))
        };
        let producers = [
            open(transactional_id.to_string())?,
            open(format!("{transactional_id}-b"))?,
        ];
        let (inbox, rx) = std::sync::mpsc::channel();
        let fence = Arc::new(Mutex::new(Fence::default()));
        let unapplied = Arc::new(Mutex::new(Unapplied::default()));
        let thread = Thread {
            producers,
            fence: fence.clone(),
            unapplied: unapplied.clone(),
            schedule: cfg.topics.schedule.clone(),
            changelog: cfg.topics.changelog.clone(),
            pinned: [cfg.topics.changelog.clone(), cfg.topics.schedule_cursors.clone()],
        };
        std::thread::Builder::new()
            .name("kairos-txn".into())
            .spawn(move || thread.run(&rx))
            .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
        Ok(Transactions {
            inbox,
            fence,
            unapplied,
        })
    }

    /// Hand `records` over for the next transaction; the answer comes once
    /// it has committed or aborted.
    pub(super) fn submit(&self, records: Vec<(OwnedRecord, Option<i32>)>) -> Answer {
        let (reply, answer) = tokio::sync::oneshot::channel();
        // A send that fails drops `reply`: the answer says the thread is gone.
        let _ = self.inbox.send(Submission { records, reply });
        Answer(answer)
    }

    /// The ingest consumer's current group generation, at a rebalance.
    pub(super) fn set_group(&self, group: Option<ConsumerGroupMetadata>) {
        self.fence.locked().set_group(group);
    }

    /// The ingest consumer's current group generation, as ingest polls:
    /// taken only while the instance is a member (after a lost assignment
    /// the consumer rejoins, and its metadata names no member until the
    /// next assignment).
    pub(super) fn refresh_group(&self, group: Option<ConsumerGroupMetadata>) {
        self.fence.locked().refresh_group(group);
    }

    /// The assignment was lost (the group session expired): `parts` may be
    /// another member's already, and nothing more commits for them, nor
    /// with this membership.
    pub(super) fn lost(&self, parts: &[i32]) {
        self.fence.locked().lost(parts);
    }

    /// Partition `p` is owned, read from `next` on.
    pub(super) fn assigned(&self, p: i32, next: i64) {
        self.fence.locked().assigned(p, next);
    }

    /// Partition `p`'s records below `next` are handled (stored for commit).
    pub(super) fn stored(&self, p: i32, next: i64) {
        self.fence.locked().stored(p, next);
    }

    /// Partitions `parts` are no longer owned.
    pub(super) fn revoked(&self, parts: &[i32]) {
        self.fence.locked().revoked(parts);
    }
}

/// What the transaction thread owns.
struct Thread {
    producers: [Transactional; 2],
    fence: Arc<Mutex<Fence>>,
    unapplied: Arc<Mutex<Unapplied>>,
    schedule: String,
    changelog: String,
    /// The topics whose records are pinned to a schedule partition's
    /// number (the changelog and the cursors).
    pinned: [String; 2],
}

impl Thread {
    /// One transaction per turn, of every submission waiting, on the two
    /// producers in turn. A producer's transaction is completed by its
    /// coordinator (markers written) after its commit returns; until then
    /// the same producer's next one is refused a while (librdkafka asks
    /// again 20 ms later). The other producer's does not wait, and a
    /// transaction still begins only once the one before it committed, so
    /// records keep the order they were submitted in.
    fn run(mut self, rx: &Receiver<Submission>) {
        let mut broken: Option<String> = None;
        let mut turn = 0usize;
        while let Ok(first) = rx.recv() {
            turn += 1;
            let which = turn % 2;
            let mut subs = vec![first];
            let mut records = subs[0].records.len();
            while records < MOST_RECORDS {
                let Ok(s) = rx.try_recv() else { break };
                records += s.records.len();
                subs.push(s);
            }
            if let Some(reason) = &broken {
                let why = NotCommitted {
                    fatal: true,
                    reason: reason.clone(),
                    not_owned: Vec::new(),
                };
                answer(subs, &why);
                continue;
            }
            // Checked again when the offsets are added: the partitions may
            // be lost while the records are written.
            let (subs, needed) = self.refuse_not_owned(subs);
            if subs.is_empty() {
                continue;
            }
            let mut not_owned = Vec::new();
            let fenced = Fenced {
                fence: &self.fence,
                topic: &self.schedule,
                needed: &needed,
            };
            match round(&self.producers[which], &subs, &fenced, &mut not_owned) {
                Ok(acks) => {
                    for (s, a) in subs.into_iter().zip(acks) {
                        let committed = self.note_unapplied(&s.records, a);
                        let _ = s.reply.send(Ok(committed));
                    }
                }
                Err(e) => {
                    let mut fatal = matches!(e, TxnError::Fatal(_) | TxnError::InDoubt(_));
                    let reason = e.to_string();
                    // Fenced after the coordinator timed a transaction out
                    // (a broker lost meanwhile), before any commit: a new
                    // producer goes on and the writers do their work again,
                    // as after an abort. A commit in doubt stops.
                    if matches!(e, TxnError::InDoubt(_)) {
                        broken = Some(reason.clone());
                    } else if fatal {
                        warn!(error = %reason, "transactional producer failed for good; making it anew");
                        match self.producers[which].renew() {
                            Ok(()) => fatal = false,
                            Err(again) => broken = Some(format!("{reason}; making it anew: {again}")),
                        }
                    }
                    answer(
                        subs,
                        &NotCommitted {
                            fatal,
                            reason,
                            not_owned,
                        },
                    );
                }
            }
        }
    }

    /// The submissions that may go into a transaction now, and the
    /// partitions they write for ([`fence::written_for`]); the others
    /// (writing for a partition not owned, see [`Fence::missing`]) are
    /// answered at once, nothing of them written.
    fn refuse_not_owned(&self, subs: Vec<Submission>) -> (Vec<Submission>, Vec<i32>) {
        let f = self.fence.locked();
        let mut ok = Vec::with_capacity(subs.len());
        let mut needed = Vec::new();
        for s in subs {
            let parts = fence::written_for(&s.records, &self.pinned);
            let not_owned = f.missing(&parts);
            if not_owned.is_empty() {
                needed.extend(parts);
                ok.push(s);
                continue;
            }
            debug!(partitions = ?not_owned, "records for partitions not owned refused");
            let _ = s.reply.send(Err(NotCommitted {
                fatal: false,
                reason: format!("schedule partitions {not_owned:?} are not owned here now"),
                not_owned,
            }));
        }
        needed.sort_unstable();
        needed.dedup();
        (ok, needed)
    }

    /// Note a committed submission's changelog records as not yet applied
    /// (before its writer hears of the commit).
    fn note_unapplied(&self, records: &[(OwnedRecord, Option<i32>)], acks: Vec<Delivery>) -> Committed {
        let pending = unapplied::note(&self.unapplied, &self.changelog, records, &acks);
        Committed { acks, pending }
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
    fenced: &Fenced<'_>,
    not_owned: &mut Vec<i32>,
) -> Result<Vec<Vec<Delivery>>, TxnError> {
    let started = Instant::now();
    let mut took = [Duration::ZERO; 3];
    producer.begin()?;
    let written = write(producer, subs).and_then(|acks| {
        took[0] = started.elapsed();
        commit_offsets(producer, fenced, not_owned)?;
        took[1] = started.elapsed();
        producer.commit()?;
        took[2] = started.elapsed();
        Ok(acks)
    });
    match written {
        Ok(acks) => {
            let records: usize = subs.iter().map(|s| s.records.len()).sum();
            debug!(
                submissions = subs.len(),
                records,
                written_ms = took[0].as_millis() as u64,
                offsets_ms = (took[1] - took[0]).as_millis() as u64,
                commit_ms = (took[2] - took[1]).as_millis() as u64,
                "transaction committed"
            );
            Ok(acks)
        }
        Err(e @ (TxnError::Fatal(_) | TxnError::InDoubt(_))) => Err(e),
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

/// What a transaction's offsets come from.
struct Fenced<'a> {
    fence: &'a Mutex<Fence>,
    /// The schedule topic.
    topic: &'a str,
    /// The partitions the transaction's records write for.
    needed: &'a [i32],
}

/// Add the owned partitions' offsets to the transaction, with the group
/// generation they were read in (see [`Fence::to_send`]); abortable, with
/// `not_owned` set, when a partition its records write for is no longer
/// owned (lost or let go since the submissions were let in): without its
/// offset the transaction would commit unfenced.
fn commit_offsets(
    producer: &Transactional,
    fenced: &Fenced<'_>,
    not_owned: &mut Vec<i32>,
) -> Result<(), TxnError> {
    let to_send = {
        let f = fenced.fence.locked();
        *not_owned = f.missing(fenced.needed);
        if !not_owned.is_empty() {
            return Err(TxnError::Abortable(rdkafka::error::KafkaError::Canceled));
        }
        f.to_send(fenced.topic).map_err(TxnError::Abortable)?
    };
    match to_send {
        Some((tpl, group)) => producer.send_offsets(&tpl, &group),
        None => Ok(()),
    }
}

/// How long [`Transactions`]' writers back off after an abort.
pub(super) const AFTER_ABORT: Duration = Duration::from_millis(200);
