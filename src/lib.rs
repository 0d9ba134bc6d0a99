//! Kairos: a delayed-scheduling job queue on Apache Kafka.
//!
//! Producers write jobs keyed by entity to Kafka topics. Jobs due now go
//! straight to a work topic; future-dated ones go to the schedule topic,
//! where a scheduler holds them on disk and fires them at their run-at.
//! Workers run jobs in parallel across keys and one at a time per key.
//!
//! # Layout
//!
//! - [`job`]: the [`Job`] and its [`JobId`].
//! - [`wire`]: the wire contract, a job as a Kafka record (key, value,
//!   `kairos-*` headers); decoding errors name the header and the reason.
//! - [`admin`]: the admin endpoint of a scheduler or a worker (`/metrics`,
//!   `/healthz`, `/readyz`, `/status`).
//! - [`clock`]: injected time, so tests drive the clock instead of sleeping.
//! - [`hash`]: hash maps with a fast, randomly seeded hasher.
//! - [`config`]: TOML configuration with `KAIROS_...` environment overrides.
//! - [`kafka`]: the one place rdkafka clients are built from configuration.
//! - [`overview`]: `kairos stats`, where jobs stand, read from Kafka.
//! - [`producer`]: enqueue now, `at` a time or `after` a delay; cancel and
//!   reschedule.
//! - [`topics`]: `kairos topics init`.
//! - [`scheduler`]: the scheduler service: sled store, timer wheel,
//!   changelog, ingest and dispatch.
//! - [`worker`]: the worker library: lock table, offset tracker, retries,
//!   dead letters, follow-ups, rebalances.
//! - [`dlq`]: the dead-letter topic for operators: list, replay.
//! - [`keys`]: keys held by workers, for operators: list, release.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod clock;
pub mod config;
pub mod dlq;
#[doc(hidden)]
pub mod hash;
pub mod job;
pub mod kafka;
pub mod keys;
pub mod overview;
pub mod producer;
pub mod scheduler;
pub mod schedules;
mod sync;
pub mod topics;
pub mod wire;
pub mod worker;

/// The README's Rust examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The Rust examples of `docs/recurring-schedules.md`, as doc tests.
#[doc = include_str!("../docs/recurring-schedules.md")]
#[cfg(doctest)]
pub struct RecurringSchedulesDoctests;

pub use clock::{Clock, ManualClock, SystemClock};
pub use config::{Config, ConfigError};
pub use job::{Job, JobId, Priority};
pub use producer::{Enqueue, ProduceError, Producer};
pub use scheduler::Scheduler;
pub use wire::{DecodeError, Limits};
pub use worker::{Outcome, TestWorker, Worker};
