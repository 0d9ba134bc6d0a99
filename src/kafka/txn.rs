//! Kafka transactions: a transactional producer, its blocking calls, and
//! the classes of their errors.
//!
//! librdkafka's `init`, `send_offsets`, `commit` and `abort` block until the
//! transaction coordinator answers: call them from a thread of their own
//! (never from the async runtime's threads). A retriable error is retried
//! here until the call's time-out; what is left is either
//! [`TxnError::Abortable`] (abort, then do the round again) or
//! [`TxnError::Fatal`] (the producer is unusable: fenced by a newer
//! instance with the same `transactional.id`, or a broken protocol state).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, Producer as _};
use rdkafka::TopicPartitionList;

use crate::config::KafkaConfig;

/// Why a transaction call failed, by what the caller must do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TxnError {
    /// The transaction cannot commit (a record not written, a stale
    /// consumer group generation, a time-out): abort it and do its work
    /// again in a new one.
    #[error("transaction must be aborted: {0}")]
    Abortable(KafkaError),
    /// The producer cannot go on (fenced by a newer instance with its
    /// `transactional.id`, or an unrecoverable state): stop using it.
    #[error("transactional producer failed: {0}")]
    Fatal(KafkaError),
    /// A commit failed without saying whether the transaction committed
    /// (it ran out of time, or the producer failed during it): its work
    /// must be neither done again nor counted as done. Stop; a restart
    /// goes on from what Kafka holds.
    #[error("transaction commit in doubt: {0}")]
    InDoubt(KafkaError),
}

/// How many call time-outs a commit is resumed for (see [`Transactional::commit`]).
pub const COMMIT_PATIENCE: u32 = 6;

/// A producer whose records are written in transactions.
pub struct Transactional {
    producer: FutureProducer,
    /// How long each blocking call may take.
    timeout: Duration,
    /// What the producer was made from, to make it again ([`Transactional::renew`]).
    config: rdkafka::ClientConfig,
}

impl Transactional {
    /// A producer with Kairos's producer settings and `transactional_id`,
    /// whose transactions the broker aborts when they stay open longer than
    /// `transaction_timeout`; its transactions initialised (which fences
    /// and aborts whatever an earlier producer with the same id left open).
    /// Blocks.
    pub fn new(
        cfg: &KafkaConfig,
        client_id: &str,
        transactional_id: &str,
        transaction_timeout: Duration,
    ) -> Result<Transactional, TxnError> {
        let mut c = super::producer_config(cfg, client_id);
        // A record must be acknowledged within its transaction's time.
        let message_timeout = cfg.produce_timeout.min(transaction_timeout);
        c.set("message.timeout.ms", message_timeout.as_millis().to_string());
        c.set("transactional.id", transactional_id);
        // A transaction's offsets are refused while the coordinator still
        // completes the one before (CONCURRENT_TRANSACTIONS): ask again
        // soon, not after librdkafka's 100 ms.
        c.set("retry.backoff.ms", "5");
        c.set(
            "transaction.timeout.ms",
            transaction_timeout.as_millis().to_string(),
        );
        let producer: FutureProducer = c.create().map_err(TxnError::Fatal)?;
        let timeout = cfg.produce_timeout.max(Duration::from_secs(10));
        let t = Transactional {
            producer,
            timeout,
            config: c,
        };
        t.retrying(|p, left| p.init_transactions(left))?;
        Ok(t)
    }

    /// After a [`TxnError::Fatal`]: a new producer with the same
    /// `transactional.id`, its transactions initialised, as a restarted
    /// process would make. A transaction the coordinator aborted on its
    /// time-out (a broker lost meanwhile) bumps the producer's epoch, which
    /// leaves the old producer fenced for good although no other instance
    /// runs. Two live instances given the same id fence each other in turn.
    /// Blocks.
    pub fn renew(&mut self) -> Result<(), TxnError> {
        let new: FutureProducer = self.config.create().map_err(TxnError::Fatal)?;
        let old = std::mem::replace(&mut self.producer, new);
        // Destroying a producer waits for its threads, which may wait for
        // a broker that is gone: not on the caller's thread.
        let _ = std::thread::Builder::new()
            .name("kairos-txn-drop".into())
            .spawn(move || drop(old));
        self.retrying(|p, left| p.init_transactions(left))
    }

    /// The producer, to write a transaction's records with (between
    /// [`begin`](Self::begin) and [`commit`](Self::commit)).
    pub fn producer(&self) -> &FutureProducer {
        &self.producer
    }

    /// Begin a transaction (does not block).
    pub fn begin(&self) -> Result<(), TxnError> {
        self.producer.begin_transaction().map_err(classify)
    }

    /// Add consumer offsets to the transaction: they commit with it, and
    /// only if `group` is still the group's current generation (KIP-447:
    /// a member the group moved on from cannot commit).
    ///
    /// librdkafka (2.12 to 2.14 at least) can block in this call past its
    /// time-out, forever, when the group coordinator's broker was lost
    /// (librdkafka issues 5456 and 5511). The call runs on a thread of its
    /// own: past the time-out and a grace period the producer counts as
    /// failed ([`TxnError::Fatal`], so the caller makes it anew with
    /// [`Transactional::renew`]) and that thread is left behind.
    pub fn send_offsets(
        &self,
        offsets: &TopicPartitionList,
        group: &Arc<ConsumerGroupMetadata>,
    ) -> Result<(), TxnError> {
        let (done, answer) = std::sync::mpsc::channel();
        let (producer, offsets, group) = (self.producer.clone(), offsets.clone(), group.clone());
        let timeout = self.timeout;
        std::thread::Builder::new()
            .name("kairos-txn-offsets".into())
            .spawn(move || {
                let r = retrying(&producer, timeout, |p, left| {
                    p.send_offsets_to_transaction(&offsets, &group, left)
                });
                let _ = done.send(r);
            })
            .map_err(|e| {
                tracing::warn!(error = %e, "no thread to add offsets to the transaction");
                TxnError::Abortable(KafkaError::Canceled)
            })?;
        answer
            .recv_timeout(timeout + Duration::from_secs(5))
            .unwrap_or_else(|_| {
                tracing::warn!(timeout = ?timeout,
                    "adding offsets to the transaction hangs past its time-out; the producer counts as failed");
                Err(TxnError::Fatal(KafkaError::Canceled))
            })
    }

    /// Commit the transaction, once every record in it is acknowledged.
    /// [`TxnError::Abortable`] only when the transaction did not commit
    /// (abort it); [`TxnError::InDoubt`] when that is not known.
    ///
    /// A commit that times out is resumed (called again, as librdkafka asks)
    /// for up to [`COMMIT_PATIENCE`] times the call's time-out: a cluster
    /// electing a new controller or coordinator keeps commits waiting for
    /// longer than one call's time-out, and giving up leaves the outcome
    /// unknown, which stops the service.
    pub fn commit(&self) -> Result<(), TxnError> {
        retrying(&self.producer, self.timeout * COMMIT_PATIENCE, |p, left| {
            p.commit_transaction(left.min(self.timeout))
        })
        .map_err(|e| match e {
            TxnError::Abortable(KafkaError::Transaction(r)) if r.txn_requires_abort() => {
                TxnError::Abortable(KafkaError::Transaction(r))
            }
            TxnError::Abortable(e) | TxnError::Fatal(e) | TxnError::InDoubt(e) => TxnError::InDoubt(e),
        })
    }

    /// Abort the transaction: its records are never read by read_committed
    /// consumers. An abort that fails leaves the producer unusable.
    pub fn abort(&self) -> Result<(), TxnError> {
        self.retrying(|p, left| p.abort_transaction(left))
            .map_err(|e| match e {
                TxnError::Abortable(e) | TxnError::Fatal(e) | TxnError::InDoubt(e) => TxnError::Fatal(e),
            })
    }

    /// Call `f` until it succeeds, fails for good, or the time-out passes.
    fn retrying(
        &self,
        f: impl FnMut(&FutureProducer, Duration) -> Result<(), KafkaError>,
    ) -> Result<(), TxnError> {
        retrying(&self.producer, self.timeout, f)
    }
}

/// Call `f` on `producer` until it succeeds, fails for good, or `timeout`
/// passes.
fn retrying(
    producer: &FutureProducer,
    timeout: Duration,
    mut f: impl FnMut(&FutureProducer, Duration) -> Result<(), KafkaError>,
) -> Result<(), TxnError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match f(producer, left.max(Duration::from_millis(1))) {
            Ok(()) => return Ok(()),
            Err(e) if is_retriable(&e) && Instant::now() < deadline => {
                tracing::debug!(error = %e, "transaction call retried");
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(classify(e)),
        }
    }
}

fn is_retriable(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(r) if r.is_retriable() && !r.is_fatal() && !r.txn_requires_abort())
}

/// Sort an error of a transaction call into what the caller must do. A
/// commit's flush that timed out, or anything not said to be fatal, can be
/// aborted.
fn classify(e: KafkaError) -> TxnError {
    match &e {
        KafkaError::Transaction(r) if r.is_fatal() => TxnError::Fatal(e),
        _ => TxnError::Abortable(e),
    }
}
