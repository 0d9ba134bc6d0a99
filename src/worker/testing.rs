//! A worker without a broker, for testing handlers.
//!
//! [`TestWorker`] runs jobs through a handler and carries out the outcomes
//! with the same rules as a running [`crate::worker::Worker`] (attempts,
//! backoff, dead letters, follow-ups that can never be written, panics), but
//! writes into memory instead of Kafka and reads a [`ManualClock`], so a
//! test sees every write and follows retries without waiting for them.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use kairos::worker::{Outcome, Settled, TestWorker};
//!
//! let cfg = kairos::Config::default();
//! let worker = TestWorker::new(&cfg, |job: kairos::Job, _ctx| async move {
//!     if job.attempt < 3 { Outcome::retry("mail server busy") } else { Outcome::done() }
//! });
//! let runs = worker.run_until_settled(kairos::Job::new("emails", "user-1", "hi")).await;
//! assert_eq!(runs.len(), 3);
//! assert!(matches!(runs[2].settled, Settled::Done { .. }));
//! // Each retry ran at its run-at, after the backoff.
//! assert!(runs[1].started_at > runs[0].started_at);
//! # }
//! ```
//!
//! What it does not model: partitions, the lock table's per-key order,
//! rebalances and offsets (the integration tests run those against a broker).

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, ManualClock};
use crate::config::{Config, Limits};
use crate::job::Job;
use crate::producer::ProduceError;
use crate::sync::Lock;
use crate::wire::{self, DeadLetter};
use crate::worker::handler::{run_caught, Backoff, Handler, JobContext, Outcome};
use crate::worker::settle::{Origin, Outbox, RetryPolicy, Settled, Settler, Write};

/// Something a worker wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Written {
    /// A job: a follow-up or a job's next attempt. A running worker's
    /// producer sends it to its work topic when due, else through the
    /// scheduler.
    Job(Job),
    /// A dead letter: the job and why it died.
    DeadLetter {
        /// The job as dead-lettered (its last error kept).
        job: Job,
        /// The reason and where the job was read from.
        dead: DeadLetter,
    },
}

/// One run of the handler and what became of it.
#[derive(Clone, Debug)]
pub struct Run {
    /// The job as the handler got it (its `attempt` counts from 1).
    pub job: Job,
    /// The clock's time when it started.
    pub started_at: DateTime<Utc>,
    /// What the handler returned (a panic counts as a retry).
    pub outcome: Outcome,
    /// The panic's message, if the handler panicked.
    pub panic: Option<String>,
    /// What was written for the outcome.
    pub settled: Settled,
}

/// Runs jobs through a handler with a running worker's rules, without a
/// broker: writes are kept in memory ([`TestWorker::written`]) and time is
/// a [`ManualClock`] ([`TestWorker::clock`]).
pub struct TestWorker {
    handler: Arc<dyn Handler>,
    settler: Settler,
    outbox: Arc<MemoryOutbox>,
    clock: ManualClock,
    next_offset: AtomicI64,
}

impl TestWorker {
    /// A test worker with `cfg`'s `[worker]` retry settings and `[limits]`,
    /// its clock standing at the current time.
    pub fn new(cfg: &Config, handler: impl Handler) -> Self {
        let clock = ManualClock::new(crate::job::truncate_to_millis(Utc::now()));
        let outbox = Arc::new(MemoryOutbox {
            limits: cfg.limits,
            topics: Mutex::new(None),
            failures: AtomicUsize::new(0),
            written: Mutex::new(Vec::new()),
        });
        TestWorker {
            handler: Arc::new(handler),
            settler: Settler {
                outbox: outbox.clone(),
                policy: RetryPolicy {
                    max_attempts: cfg.worker.max_attempts,
                    backoff: Backoff {
                        base: cfg.worker.backoff_base,
                        max: cfg.worker.backoff_max,
                    },
                },
                clock: Arc::new(clock.clone()),
                staged: None,
            },
            outbox,
            clock,
            next_offset: AtomicI64::new(0),
        }
    }

    /// Only these work topics exist: a job written to another is refused
    /// for good, as Kafka would (by default every topic exists).
    pub fn with_topics<S: Into<String>>(self, topics: impl IntoIterator<Item = S>) -> Self {
        *self.outbox.topics.locked() = Some(topics.into_iter().map(Into::into).collect());
        self
    }

    /// The clock the worker reads; move it to test time-dependent handlers.
    pub fn clock(&self) -> &ManualClock {
        &self.clock
    }

    /// Make the next `n` writes fail as a timed-out Kafka write would; the
    /// worker retries them (after 100 ms, then twice as long each time).
    pub fn fail_writes(&self, n: usize) {
        self.outbox.failures.store(n, Ordering::SeqCst);
    }

    /// Everything written so far, in order.
    pub fn written(&self) -> Vec<Written> {
        self.outbox.written.locked().clone()
    }

    /// Run one attempt of `job` and carry out its outcome. A job due later
    /// than the clock moves the clock to its run-at first: a worker never
    /// starts a job early.
    pub async fn run(&self, job: Job) -> Run {
        if job.run_at > self.clock.now() {
            self.clock.set(job.run_at);
        }
        let started_at = self.clock.now();
        let offset = self.next_offset.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let ctx = JobContext {
            topic: job.topic.clone(),
            partition: 0,
            offset,
            cancel: cancel.clone(),
        };
        let (outcome, panic) = run_caught(self.handler.call(job.clone(), ctx)).await;
        let origin = Origin {
            topic: &job.topic,
            partition: 0,
            offset,
            generation: 0,
        };
        let settled = self
            .settler
            .settle(&job, origin, outcome.clone(), &cancel, None)
            .await
            .expect("a test worker's job is never cancelled");
        Run {
            job,
            started_at,
            outcome,
            panic,
            settled,
        }
    }

    /// Run `job`, then each next attempt at its run-at, until it is done or
    /// dead-lettered; every run, in order.
    pub async fn run_until_settled(&self, job: Job) -> Vec<Run> {
        let mut runs = Vec::new();
        let mut job = job;
        loop {
            let run = self.run(job).await;
            let next = match &run.settled {
                Settled::Retried { next } | Settled::Deferred { next } => Some(next.clone()),
                Settled::Done { .. } | Settled::DeadLettered { .. } => None,
            };
            runs.push(run);
            match next {
                Some(n) => job = n,
                None => return runs,
            }
        }
    }
}

/// Keeps writes in memory; refuses what a real producer would refuse.
struct MemoryOutbox {
    limits: Limits,
    /// The work topics that exist; `None`: all.
    topics: Mutex<Option<HashSet<String>>>,
    /// Writes still to fail.
    failures: AtomicUsize,
    written: Mutex<Vec<Written>>,
}

impl MemoryOutbox {
    /// Whether this write is one to fail.
    fn fails(&self) -> bool {
        self.failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }
}

impl Outbox for MemoryOutbox {
    fn enqueue(&self, job: Job) -> Write<'_, ProduceError> {
        let result = if self.fails() {
            Err(ProduceError::Kafka {
                topic: job.topic.clone(),
                source: KafkaError::MessageProduction(RDKafkaErrorCode::RequestTimedOut),
            })
        } else if let Err(reason) = wire::check(&job, &self.limits) {
            Err(ProduceError::InvalidJob { id: job.id, reason })
        } else if self
            .topics
            .locked()
            .as_ref()
            .is_some_and(|t| !t.contains(&job.topic))
        {
            Err(ProduceError::UnknownTopic { topic: job.topic })
        } else {
            self.written.locked().push(Written::Job(job));
            Ok(())
        };
        Box::pin(async move { result })
    }

    fn dead_letter(&self, job: Job, dead: DeadLetter) -> Write<'_, String> {
        let result = if self.fails() {
            Err("dead-letter write timed out".to_string())
        } else {
            self.written.locked().push(Written::DeadLetter { job, dead });
            Ok(())
        };
        Box::pin(async move { result })
    }
}

#[cfg(test)]
mod tests;
