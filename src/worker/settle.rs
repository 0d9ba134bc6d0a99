//! Settlement: what a handler's [`Outcome`] means (done with follow-ups,
//! another attempt through the scheduler, a dead letter) and carrying it out
//! through an [`Outbox`].
//!
//! The decision ([`plan`]) is pure: the job, the outcome, the retry policy
//! and the time in, the writes to make out. The writes go through an
//! [`Outbox`]: Kafka in a running [`crate::worker::Worker`], memory in a
//! [`crate::worker::TestWorker`], so both run the same rules. In
//! exactly-once mode they are made into records and handed to a [`Stage`]
//! all at once, to be written in the transaction that commits past the
//! job's offset.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::producer::FutureProducer;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::clock::SharedClock;
use crate::job::{truncate_to_millis, Job};
use crate::producer::{ProduceError, Producer};
use crate::sync::Lock;
use crate::wire::{DeadLetter, OwnedRecord};
use crate::worker::handler::{Backoff, Outcome};
use crate::{kafka, wire};

/// A boxed write, as an [`Outbox`] returns it.
pub(crate) type Write<'a, E> = Pin<Box<dyn Future<Output = Result<(), E>> + Send + 'a>>;

/// Where a worker's writes go.
pub(crate) trait Outbox: Send + Sync {
    /// Write a job: to its work topic when due, else through the scheduler
    /// (retries and follow-ups).
    fn enqueue(&self, job: Job) -> Write<'_, ProduceError>;
    /// Write a dead letter for `job`.
    fn dead_letter(&self, job: Job, dead: DeadLetter) -> Write<'_, String>;
}

/// The running worker's outbox: the producer routes jobs by run-at, dead
/// letters go to the dead-letter topic.
pub(crate) struct KafkaOutbox {
    pub(crate) producer: Producer,
    pub(crate) raw: FutureProducer,
    pub(crate) dead_letter_topic: String,
}

impl Outbox for KafkaOutbox {
    fn enqueue(&self, job: Job) -> Write<'_, ProduceError> {
        let write = self.producer.enqueue(job).into_future();
        Box::pin(async move { write.await.map(|_| ()) })
    }

    fn dead_letter(&self, job: Job, dead: DeadLetter) -> Write<'_, String> {
        let rec = wire::dead_job_record(&job, &dead, &self.dead_letter_topic);
        Box::pin(async move {
            kafka::send(&self.raw, &rec, None)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }
}

/// Where a job's writes wait for their transaction (exactly-once mode).
pub(crate) trait Stage: Send + Sync {
    /// Keep `records`, every write of the job read at `origin`, for the
    /// transaction that commits its partition past it; false when the
    /// partition is no longer owned as it was when the job was read (the
    /// job is read again by the next owner).
    fn stage(&self, origin: Origin<'_>, records: Vec<OwnedRecord>) -> bool;
}

/// An outbox that makes a settlement's writes into records and keeps them
/// (exactly-once mode): they reach Kafka only once staged, all together.
struct Collect<'a> {
    via: &'a KafkaOutbox,
    records: Mutex<Vec<OwnedRecord>>,
}

impl Outbox for Collect<'_> {
    fn enqueue(&self, job: Job) -> Write<'_, ProduceError> {
        Box::pin(async move {
            let (rec, _) = self.via.producer.route(job).await?;
            self.records.locked().push(rec);
            Ok(())
        })
    }

    fn dead_letter(&self, job: Job, dead: DeadLetter) -> Write<'_, String> {
        let rec = wire::dead_job_record(&job, &dead, &self.via.dead_letter_topic);
        self.records.locked().push(rec);
        Box::pin(async { Ok(()) })
    }
}

/// How failed jobs are tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryPolicy {
    /// Attempts of a job that names none (`[worker] max_attempts`).
    pub(crate) max_attempts: u32,
    /// Delay between attempts when the handler names none.
    pub(crate) backoff: Backoff,
}

/// Where a job was read from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Origin<'a> {
    pub(crate) topic: &'a str,
    pub(crate) partition: i32,
    pub(crate) offset: i64,
    /// Which ownership of the partition it was read under.
    pub(crate) generation: u64,
}

/// The writes an outcome asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Write these follow-ups; then the job is done.
    Done { follow_ups: Vec<Job> },
    /// Write this next attempt (its run-at `delay` from now).
    Retry { next: Job, delay: Duration },
    /// Dead-letter the job (with its last error), for this reason.
    Dead { job: Job, reason: String },
    /// Write the same attempt again, due later (rate limited, or its
    /// pacing turn is further ahead than the worker waits in memory).
    Defer { next: Job },
}

/// What an outcome means for `job` at `now`. A retry past the job's attempts
/// (its own `max_attempts`, else the policy's) becomes a dead letter; a retry
/// without a delay waits the policy's backoff for the attempt.
pub(crate) fn plan(
    job: &Job,
    outcome: Outcome,
    policy: &RetryPolicy,
    now: DateTime<Utc>,
    rng: &mut impl rand::Rng,
) -> Plan {
    match outcome {
        Outcome::Done { follow_ups } => Plan::Done { follow_ups },
        Outcome::Dead { reason } => Plan::Dead {
            job: job.clone(),
            reason,
        },
        Outcome::RateLimited { until } => {
            let mut next = job.clone();
            next.run_at = until;
            // Not before that, early allowance or not; no longer parked.
            next.early = None;
            next.parked = None;
            Plan::Defer { next }
        }
        Outcome::Retry { after, error } => {
            let max = job.max_attempts.unwrap_or(policy.max_attempts);
            let mut next = job.clone();
            if job.attempt >= max {
                let reason = format!("gave up after {} attempts: {error}", job.attempt);
                next.last_error = Some(error);
                return Plan::Dead { job: next, reason };
            }
            let delay = after.unwrap_or_else(|| policy.backoff.delay(job.attempt, rng));
            next.attempt += 1;
            next.last_error = Some(error);
            next.parked = None;
            // A retry never starts early: its run-at is its backoff.
            next.early = None;
            let run_at = chrono::Duration::from_std(delay)
                .ok()
                .and_then(|d| now.checked_add_signed(d))
                .unwrap_or(DateTime::<Utc>::MAX_UTC);
            next.run_at = truncate_to_millis(run_at);
            Plan::Retry { next, delay }
        }
    }
}

/// What became of a job once its outcome was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Done; these follow-ups were written.
    Done {
        /// The follow-up jobs, as written.
        follow_ups: Vec<Job>,
    },
    /// Another attempt was written through the scheduler.
    Retried {
        /// The next attempt: same id, attempt + 1, run-at after the backoff.
        next: Job,
    },
    /// The job was dead-lettered.
    DeadLettered {
        /// Why (the dead letter's `kairos-dead-reason`).
        reason: String,
    },
    /// The same attempt was written through the scheduler, due later
    /// ([`Outcome::RateLimited`], or a long pacing wait).
    Deferred {
        /// The job as written: same id and attempt, run-at later.
        next: Job,
    },
}

/// Carries out outcomes: plans them and writes the plan, retrying failed
/// writes until they succeed or the job's partition is taken away.
pub(crate) struct Settler {
    pub(crate) outbox: Arc<dyn Outbox>,
    pub(crate) policy: RetryPolicy,
    pub(crate) clock: SharedClock,
    /// Exactly-once mode: what makes the records a [`Stage`] keeps.
    pub(crate) staged: Option<Arc<KafkaOutbox>>,
}

impl Settler {
    /// Carry out `outcome` for `job`; `None` when `cancel` fired before its
    /// writes were acknowledged, or `stage` refused them (the job is then
    /// re-delivered to the partition's next owner). With `stage` (and
    /// [`Settler::staged`]), the writes are staged, not written.
    pub(crate) async fn settle(
        &self,
        job: &Job,
        origin: Origin<'_>,
        outcome: Outcome,
        cancel: &CancellationToken,
        stage: Option<&dyn Stage>,
    ) -> Option<Settled> {
        let plan = plan(
            job,
            outcome,
            &self.policy,
            self.clock.now(),
            &mut rand::thread_rng(),
        );
        let mut delay = kafka::RetryDelay::new();
        loop {
            let written = match (stage, &self.staged) {
                (Some(stage), Some(via)) => {
                    let collect = Collect {
                        via,
                        records: Mutex::new(Vec::new()),
                    };
                    match self.write(&collect, job, origin, &plan).await {
                        // Staged whole, or not at all: a write failed
                        // half-way leaves nothing behind to be written twice.
                        Ok(settled) => {
                            let records = collect.records.into_inner().unwrap_or_else(|e| e.into_inner());
                            if !stage.stage(origin, records) {
                                return None;
                            }
                            Ok(settled)
                        }
                        Err(e) => Err(e),
                    }
                }
                _ => self.write(&*self.outbox, job, origin, &plan).await,
            };
            match written {
                Ok(settled) => return Some(settled),
                Err(e) => warn!(job_id = %job.id, error = %e, "writing the outcome failed; retrying"),
            }
            if cancel.is_cancelled() {
                return None;
            }
            tokio::time::sleep(delay.next_delay()).await;
        }
    }

    async fn write(
        &self,
        outbox: &dyn Outbox,
        job: &Job,
        origin: Origin<'_>,
        plan: &Plan,
    ) -> Result<Settled, String> {
        match plan {
            Plan::Done { follow_ups } => {
                let writes = follow_ups.iter().map(|f| outbox.enqueue(f.clone()));
                match futures::future::join_all(writes)
                    .await
                    .into_iter()
                    .find_map(Result::err)
                {
                    None => {
                        debug!(job_id = %job.id, follow_ups = follow_ups.len(), "done");
                        Ok(Settled::Done {
                            follow_ups: follow_ups.clone(),
                        })
                    }
                    // A follow-up that can never be written fails the job for
                    // good (retrying the job would hit the same wall).
                    Some(e) if e.is_permanent() => {
                        let reason = format!("follow-up rejected: {e}");
                        self.dead_letter(outbox, job.clone(), origin, reason).await
                    }
                    Some(e) => Err(e.to_string()),
                }
            }
            Plan::Retry { next, delay } => {
                outbox.enqueue(next.clone()).await.map_err(|e| e.to_string())?;
                debug!(job_id = %job.id, attempt = job.attempt, delay = ?delay,
                    error = next.last_error.as_deref().unwrap_or_default(), "retry scheduled");
                Ok(Settled::Retried { next: next.clone() })
            }
            Plan::Dead { job, reason } => {
                self.dead_letter(outbox, job.clone(), origin, reason.clone())
                    .await
            }
            Plan::Defer { next } => {
                outbox.enqueue(next.clone()).await.map_err(|e| e.to_string())?;
                debug!(job_id = %job.id, run_at = %wire::format_time(next.run_at), "deferred");
                Ok(Settled::Deferred { next: next.clone() })
            }
        }
    }

    async fn dead_letter(
        &self,
        outbox: &dyn Outbox,
        job: Job,
        origin: Origin<'_>,
        reason: String,
    ) -> Result<Settled, String> {
        let dead = DeadLetter {
            reason,
            origin_topic: origin.topic.to_string(),
            origin_partition: origin.partition,
            origin_offset: origin.offset,
        };
        let (id, key) = (job.id, job.key_lossy().into_owned());
        outbox.dead_letter(job, dead.clone()).await?;
        warn!(job_id = %id, key = %key, partition = origin.partition, offset = origin.offset,
            reason = %dead.reason, "job dead-lettered");
        Ok(Settled::DeadLettered { reason: dead.reason })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rand::SeedableRng;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            backoff: Backoff {
                base: Duration::from_secs(2),
                max: Duration::from_secs(60),
            },
        }
    }

    fn job(attempt: u32) -> Job {
        let mut j = Job::new("emails", "user-1", b"hi".to_vec());
        j.attempt = attempt;
        j
    }

    #[test]
    fn a_retry_is_the_next_attempt_after_the_backoff_with_the_error_kept() {
        let now = Utc::now();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let first = job(1).early(Duration::from_secs(60));
        let Plan::Retry { next, delay } = plan(&first, Outcome::retry("smtp 451"), &policy(), now, &mut rng)
        else {
            panic!("not a retry")
        };
        assert!(
            delay >= Duration::from_secs(1) && delay <= Duration::from_secs(2),
            "{delay:?}"
        );
        assert_eq!(next.attempt, 2);
        assert_eq!(next.early, None, "a retry never starts early");
        assert_eq!(next.id, first.id, "the same job, another attempt");
        assert_eq!(next.last_error.as_deref(), Some("smtp 451"));
        let want = truncate_to_millis(now + chrono::Duration::from_std(delay).unwrap());
        assert_eq!(next.run_at, want);
    }

    #[test]
    fn a_retry_with_a_delay_waits_exactly_that() {
        let now = Utc::now();
        let out = Outcome::retry_after(Duration::from_millis(1500), "429");
        let Plan::Retry { next, delay } = plan(&job(2), out, &policy(), now, &mut rand::thread_rng()) else {
            panic!("not a retry")
        };
        assert_eq!(delay, Duration::from_millis(1500));
        assert_eq!(
            next.run_at,
            truncate_to_millis(now + chrono::Duration::milliseconds(1500))
        );
    }

    #[test]
    fn the_last_attempt_is_dead_lettered_with_its_error() {
        let p = plan(
            &job(3),
            Outcome::retry("boom"),
            &policy(),
            Utc::now(),
            &mut rand::thread_rng(),
        );
        let Plan::Dead { job: dead, reason } = p else {
            panic!("not dead")
        };
        assert_eq!(reason, "gave up after 3 attempts: boom");
        assert_eq!(dead.last_error.as_deref(), Some("boom"));
        assert_eq!(dead.attempt, 3);
    }

    #[test]
    fn a_job_s_own_max_attempts_wins_over_the_policy() {
        let mut j = job(3);
        j.max_attempts = Some(10);
        let p = plan(
            &j,
            Outcome::retry("again"),
            &policy(),
            Utc::now(),
            &mut rand::thread_rng(),
        );
        assert!(
            matches!(p, Plan::Retry { ref next, .. } if next.attempt == 4),
            "{p:?}"
        );
        j.max_attempts = Some(1);
        j.attempt = 1;
        let p = plan(
            &j,
            Outcome::retry("once"),
            &policy(),
            Utc::now(),
            &mut rand::thread_rng(),
        );
        assert!(matches!(p, Plan::Dead { .. }), "{p:?}");
    }

    #[test]
    fn a_rate_limited_job_runs_again_at_its_time_with_the_same_attempt() {
        let mut j = job(2).early(Duration::from_secs(5));
        j.parked = Some(4);
        let until = truncate_to_millis(Utc::now() + chrono::Duration::seconds(30));
        let p = plan(
            &j,
            Outcome::rate_limited(until),
            &policy(),
            Utc::now(),
            &mut rand::thread_rng(),
        );
        let Plan::Defer { next } = p else {
            panic!("not deferred: {p:?}")
        };
        assert_eq!((next.id, next.attempt, next.run_at), (j.id, 2, until));
        assert_eq!((next.early, next.parked), (None, None));
    }

    #[test]
    fn a_retry_too_far_ahead_runs_at_the_end_of_time_instead_of_overflowing() {
        let out = Outcome::retry_after(Duration::from_secs(u64::MAX / 2), "later");
        let Plan::Retry { next, .. } = plan(&job(1), out, &policy(), Utc::now(), &mut rand::thread_rng())
        else {
            panic!("not a retry")
        };
        assert_eq!(next.run_at, truncate_to_millis(DateTime::<Utc>::MAX_UTC));
    }
}
