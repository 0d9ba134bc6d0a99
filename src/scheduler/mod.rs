//! The scheduler service: holds future-dated jobs on disk and fires each into
//! its work topic at its run-at.
//!
//! Parts:
//! - [`stored`]: a job's bytes at rest (sled and changelog).
//! - [`store`]: the sled store of pending jobs, ordered by run-at (one file
//!   per concern: keys, buckets, chunk codec, near runs, id hints, batch
//!   overlay, cascade, compaction, checkpoint, and its private value log).
//! - [`timer_wheel`]: the in-memory window over the near future; it never
//!   touches the store: [`refill`] reads for it, outside its lock.
//! - `changelog`: the compacted changelog that hands a partition's state
//!   to its next owner.
//! - `direct`: commit offsets of jobs already due on arrival, which fire
//!   from memory without touching the store or the changelog.
//! - `instance`: the instance's stable id in its group (static membership).
//! - `caught_up`: how far each schedule partition has been read, in time;
//!   a job fires only once its partition is read up to its run-at.
//! - `service`: ingest (consume, persist, commit), dispatch (fire on time)
//!   and partition moves.
//!
//! # Guarantees
//!
//! A cancel, reschedule or replace whose write was acknowledged before the
//! job's run-at takes effect: a job fires only once every record written
//! to its schedule partition before its run-at has been ingested (checked
//! against the partition's end offset, or a newer record's timestamp less
//! `max_clock_skew`). A cancel or reschedule that meets its job being
//! fired is too late (the job fires as it was; counted in
//! `SchedulerStats::too_late`); one read after the fire finds nothing to change. A
//! job put again under its id while it fires (a worker's retry) is a new
//! job.
//!
//! A record of the schedule topic is committed only once its effect is in
//! the local store (flushed to disk) *and* in the changelog (acknowledged by
//! Kafka), or, for a job already due on arrival that fires straight from
//! memory, once its work-topic write was acknowledged. A job is deleted
//! only after its work-topic write was acknowledged. So no job is lost when
//! a scheduler is killed at any moment.
//!
//! A job can fire twice when the scheduler dies after the work-topic write was
//! acknowledged and before the deletion reached the changelog and the store,
//! or when a partition moves in that window; a job fired straight from memory
//! fires twice when the scheduler dies (or the partition moves) after its
//! write was acknowledged and before its schedule offset was committed. The
//! job id is the same both times, so handlers deduplicate on it.

pub(crate) mod caught_up;
pub(crate) mod changelog;
pub(crate) mod instance;
mod service;
// Not part of the API: public (and hidden from the docs) for the benchmarks,
// which measure the store and the window on their own.
#[doc(hidden)]
pub mod fair;
#[doc(hidden)]
pub mod refill;
#[doc(hidden)]
pub mod store;
#[doc(hidden)]
pub mod stored;
#[doc(hidden)]
pub mod timer_wheel;

pub use changelog::RebuildError;
pub use instance::InstanceIdError;
pub use service::{Scheduler, SchedulerBuilder, SchedulerError, SchedulerHandle, SchedulerStats, DUE_SPANS};
