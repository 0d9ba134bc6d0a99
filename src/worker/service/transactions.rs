//! Exactly-once settlement (`worker.exactly_once`): a job's writes are
//! staged in memory ([`WorkerJobs::stage`]) and reach Kafka in the
//! transaction that commits its partition's offset past it, together with
//! the writes of every other job below the commit points of the round.
//! A job whose offset can still be read again (above the commit point)
//! has written nothing; once its offset is committed, all of its writes
//! are. (On partitions whose keys can be held, a finished job's writes
//! commit at the next round, with the partition's progress naming its
//! offset done: see `held_round`.) A worker the group moved on from (paused past its session, cut
//! off) cannot commit: the offsets go with the group generation it read
//! them in (KIP-447).
//!
//! A thread of its own (`kairos-worker-txn`) commits a round every
//! `[worker] commit_interval` (what the worker commits at in
//! at-least-once mode too), or to hear from the group coordinator when nothing
//! moved (see [`super::touch`]); a partition's release commits its last
//! round on the poll thread. Both hold the commit order lock, so rounds
//! never overlap.
//!
//! [`WorkerJobs::stage`]: super::jobs::WorkerJobs::stage

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::TopicPartitionList;
use tracing::{debug, warn};

use super::offsets::offset_to_commit;
use super::round::Round;
use super::{Shared, WorkerError};

use crate::kafka::{self, Transactional, TxnError};
use crate::sync::Lock;
use crate::wire::OwnedRecord;
use crate::worker::settle::{Origin, Stage};

mod refused;

/// The worker's transactional producer.
pub(super) struct WorkerTxn {
    producer: Mutex<Transactional>,
}

impl WorkerTxn {
    /// The producer of `[worker] transactional_id` (or one generated),
    /// its transactions initialised: what an earlier worker with the same
    /// id left open is aborted. Blocks.
    pub(super) fn open(shared: &Shared) -> Result<WorkerTxn, WorkerError> {
        let w = &shared.cfg.worker;
        let id = if w.transactional_id.trim().is_empty() {
            format!("kairos-worker-{}-{:016x}", w.group_id, rand::random::<u64>())
        } else {
            w.transactional_id.clone()
        };
        let producer = Transactional::new(&shared.cfg.kafka, "kairos-worker-txn", &id, w.transaction_timeout)
            .map_err(|e| WorkerError::Fatal(format!("transactions of {id}: {e}")))?;
        debug!(transactional_id = %id, "worker transactions ready");
        Ok(WorkerTxn {
            producer: Mutex::new(producer),
        })
    }

    /// Commit `round` in one transaction: its records, then its offsets
    /// with `consumer`'s group generation. [`TxnError::Abortable`]: it did
    /// not commit (aborted: nothing of it is read by read_committed
    /// consumers; a producer that failed for good on the way, fenced after
    /// the coordinator timed the transaction out while a broker was lost,
    /// is made anew); do the round again. [`TxnError::InDoubt`], or
    /// [`TxnError::Fatal`] when no new producer could be made: stop.
    ///
    /// A job a record of which Kafka refuses for good (too large for its
    /// topic, not authorised) would abort every round: such jobs are found
    /// ([`refused`]), their writes in `round` replaced by their dead
    /// letters, and the round is tried again.
    pub(super) fn commit<C: ConsumerContext>(
        &self,
        shared: &Shared,
        consumer: &BaseConsumer<C>,
        round: &mut Round,
    ) -> Result<(), TxnError> {
        let mut producer = self.producer.locked();
        let mut tries = 0;
        loop {
            let mut suspects = Vec::new();
            let e = match attempt(shared, consumer, &producer, round, &mut suspects) {
                Ok(()) => return Ok(()),
                Err(TxnError::InDoubt(e)) => return Err(TxnError::InDoubt(e)),
                Err(TxnError::Abortable(e)) => {
                    warn!(error = %e, partitions = round.points.len(), records = round.record_count(),
                        "worker transaction aborted");
                    abort(&mut producer)?;
                    e
                }
                Err(TxnError::Fatal(e)) => {
                    warn!(error = %e, "worker transaction failed for good before its commit; making the producer anew");
                    producer.renew()?;
                    e
                }
            };
            shared.stats.transactions_aborted.fetch_add(1, Ordering::Relaxed);
            tries += 1;
            if suspects.is_empty()
                || tries > REFUSED_TRIES
                || refused::dead_letter(shared, &mut producer, round, suspects)? == 0
            {
                return Err(TxnError::Abortable(e));
            }
        }
    }
}

/// How many times in a row one commit replaces refused writes and tries
/// again (each refusal found is dealt with; the next round goes on).
const REFUSED_TRIES: u32 = 3;

/// One try at committing `round`; the jobs (indices in `round.records`) a
/// record of which Kafka refused for good go to `suspects`.
fn attempt<C: ConsumerContext>(
    shared: &Shared,
    consumer: &BaseConsumer<C>,
    producer: &Transactional,
    round: &Round,
    suspects: &mut Vec<usize>,
) -> Result<(), TxnError> {
    let started = Instant::now();
    let hang = |step| {
        if round.record_count() > 0 {
            hang_at(step);
        }
    };
    hang(Step::Before);
    producer.begin()?;
    write_jobs(producer, round, 0..round.records.len(), suspects)?;
    write_pinned(producer, &round.pinned)?;
    hang(Step::Inside);
    let mut tpl = TopicPartitionList::new();
    for point in &round.points {
        offset_to_commit(shared, &mut tpl, *point);
    }
    if tpl.count() > 0 {
        // librdkafka marks the assignment lost (a session expired, the
        // member fenced) before the poll thread hears of it; the group
        // metadata may then name no member and no generation, which the
        // broker does not check for a member without an instance id.
        if consumer.assignment_lost() {
            debug!("assignment lost: the round is not committed");
            return Err(TxnError::Abortable(rdkafka::error::KafkaError::Canceled));
        }
        let Some(group) = consumer.group_metadata() else {
            return Err(TxnError::Abortable(rdkafka::error::KafkaError::Canceled));
        };
        producer.send_offsets(&tpl, &Arc::new(group))?;
    }
    producer.commit()?;
    hang(Step::After);
    shared.stats.transactions.fetch_add(1, Ordering::Relaxed);
    debug!(
        partitions = round.points.len(),
        records = round.record_count(),
        took_ms = started.elapsed().as_millis() as u64,
        "worker transaction committed"
    );
    Ok(())
}

/// Abort the transaction under way; a producer that cannot is made anew.
fn abort(producer: &mut Transactional) -> Result<(), TxnError> {
    if let Err(failed) = producer.abort() {
        warn!(error = %failed, "aborting failed; making the producer anew");
        producer.renew()?;
    }
    Ok(())
}

/// Write the records of `jobs` (indices in `round.records`) in order and
/// wait for their acknowledgements; the jobs a record of which Kafka
/// refused for good go to `refused`, and the error is a refusal if any.
fn write_jobs(
    producer: &Transactional,
    round: &Round,
    jobs: impl Iterator<Item = usize>,
    refused: &mut Vec<usize>,
) -> Result<(), TxnError> {
    let records: Vec<(usize, &OwnedRecord)> = jobs
        .flat_map(|i| round.records[i].2.iter().map(move |r| (i, r)))
        .collect();
    if records.is_empty() {
        return Ok(());
    }
    let sends: Vec<(&OwnedRecord, Option<i32>)> = records.iter().map(|(_, r)| (*r, None)).collect();
    let acks = futures::executor::block_on(kafka::enqueue_all(producer.producer(), &sends));
    let (mut first_refusal, mut first_other) = (None, None);
    let acked = futures::executor::block_on(futures::future::join_all(acks));
    for ((job, _), r) in records.iter().zip(acked) {
        match r {
            Err(e) if kafka::refused_for_good(&e) => {
                if refused.last() != Some(job) {
                    refused.push(*job);
                }
                first_refusal.get_or_insert(e);
            }
            Err(e) => {
                first_other.get_or_insert(e);
            }
            Ok(_) => {}
        }
    }
    first_refusal
        .or(first_other)
        .map_or(Ok(()), |e| Err(TxnError::Abortable(e)))
}

/// Write held-topic records, each to its partition, and wait for their
/// acknowledgements.
fn write_pinned(producer: &Transactional, records: &[(i32, OwnedRecord)]) -> Result<(), TxnError> {
    if records.is_empty() {
        return Ok(());
    }
    let sends: Vec<(&OwnedRecord, Option<i32>)> = records.iter().map(|(p, r)| (r, Some(*p))).collect();
    let acks = futures::executor::block_on(kafka::enqueue_all(producer.producer(), &sends));
    let acked = futures::executor::block_on(futures::future::join_all(acks));
    match acked.into_iter().find_map(Result::err) {
        Some(e) => Err(TxnError::Abortable(e)),
        None => Ok(()),
    }
}

/// The transaction thread: until the worker stops, every `every` commit
/// what finished, or (nothing moved) where the partitions stand
/// when the group coordinator was not heard from lately. An aborted round
/// is taken again by the next; a fatal error stops the worker.
pub(super) fn run<C: ConsumerContext>(
    shared: &Arc<Shared>,
    consumer: &BaseConsumer<C>,
    txn: &WorkerTxn,
    every: Duration,
) {
    while !shared.signals.stop.is_cancelled() {
        std::thread::sleep(every);
        let _committing = shared.jobs.committing();
        let mut round = shared
            .jobs
            .take_round(Some(shared.cfg.worker.session_timeout / 6));
        if round.is_empty() {
            continue;
        }
        match txn.commit(shared, consumer, &mut round) {
            Ok(()) => shared.heard_from_coordinator(),
            Err(TxnError::Abortable(_)) => shared.jobs.put_back(round),
            Err(e) => {
                shared.fail(format!("worker transactions: {e}"));
                return;
            }
        }
    }
}

/// Stages a driver's settlements in the worker's state.
pub(super) struct StageIn<'a>(pub(super) &'a Shared);

impl Stage for StageIn<'_> {
    fn stage(&self, origin: Origin<'_>, records: Vec<OwnedRecord>) -> bool {
        let Some(tp) = self.0.tp(origin.topic, origin.partition) else {
            return false;
        };
        self.0.jobs.stage(tp, origin.generation, origin.offset, records)
    }
}

/// Steps of a transaction a test can stop a worker process at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// The round is taken, the transaction not begun.
    Before,
    /// The records are written and acknowledged, the offsets and the
    /// commit not sent.
    Inside,
    /// The transaction committed.
    After,
}

/// Fault injection for the crash tests, which must kill a worker at an
/// exact step of a transaction (a timing no real fault gives on demand):
/// with `KAIROS_WORKER_HANG_AT=before|inside|after` in the environment, the
/// first transaction with records that reaches that step prints `kairos: hanging at
/// STEP` to stderr and never returns, for the test to kill the process.
/// Unset (always, outside those tests): nothing.
fn hang_at(step: Step) {
    static AT: std::sync::OnceLock<Option<Step>> = std::sync::OnceLock::new();
    let at = AT.get_or_init(|| match std::env::var("KAIROS_WORKER_HANG_AT").as_deref() {
        Ok("before") => Some(Step::Before),
        Ok("inside") => Some(Step::Inside),
        Ok("after") => Some(Step::After),
        _ => None,
    });
    if *at == Some(step) {
        eprintln!("kairos: hanging at {}", format!("{step:?}").to_lowercase());
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}
