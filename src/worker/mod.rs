//! The worker library: run jobs in parallel across keys, one at a time per
//! key, in the order they were written, without losing any.
//!
//! Parts:
//! - `handler`: the handler trait, [`Outcome`], [`JobContext`], backoff.
//! - `lock_table`: per-key FIFOs, one running job per key.
//! - `hold`: held keys: a failing (or long-paced) job holds its key, its
//!   later jobs are parked through the scheduler and come back in order.
//! - `offset_tracker`: commit only below the first unfinished job.
//! - `pacing`: per limiter key, turns by a minimum spacing and a rate with
//!   a burst.
//! - `service`: the consumer-group member that ties them together.
//! - `settle`: what an outcome means (another attempt, a dead letter,
//!   follow-ups) and writing it; the same rules in a running worker and in a
//!   [`TestWorker`].
//! - `testing`: [`TestWorker`], handlers run without a broker, for tests.
//!
//! # Guarantees
//!
//! A job's offset is committed only after its outcome is acknowledged by
//! Kafka (follow-ups written, retry scheduled, or dead letter written). A
//! worker that dies loses nothing: its partitions' uncommitted jobs are
//! re-delivered to their next owner (the consumer-group membership is the
//! lease). Re-delivery is why a job can run more than once: jobs after the
//! first unfinished one of a partition may have finished already. The job
//! id is the same every time, so handlers deduplicate on it.
//!
//! Two jobs of one key never run at the same time: within a worker the lock
//! table holds them apart; across workers, a revoked partition is released
//! only after its running handlers finished, provided they finish (or
//! honour their cancellation token) within `revocation_deadline`. A handler
//! that runs past it may overlap with the key's next job on the new owner.

mod handler;
pub(crate) mod hold;
pub(crate) mod lock_table;
pub(crate) mod offset_tracker;
pub(crate) mod pacing;
mod service;
mod settle;
mod testing;

pub(crate) use handler::panic_message;
pub use handler::{Backoff, Handler, HandlerFuture, JobContext, Outcome};
pub use hold::Cause as HoldCause;
pub use service::{Worker, WorkerBuilder, WorkerError, WorkerHandle, WorkerStats};
pub use settle::Settled;
pub use testing::{Run, TestWorker, Written};
