//! The wire contract: how a [`Job`] travels as a Kafka record.
//!
//! Record key = entity key, record value = payload, metadata in headers whose
//! names start with `kairos-`. Any Kafka client can write a job by setting
//! these headers (see the README's "Wire contract"); a record with no headers
//! at all is a valid job on a work topic.
//!
//! | header | value | default when absent |
//! |---|---|---|
//! | `kairos-version` | `1` | `1` |
//! | `kairos-id` | a UUID (text) | derived from topic, partition, offset and timestamp |
//! | `kairos-run-at` | RFC 3339 time, or integer milliseconds since the Unix epoch | due now |
//! | `kairos-topic` | work topic to run from | the record's own topic (required on the schedule topic) |
//! | `kairos-attempt` | integer ≥ 1 | `1` |
//! | `kairos-max-attempts` | integer ≥ 1 | the worker's setting |
//! | `kairos-tenant` | text | none |
//! | `kairos-priority` | `high`, `normal` or `low` | `normal` |
//! | `kairos-early` | integer milliseconds, 1 to 30 days: how long before its run-at the job may run when workers are idle | never early |
//! | `kairos-last-error` | text | none |
//! | `kairos-limit-key` | bytes: the key the job is paced under (`[worker.pacing]`) | its entity key |
//! | `kairos-parked` | integer 1 to 2^64 − 1, set by workers only: the job was parked behind its held key (its park number; schedulers read numbers above 2^32 − 1 from this version on: upgrade schedulers before workers) | not parked |
//! | `kairos-op` | `schedule`, `cancel` or `reschedule` (schedule topic); `release` (work topic: `kairos keys release`) | `schedule` |
//!
//! Decoding never panics; every problem is a [`DecodeError`] naming the
//! header and the reason, which goes into the dead-letter record.

use std::panic::{catch_unwind, AssertUnwindSafe};

use chrono::{DateTime, Datelike, SecondsFormat, TimeZone, Utc};
use rdkafka::message::{Headers, Message};

use crate::job::{HeaderList, Job, JobId};

mod dead;
mod decode;
mod encode;
mod error;
#[cfg(test)]
mod tests;

pub use dead::{dead_job_record, dead_letter_record, DeadLetter};
pub use decode::{check, decode, decode_job};
pub use encode::{encode, encode_cancel, encode_release, encode_reschedule, kafka_headers};
pub use error::{DecodeError, HeaderProblem};

/// Prefix of every header that belongs to Kairos. Names are matched in lower
/// case; a header whose lower-cased name starts with this prefix but is not
/// one of the names below is rejected, so a typo such as `kairos-runat`
/// cannot silently make a delayed job run at once.
pub const PREFIX: &str = "kairos-";

/// The longest early-start allowance accepted (`kairos-early`), in ms: 30 days.
pub const MAX_EARLY_MS: u64 = 30 * 86_400_000;

/// The wire contract version this build writes and reads.
pub const VERSION: &str = "1";

/// Header names of the wire contract.
pub mod header {
    /// Wire contract version.
    pub const VERSION: &str = "kairos-version";
    /// Job id (UUID text).
    pub const ID: &str = "kairos-id";
    /// Earliest run time: RFC 3339 or epoch milliseconds.
    pub const RUN_AT: &str = "kairos-run-at";
    /// Work topic the job runs from.
    pub const TOPIC: &str = "kairos-topic";
    /// Attempt number, from 1.
    pub const ATTEMPT: &str = "kairos-attempt";
    /// Attempts allowed before the job is dead-lettered.
    pub const MAX_ATTEMPTS: &str = "kairos-max-attempts";
    /// Tenant for fair dispatch.
    pub const TENANT: &str = "kairos-tenant";
    /// Priority class for fair dispatch: `high`, `normal`, `low`.
    pub const PRIORITY: &str = "kairos-priority";
    /// How long before its run-at the job may run (integer ms).
    pub const EARLY: &str = "kairos-early";
    /// Error of the previous attempt.
    pub const LAST_ERROR: &str = "kairos-last-error";
    /// The key a job is paced under (default: its entity key).
    pub const LIMIT_KEY: &str = "kairos-limit-key";
    /// Set by workers: the job was parked behind its held key (park sequence).
    pub const PARKED: &str = "kairos-parked";
    /// What a worker does with a first attempt that arrives while a job of
    /// its key is running or waiting there: `queue` (the default: it waits
    /// its turn) or `skip` (it is settled without running, counted as
    /// skipped). Recurring schedules with `overlap = "skip"` set it.
    pub const IF_BUSY: &str = "kairos-if-busy";
    /// Operation: `schedule`, `cancel`, `reschedule` (schedule topic),
    /// `release` (work topic).
    pub const OP: &str = "kairos-op";
    /// Dead letters: why the record was dead-lettered.
    pub const DEAD_REASON: &str = "kairos-dead-reason";
    /// Dead letters: the topic the record was read from.
    pub const ORIGIN_TOPIC: &str = "kairos-origin-topic";
    /// Dead letters: the partition the record was read from.
    pub const ORIGIN_PARTITION: &str = "kairos-origin-partition";
    /// Dead letters: the offset the record was read from.
    pub const ORIGIN_OFFSET: &str = "kairos-origin-offset";
    /// Dead letters: what was cut to fit (`key`, `payload` or `key,payload`);
    /// the whole record stays at its origin offset.
    pub const DEAD_TRUNCATED: &str = "kairos-dead-truncated";

    /// Every name of the contract, in the order they are written.
    pub const ALL: [&str; 19] = [
        VERSION,
        ID,
        RUN_AT,
        TOPIC,
        ATTEMPT,
        MAX_ATTEMPTS,
        TENANT,
        PRIORITY,
        EARLY,
        LAST_ERROR,
        LIMIT_KEY,
        PARKED,
        IF_BUSY,
        OP,
        DEAD_REASON,
        ORIGIN_TOPIC,
        ORIGIN_PARTITION,
        ORIGIN_OFFSET,
        DEAD_TRUNCATED,
    ];
}

/// Size limits applied while decoding. Records beyond them are dead-lettered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Longest entity key accepted, in bytes.
    pub max_key_bytes: usize,
    /// Longest payload accepted, in bytes.
    pub max_payload_bytes: usize,
    /// Whether a record with an empty (or null) value is a valid job.
    pub allow_empty_payload: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_bytes: 4096,
            max_payload_bytes: 1_000_000,
            allow_empty_payload: false,
        }
    }
}

/// A Kafka record as Kairos reads it: borrowed, with its coordinates.
#[derive(Clone, Debug, Default)]
pub struct RecordView<'a> {
    /// Topic the record was read from.
    pub topic: &'a str,
    /// Partition the record was read from.
    pub partition: i32,
    /// Offset of the record.
    pub offset: i64,
    /// Record timestamp in epoch milliseconds, when the broker gave one.
    pub timestamp_ms: Option<i64>,
    /// Record key.
    pub key: Option<&'a [u8]>,
    /// Record value.
    pub value: Option<&'a [u8]>,
    /// Headers in record order, less any whose name is not UTF-8.
    pub headers: Vec<(&'a str, Option<&'a [u8]>)>,
    /// Index of the first header whose name is not UTF-8; such a record
    /// does not decode ([`DecodeError::HeaderNameNotUtf8`]).
    pub unreadable_header: Option<usize>,
}

impl<'a> RecordView<'a> {
    /// View an rdkafka message. rdkafka panics on a header name that is
    /// not UTF-8; that panic is caught here, the header is left out and
    /// noted in `unreadable_header`, so that a hostile producer cannot crash
    /// a consumer and the rest of the record still reaches the dead-letter topic.
    pub fn from_message<M: Message>(m: &'a M) -> Self {
        let mut headers = Vec::new();
        let mut unreadable_header = None;
        if let Some(hs) = m.headers() {
            headers.reserve_exact(hs.count());
            for i in 0..hs.count() {
                match catch_unwind(AssertUnwindSafe(|| hs.try_get(i))) {
                    Ok(Some(h)) => headers.push((h.key, h.value)),
                    Ok(None) => {}
                    Err(_) => {
                        unreadable_header.get_or_insert(i);
                    }
                }
            }
        }
        RecordView {
            topic: m.topic(),
            partition: m.partition(),
            offset: m.offset(),
            timestamp_ms: m.timestamp().to_millis(),
            key: m.key(),
            value: m.payload(),
            headers,
            unreadable_header,
        }
    }
}

/// An owned record ready to produce: key, value and headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedRecord {
    /// Destination topic.
    pub topic: String,
    /// Record key.
    pub key: Vec<u8>,
    /// Record value (`None` for a tombstone).
    pub value: Option<Vec<u8>>,
    /// Headers in order.
    pub headers: HeaderList,
}

impl OwnedRecord {
    /// The rdkafka header list for this record.
    pub fn kafka_headers(&self) -> rdkafka::message::OwnedHeaders {
        let mut out = rdkafka::message::OwnedHeaders::new_with_capacity(self.headers.len());
        for (k, v) in &self.headers {
            out = out.insert(rdkafka::message::Header {
                key: k,
                value: v.as_deref(),
            });
        }
        out
    }

    /// This record as a consumer would see it at `partition` and `offset`
    /// (tests and the fuzz targets decode records this way).
    pub fn view(&self, partition: i32, offset: i64, timestamp_ms: Option<i64>) -> RecordView<'_> {
        RecordView {
            topic: &self.topic,
            partition,
            offset,
            timestamp_ms,
            key: Some(&self.key),
            value: self.value.as_deref(),
            headers: self
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_deref()))
                .collect(),
            unreadable_header: None,
        }
    }

    /// The value of the first header named `name`, if any.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| v.as_deref())
    }
}

/// What a record asks for: on the schedule topic, of the scheduler; on a
/// work topic, of the worker (a job, or a key's release).
///
/// Nearly every record is a job: boxing it to shrink the rare variants
/// would cost an allocation per job decoded.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// Hold the job until its run-at, then fire it into its work topic.
    Schedule(Job),
    /// Drop the pending job with this id, if the scheduler still holds it.
    Cancel(JobId),
    /// Move the pending job with this id to a new run-at.
    Reschedule {
        /// The job to move.
        id: JobId,
        /// Its new run-at.
        run_at: DateTime<Utc>,
    },
    /// Work topic: release the key held by the job `id` (`kairos keys
    /// release`): the job is dead-lettered and the key's later jobs run.
    Release {
        /// The held key (the record's key).
        key: Vec<u8>,
        /// The job holding it.
        id: JobId,
    },
}

/// Where a record is read, which decides what it may contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    /// A work topic: jobs, and key releases; `kairos-topic` defaults to the
    /// record's topic.
    Work,
    /// The schedule topic: jobs (with a required `kairos-topic`), cancels, reschedules.
    Schedule,
}

/// Format a time as the contract writes it: RFC 3339, UTC, milliseconds.
/// A time outside the years 0000 to 9999, which RFC 3339 cannot write (a
/// record timestamp or epoch milliseconds can name one), is written as
/// integer epoch milliseconds, so that it reads back as the same time.
pub fn format_time(t: DateTime<Utc>) -> String {
    if (0..=9999).contains(&t.year()) {
        t.to_rfc3339_opts(SecondsFormat::Millis, true)
    } else {
        t.timestamp_millis().to_string()
    }
}

/// Parse a time as the contract reads it: RFC 3339 (any offset) or integer
/// milliseconds since the Unix epoch (negative allowed).
pub fn parse_time(text: &str) -> Result<DateTime<Utc>, HeaderProblem> {
    let text = text.trim();
    if let Ok(ms) = text.parse::<i64>() {
        return Utc
            .timestamp_millis_opt(ms)
            .single()
            .ok_or_else(|| HeaderProblem::TimeOutOfRange(text.to_string()));
    }
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit() || b == b'-' || b == b'+') {
        // All digits but does not fit in i64.
        return Err(HeaderProblem::TimeOutOfRange(text.to_string()));
    }
    DateTime::parse_from_rfc3339(text)
        .map(|t| crate::job::truncate_to_millis(t.with_timezone(&Utc)))
        .map_err(|_| HeaderProblem::BadTime(text.to_string()))
}
