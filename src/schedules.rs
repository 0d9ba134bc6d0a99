//! Recurring schedules: a job written again and again on a cron pattern or
//! at a fixed interval, in a time zone.
//!
//! A schedule's definition is a JSON record in the schedules topic
//! (`[topics] schedules`, compacted), keyed by the schedule's id; a
//! tombstone deletes it. Any Kafka client can write one; [`Schedules`]
//! does it from Rust, the CLI from a shell (`kairos schedules`).
//!
//! The scheduler instance that owns schedule partition N owns the
//! schedules in partition N of that topic: it alone enqueues their
//! occurrences, each as a job whose id derives from the schedule's id and
//! the occurrence's nominal time ([`occurrence_id`]), `lead` before its
//! time, and records the last occurrence enqueued (its cursor) in the
//! cursors topic (`[topics] schedule_cursors`). In exactly-once mode the
//! occurrence and the cursor commit in one transaction; otherwise a crash
//! between them enqueues the occurrence again, under the same id.
//!
//! ```
//! use kairos::schedules::{JobTemplate, Schedule};
//!
//! let mut nightly = Schedule::cron("nightly-report", "0 30 2 * * *", JobTemplate::new("kairos.jobs", "report"));
//! nightly.time_zone = "Europe/Berlin".into();
//! let plan = nightly.compile().unwrap();
//! let after = "2026-03-28T12:00:00Z".parse().unwrap();
//! // 02:30 does not exist in Berlin on 29 March 2026 (clocks go from 02:00
//! // to 03:00): the occurrence is the first instant after the gap.
//! assert_eq!(plan.next_after(after).unwrap().to_rfc3339(), "2026-03-29T01:00:00+00:00");
//! ```

mod client;
mod occurrence;
mod plan;
mod recurrence;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

pub use client::{
    cursor_record, decode_cursor, Backfill, Cursor, ScheduleView, Schedules, SchedulesError, BACKFILL_SUFFIX,
};
pub use occurrence::{occurrence_id, occurrence_job, OCCURRENCE_NAMESPACE};
pub use plan::{backfill, plan, Plan, PlanInput};
pub use recurrence::Recurrence;

use crate::job::Priority;

/// The longest schedule id accepted, in bytes.
pub const MAX_ID_BYTES: usize = 200;

/// The most missed occurrences one schedule runs at once ([`Misfire::All`]).
pub const MAX_CATCH_UP: u32 = 1000;

/// The largest payload of an occurrence's job (Kafka's default record
/// limit is 1 MiB, headers and key included).
pub const MAX_PAYLOAD_BYTES: usize = 512 * 1024;

/// The longest key of an occurrence's job (the wire's default limit).
pub const MAX_KEY_BYTES: usize = 4096;

/// A recurring schedule's definition (the value of its record in the
/// schedules topic, as JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Schedule {
    /// Its id (the record's key): printable, at most [`MAX_ID_BYTES`].
    pub id: String,
    /// A cron pattern: five fields, or six with seconds first; `L`, `W`
    /// and `#` as in croner. Exactly one of `cron` and `every`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    /// A fixed interval (`"30s"`, `"1h"`), counted from `start` (or from
    /// the Unix epoch), so occurrences never drift. Follows real elapsed
    /// time, whatever the time zone.
    #[serde(default, with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub every: Option<Duration>,
    /// The IANA time zone a cron pattern is read in (`"Europe/Berlin"`).
    #[serde(default = "utc")]
    pub time_zone: String,
    /// No occurrence before this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<DateTime<Utc>>,
    /// No occurrence after this time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<DateTime<Utc>>,
    /// Each occurrence runs up to this long after its time (the same delay
    /// for the same occurrence on every instance).
    #[serde(default, with = "humantime_serde")]
    pub jitter: Duration,
    /// What happens to occurrences missed while no scheduler could enqueue them.
    #[serde(default)]
    pub misfire: Misfire,
    /// Missed occurrences older than this are dropped whatever the policy.
    #[serde(default = "default_catch_up", with = "humantime_serde")]
    pub catch_up: Duration,
    /// With [`Misfire::All`], at most this many missed occurrences run (the latest).
    #[serde(default = "default_max_catch_up")]
    pub max_catch_up: u32,
    /// Whether occurrences may run side by side.
    #[serde(default)]
    pub overlap: Overlap,
    /// Paused: no occurrence is enqueued until resumed.
    #[serde(default)]
    pub paused: bool,
    /// Why it is paused (or anything an operator wants to say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// When it was last resumed: occurrences before this time are not
    /// caught up (set by [`Schedules::resume`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_at: Option<DateTime<Utc>>,
    /// The job each occurrence enqueues.
    pub job: JobTemplate,
}

/// What to do with occurrences missed (their time passed while no
/// scheduler could enqueue them). Dropped occurrences are counted
/// (`kairos_schedule_occurrences_dropped_total`) and logged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Misfire {
    /// Every missed occurrence within `catch_up`, at most `max_catch_up`.
    All,
    /// Only the latest missed occurrence within `catch_up`.
    #[default]
    Latest,
    /// None: the schedule goes on from the next occurrence.
    None,
}

/// Whether an occurrence may start while the previous one still runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Overlap {
    /// Occurrences share the job's key, so workers run them one after the
    /// other, in order (the key-order guarantee).
    #[default]
    Queue,
    /// Occurrences share the job's key, and one that a worker reads while
    /// an earlier job of the key is running or waiting there is skipped
    /// (not run, counted in `kairos_worker_skipped`): a slow run makes the
    /// schedule miss occurrences instead of piling them up.
    Skip,
    /// Each occurrence gets a key of its own (`<key>@<nominal ms>`): they
    /// may run side by side.
    Parallel,
}

/// The job an occurrence enqueues.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct JobTemplate {
    /// The work topic it runs from.
    pub topic: String,
    /// Its entity key; the schedule's id when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Its payload, as text (not empty: Kairos refuses a job without one).
    pub payload: String,
    /// Its tenant (fair topics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its priority (fair topics).
    #[serde(default)]
    pub priority: Priority,
    /// How many tries it gets; the worker's setting when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
    /// Headers of its record (names must not start with `kairos-`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl JobTemplate {
    /// A job for work topic `topic` with `payload`, keyed by the schedule id.
    pub fn new(topic: impl Into<String>, payload: impl Into<String>) -> JobTemplate {
        JobTemplate {
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            tenant: None,
            priority: Priority::Normal,
            max_attempts: None,
            headers: BTreeMap::new(),
        }
    }
}

/// Why a schedule definition is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScheduleError {
    /// The id is empty, too long or not printable.
    #[error("schedule id must be 1 to {MAX_ID_BYTES} printable bytes")]
    Id,
    /// Neither or both of `cron` and `every`.
    #[error("a schedule needs exactly one of `cron` and `every`")]
    Recurrence,
    /// The cron pattern does not parse.
    #[error("cron pattern `{pattern}`: {reason}")]
    Cron {
        /// The pattern.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The interval is shorter than a second.
    #[error("`every` must be at least 1s")]
    Every,
    /// Not an IANA time zone.
    #[error("unknown time zone `{0}` (an IANA name such as `Europe/Berlin`)")]
    TimeZone(String),
    /// `end` is not after `start`.
    #[error("`end` must be after `start`")]
    Window,
    /// Something else about the job template or the policies.
    #[error("{0}")]
    Invalid(String),
    /// The record's value is not a schedule.
    #[error("not a schedule definition: {0}")]
    Json(String),
}

fn utc() -> String {
    "UTC".into()
}

fn default_catch_up() -> Duration {
    Duration::from_secs(3600)
}

fn default_max_catch_up() -> u32 {
    100
}

impl Schedule {
    /// A schedule on cron pattern `pattern` (UTC), enqueuing `job`.
    pub fn cron(id: impl Into<String>, pattern: impl Into<String>, job: JobTemplate) -> Schedule {
        Schedule::with(id.into(), Some(pattern.into()), None, job)
    }

    /// A schedule every `period`, counted from the Unix epoch, enqueuing `job`.
    pub fn every(id: impl Into<String>, period: Duration, job: JobTemplate) -> Schedule {
        Schedule::with(id.into(), None, Some(period), job)
    }

    fn with(id: String, cron: Option<String>, every: Option<Duration>, job: JobTemplate) -> Schedule {
        Schedule {
            id,
            cron,
            every,
            time_zone: utc(),
            start: None,
            end: None,
            jitter: Duration::ZERO,
            misfire: Misfire::default(),
            catch_up: default_catch_up(),
            max_catch_up: default_max_catch_up(),
            overlap: Overlap::default(),
            paused: false,
            note: None,
            resumed_at: None,
            job,
        }
    }

    /// Check the definition and parse its recurrence.
    pub fn compile(&self) -> Result<Recurrence, ScheduleError> {
        check_id(&self.id)?;
        if self.job.topic.is_empty() {
            return Err(ScheduleError::Invalid("`job.topic` is empty".into()));
        }
        if self.job.payload.is_empty() {
            return Err(ScheduleError::Invalid(
                "`job.payload` is empty (a job carries a payload)".into(),
            ));
        }
        if let Some(name) = self
            .job
            .headers
            .keys()
            .find(|n| n.starts_with(crate::wire::PREFIX))
        {
            return Err(ScheduleError::Invalid(format!(
                "header `{name}`: names starting with `kairos-` are Kairos's own"
            )));
        }
        if self.job.max_attempts == Some(0) {
            return Err(ScheduleError::Invalid(
                "`job.max_attempts` must be at least 1".into(),
            ));
        }
        if matches!(self.job.key.as_deref(), Some("")) {
            return Err(ScheduleError::Invalid(
                "`job.key` is empty (leave it out to use the id)".into(),
            ));
        }
        if let (Some(s), Some(e)) = (self.start, self.end) {
            if e <= s {
                return Err(ScheduleError::Window);
            }
        }
        let year = Duration::from_secs(366 * 24 * 3600);
        for (name, d, most) in [
            ("catch_up", self.catch_up, year),
            ("jitter", self.jitter, Duration::from_secs(24 * 3600)),
            ("every", self.every.unwrap_or_default(), year),
        ] {
            if d > most {
                return Err(ScheduleError::Invalid(format!(
                    "`{name}` is at most {}",
                    humantime::format_duration(most)
                )));
            }
        }
        if self.max_catch_up > MAX_CATCH_UP {
            return Err(ScheduleError::Invalid(format!(
                "`max_catch_up` is at most {MAX_CATCH_UP}"
            )));
        }
        if self.job.payload.len() > MAX_PAYLOAD_BYTES || self.key().len() > MAX_KEY_BYTES {
            return Err(ScheduleError::Invalid(format!(
                "the job's payload is at most {MAX_PAYLOAD_BYTES} bytes and its key {MAX_KEY_BYTES}"
            )));
        }
        if self.catch_up.is_zero() && self.misfire != Misfire::None {
            return Err(ScheduleError::Invalid(
                "`catch_up` must be above zero unless `misfire` is `none`".into(),
            ));
        }
        Recurrence::new(self)
    }

    /// The definition as the schedules topic holds it.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a schedule serialises")
    }

    /// A definition read from the schedules topic (checked with [`Schedule::compile`]).
    pub fn from_json(bytes: &[u8]) -> Result<(Schedule, Recurrence), ScheduleError> {
        let s: Schedule = serde_json::from_slice(bytes).map_err(|e| ScheduleError::Json(e.to_string()))?;
        let r = s.compile()?;
        Ok((s, r))
    }

    /// A digest of the definition's content: writing the same definition
    /// twice changes nothing.
    pub fn version(&self) -> u64 {
        crate::job::fnv1a(crate::job::FNV_OFFSET, self.to_json().iter()) as u64
    }

    /// The job's entity key.
    pub fn key(&self) -> &str {
        self.job.key.as_deref().unwrap_or(&self.id)
    }
}

/// Check a schedule id.
pub fn check_id(id: &str) -> Result<(), ScheduleError> {
    if id.is_empty() || id.len() > MAX_ID_BYTES || id.chars().any(char::is_control) {
        return Err(ScheduleError::Id);
    }
    Ok(())
}
