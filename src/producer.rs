//! The producer API: enqueue jobs now, at a time or after a delay; cancel and
//! reschedule pending ones.
//!
//! A due job goes straight to its work topic; a future one goes to the
//! schedule topic, where the scheduler holds it until its run-at. Every job
//! of a fair topic (`[fair] topics`) goes to the schedule topic, due or not:
//! the scheduler releases it in fair order across tenants. Every call
//! returns once Kafka has acknowledged the write.
//!
//! ```no_run
//! # async fn demo(producer: kairos::Producer) -> Result<(), kairos::ProduceError> {
//! use kairos::Job;
//! use std::time::Duration;
//!
//! let id = producer.enqueue(Job::new("emails", "user-42", b"welcome".to_vec())).await?;
//! let later = producer
//!     .enqueue(Job::new("emails", "user-42", b"reminder".to_vec()))
//!     .after(Duration::from_secs(3600))
//!     .await?;
//! producer.cancel(later).await?;
//! # let _ = id; Ok(()) }
//! ```

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::error::KafkaError;
use rdkafka::producer::FutureProducer;
use tokio::sync::OnceCell;
use tracing::{debug, instrument};

use crate::clock::{self, SharedClock};
use crate::config::{Config, Limits, TopicsConfig};
use crate::job::{truncate_to_millis, Job, JobId};
use crate::kafka;
use crate::wire::{self, DecodeError};

/// Why a write was not done.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The job would not be readable by a worker or the scheduler.
    #[error("job {id} is not valid: {reason}")]
    InvalidJob {
        /// The job's id.
        id: JobId,
        /// What is wrong with it.
        reason: DecodeError,
    },
    /// Kafka did not acknowledge the write (unknown topic, timeout, authorization, ...).
    #[error("writing to topic `{topic}` failed: {source}")]
    Kafka {
        /// The topic written to.
        topic: String,
        /// librdkafka's error.
        source: KafkaError,
    },
    /// The job's work topic does not exist.
    #[error("work topic `{topic}` does not exist")]
    UnknownTopic {
        /// The topic named by the job.
        topic: String,
    },
    /// The producer could not be created from the configuration.
    #[error("cannot create the Kafka producer: {0}")]
    Client(KafkaError),
}

impl ProduceError {
    /// Whether retrying cannot help: the job is invalid or its topic does not exist.
    pub fn is_permanent(&self) -> bool {
        match self {
            ProduceError::InvalidJob { .. } | ProduceError::UnknownTopic { .. } => true,
            ProduceError::Kafka { source, .. } => kafka::is_unknown_topic(source),
            ProduceError::Client(_) => false,
        }
    }
}

/// Writes jobs to Kafka. Cheap to clone; clones share one connection.
#[derive(Clone)]
pub struct Producer {
    /// The idempotent rdkafka producer every write goes through.
    inner: FutureProducer,
    /// Where the schedule topic is, and its name for cancels.
    topics: TopicsConfig,
    /// Jobs are checked against these before they are written, so nothing a
    /// consumer would dead-letter leaves this producer.
    limits: Limits,
    /// Decides whether a job is due now or goes through the scheduler.
    clock: SharedClock,
    /// Partition count of the schedule topic, learnt on the first cancel.
    schedule_partitions: std::sync::Arc<OnceCell<i32>>,
    /// Bound for metadata look-ups.
    metadata_timeout: Duration,
    /// Refuses jobs for work topics that do not exist.
    topic_check: kafka::TopicCheck,
    /// Work topics dispatched fairly: their jobs always go through the scheduler.
    fair_topics: Vec<String>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("schedule_topic", &self.topics.schedule)
            .finish_non_exhaustive()
    }
}

impl Producer {
    /// A producer from configuration, on the system clock.
    pub fn new(config: &Config) -> Result<Self, ProduceError> {
        let inner = kafka::producer(&config.kafka, "kairos-producer").map_err(ProduceError::Client)?;
        Self::from_parts(inner, config, clock::system())
    }

    /// A producer over an existing rdkafka producer and a given clock.
    pub fn from_parts(
        inner: FutureProducer,
        config: &Config,
        clock: SharedClock,
    ) -> Result<Self, ProduceError> {
        Ok(Producer {
            inner,
            topics: config.topics.clone(),
            limits: config.limits,
            clock,
            schedule_partitions: Default::default(),
            metadata_timeout: config.kafka.produce_timeout,
            topic_check: kafka::TopicCheck::new(&config.kafka).map_err(ProduceError::Client)?,
            fair_topics: config.fair.topics.clone(),
        })
    }

    /// Start writing `job`: await the result for the job id, or set its
    /// run-at first with [`Enqueue::at`] or [`Enqueue::after`].
    pub fn enqueue(&self, job: Job) -> Enqueue<'_> {
        Enqueue { producer: self, job }
    }

    /// The underlying rdkafka producer (for flushing, or for writing plain records).
    pub fn kafka(&self) -> &FutureProducer {
        &self.inner
    }

    #[instrument(skip_all, fields(job_id = %job.id, key = %job.key_lossy(), topic = %job.topic))]
    async fn write(&self, job: Job) -> Result<JobId, ProduceError> {
        let id = job.id;
        let (rec, due) = self.route(job).await?;
        let d = kafka::send(&self.inner, &rec, None)
            .await
            .map_err(|source| ProduceError::Kafka {
                topic: rec.topic.clone(),
                source,
            })?;
        debug!(due, partition = d.partition, offset = d.offset, destination = %rec.topic, "job written");
        Ok(id)
    }

    /// The record that writes `job` (to its work topic when due, else to
    /// the schedule topic), once the job is checked against the limits and
    /// its work topic is known to exist; and whether it is due.
    pub(crate) async fn route(&self, job: Job) -> Result<(wire::OwnedRecord, bool), ProduceError> {
        wire::check(&job, &self.limits).map_err(|reason| ProduceError::InvalidJob { id: job.id, reason })?;
        let exists = self
            .topic_check
            .exists(&job.topic)
            .await
            .map_err(|source| ProduceError::Kafka {
                topic: job.topic.clone(),
                source,
            })?;
        if !exists {
            return Err(ProduceError::UnknownTopic { topic: job.topic });
        }
        let due = job.is_due(self.clock.now()) && !self.fair_topics.contains(&job.topic);
        let destination = if due { &job.topic } else { &self.topics.schedule };
        Ok((wire::encode(&job, destination), due))
    }

    /// Ask the scheduler to drop the pending job `id`.
    ///
    /// The cancel is written to every partition of the schedule topic, so it
    /// reaches whichever partition holds the job, whatever its key, and it
    /// lands behind the job in that partition. A job that has already fired
    /// (or that was due when enqueued and went straight to its work topic)
    /// is not affected.
    #[instrument(skip(self), fields(job_id = %id))]
    pub async fn cancel(&self, id: JobId) -> Result<(), ProduceError> {
        let rec = wire::encode_cancel(id, &self.topics.schedule);
        self.broadcast(&rec).await
    }

    /// Move the pending job `id` to a new run-at. Like [`Producer::cancel`],
    /// it reaches the job wherever it is held, and does nothing to a job that
    /// has fired.
    #[instrument(skip(self), fields(job_id = %id))]
    pub async fn reschedule(&self, id: JobId, run_at: DateTime<Utc>) -> Result<(), ProduceError> {
        let rec = wire::encode_reschedule(id, truncate_to_millis(run_at), &self.topics.schedule);
        self.broadcast(&rec).await
    }

    async fn broadcast(&self, rec: &wire::OwnedRecord) -> Result<(), ProduceError> {
        let kafka_err = |source| ProduceError::Kafka {
            topic: self.topics.schedule.clone(),
            source,
        };
        let n = *self
            .schedule_partitions
            .get_or_try_init(|| {
                kafka::partition_count(&self.inner, &self.topics.schedule, self.metadata_timeout)
            })
            .await
            .map_err(kafka_err)?;
        let sends = (0..n).map(|p| kafka::send(&self.inner, rec, Some(p)));
        for r in futures::future::join_all(sends).await {
            r.map_err(kafka_err)?;
        }
        Ok(())
    }
}

/// A pending write of one job; `.await` it to get the job id.
#[must_use = "an Enqueue does nothing until awaited"]
pub struct Enqueue<'a> {
    /// Where the job will be written.
    producer: &'a Producer,
    /// The job, with its run-at as set so far.
    job: Job,
}

impl Enqueue<'_> {
    /// Run the job no earlier than `when`.
    pub fn at(mut self, when: DateTime<Utc>) -> Self {
        self.job = self.job.at(when);
        self
    }

    /// Run the job no earlier than `delay` from now (by the producer's clock).
    pub fn after(self, delay: Duration) -> Self {
        let now = self.producer.clock.now();
        let when = chrono::Duration::from_std(delay)
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        self.at(when)
    }
}

impl<'a> IntoFuture for Enqueue<'a> {
    type Output = Result<JobId, ProduceError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.producer.write(self.job))
    }
}
