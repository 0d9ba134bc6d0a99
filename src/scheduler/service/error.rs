//! Why the scheduler stopped.

use rdkafka::error::KafkaError;

use crate::scheduler::changelog;
use crate::scheduler::store::StoreError;

/// Why the scheduler stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerError {
    /// The store failed; the scheduler stops rather than acknowledge a job
    /// it could not keep.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A Kafka client could not be created or subscribed.
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    /// A partition could not be rebuilt from its changelog.
    #[error(transparent)]
    Rebuild(#[from] changelog::RebuildError),
    /// The instance's stable id could not be read or kept.
    #[error(transparent)]
    InstanceId(#[from] crate::scheduler::instance::InstanceIdError),
    /// The admin endpoint could not listen.
    #[error(transparent)]
    Admin(#[from] crate::admin::AdminError),
    /// The ingest thread ended abnormally.
    #[error("scheduler stopped: {0}")]
    Fatal(String),
}
