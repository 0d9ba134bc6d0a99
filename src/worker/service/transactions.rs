//! Exactly-once settlement (`worker.exactly_once`): a job's writes are
//! staged in memory ([`WorkerJobs::stage`]) and reach Kafka in the
//! transaction that commits its partition's offset past it, together with
//! the writes of every other job below the commit points of the round.
//! A job whose offset can still be read again (above the commit point)
//! has written nothing; once its offset is committed, all of its writes
//! are. A worker the group moved on from (paused past its session, cut
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

use super::jobs::Round;
use super::offsets::offset_to_commit;
use super::{Shared, WorkerError};

use crate::kafka::{self, Transactional, TxnError};
use crate::sync::Lock;
use crate::wire::OwnedRecord;
use crate::worker::settle::{Origin, Stage};

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
    pub(super) fn commit<C: ConsumerContext>(
        &self,
        shared: &Shared,
        consumer: &BaseConsumer<C>,
        round: &Round,
    ) -> Result<(), TxnError> {
        let mut producer = self.producer.locked();
        let started = Instant::now();
        let hang = |step| {
            if round.record_count() > 0 {
                hang_at(step);
            }
        };
        hang(Step::Before);
        let sent = producer.begin().and_then(|()| {
            write(&producer, round)?;
            hang(Step::Inside);
            let mut tpl = TopicPartitionList::new();
            for point in &round.points {
                offset_to_commit(shared, &mut tpl, *point);
            }
            if tpl.count() == 0 {
                return Ok(());
            }
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
            producer.send_offsets(&tpl, &Arc::new(group))
        });
        let e = match sent.and_then(|()| producer.commit()) {
            Ok(()) => {
                hang(Step::After);
                shared.stats.transactions.fetch_add(1, Ordering::Relaxed);
                debug!(
                    partitions = round.points.len(),
                    records = round.record_count(),
                    took_ms = started.elapsed().as_millis() as u64,
                    "worker transaction committed"
                );
                return Ok(());
            }
            Err(TxnError::InDoubt(e)) => return Err(TxnError::InDoubt(e)),
            Err(TxnError::Abortable(e)) => {
                warn!(error = %e, partitions = round.points.len(), records = round.record_count(),
                    "worker transaction aborted");
                if let Err(failed) = producer.abort() {
                    warn!(error = %failed, "aborting failed; making the producer anew");
                    producer.renew()?;
                }
                e
            }
            Err(TxnError::Fatal(e)) => {
                warn!(error = %e, "worker transaction failed for good before its commit; making the producer anew");
                producer.renew()?;
                e
            }
        };
        shared.stats.transactions_aborted.fetch_add(1, Ordering::Relaxed);
        Err(TxnError::Abortable(e))
    }
}

/// Write a round's records in order and wait for their acknowledgements.
fn write(producer: &Transactional, round: &Round) -> Result<(), TxnError> {
    let records: Vec<(&OwnedRecord, Option<i32>)> = round
        .records
        .iter()
        .flat_map(|(.., recs)| recs.iter().map(|r| (r, None)))
        .collect();
    if records.is_empty() {
        return Ok(());
    }
    let acks = futures::executor::block_on(kafka::enqueue_all(producer.producer(), &records));
    for r in futures::executor::block_on(futures::future::join_all(acks)) {
        r.map_err(TxnError::Abortable)?;
    }
    Ok(())
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
        let round = shared
            .jobs
            .take_round(Some(shared.cfg.worker.session_timeout / 6));
        if round.points.is_empty() {
            continue;
        }
        match txn.commit(shared, consumer, &round) {
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
