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
//! | `kairos-last-error` | text | none |
//! | `kairos-op` | `schedule`, `cancel` or `reschedule` (schedule topic only) | `schedule` |
//!
//! Decoding never panics; every problem is a [`DecodeError`] naming the
//! header and the reason, which goes into the dead-letter record.

use std::panic::{catch_unwind, AssertUnwindSafe};

use chrono::{DateTime, Datelike, SecondsFormat, TimeZone, Utc};
use rdkafka::message::{Headers, Message};

use crate::job::{HeaderList, Job, JobId};

/// Prefix of every header that belongs to Kairos. Names are matched in lower
/// case; a header whose lower-cased name starts with this prefix but is not
/// one of the names below is rejected, so a typo such as `kairos-runat`
/// cannot silently make a delayed job run at once.
pub const PREFIX: &str = "kairos-";

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
    /// Error of the previous attempt.
    pub const LAST_ERROR: &str = "kairos-last-error";
    /// Operation on the schedule topic: `schedule`, `cancel`, `reschedule`.
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
    pub const ALL: [&str; 14] = [
        VERSION,
        ID,
        RUN_AT,
        TOPIC,
        ATTEMPT,
        MAX_ATTEMPTS,
        TENANT,
        LAST_ERROR,
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

/// What is wrong with one header's value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderProblem {
    /// The header is present with a null value.
    #[error("has no value")]
    NoValue,
    /// The value must be UTF-8 text and is not.
    #[error("is not valid UTF-8")]
    NotUtf8,
    /// The value is empty text where text is required.
    #[error("is empty")]
    Empty,
    /// The value is not a time in either accepted form.
    #[error("`{0}` is neither an RFC 3339 time nor integer epoch milliseconds")]
    BadTime(String),
    /// The time is outside the representable range.
    #[error("`{0}` is outside the supported time range")]
    TimeOutOfRange(String),
    /// The value is not an integer.
    #[error("`{0}` is not an integer")]
    NotAnInteger(String),
    /// The integer is below the minimum.
    #[error("`{value}` is less than {min}")]
    TooSmall {
        /// The value found.
        value: i128,
        /// The smallest value allowed.
        min: u32,
    },
    /// The integer is above the maximum.
    #[error("`{0}` is larger than {max}", max = u32::MAX)]
    TooLarge(String),
    /// The value is not a UUID.
    #[error("`{0}` is not a UUID")]
    NotAUuid(String),
    /// A topic name with leading or trailing white space.
    #[error("`{0}` has leading or trailing white space")]
    BadTopic(String),
    /// The operation is not one of the known ones.
    #[error("`{0}` is not one of schedule, cancel, reschedule")]
    UnknownOp(String),
}

/// Why a record is not a valid job. Each variant names what is wrong; the
/// `Display` text is what the dead-letter record carries as its reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// No record key: the key is the job's entity key.
    #[error("record has no key (the key is the job's entity key)")]
    MissingKey,
    /// The key is longer than [`Limits::max_key_bytes`].
    #[error("key is {len} bytes, more than the limit of {max}")]
    KeyTooLarge {
        /// Key length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The value is empty and [`Limits::allow_empty_payload`] is off.
    #[error("record has an empty payload")]
    EmptyPayload,
    /// The value is longer than [`Limits::max_payload_bytes`].
    #[error("payload is {len} bytes, more than the limit of {max}")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A header's value is wrong.
    #[error("header `{name}` {problem}")]
    BadHeader {
        /// The header's name.
        name: &'static str,
        /// What is wrong with it.
        problem: HeaderProblem,
    },
    /// A Kairos header appears more than once.
    #[error("header `{0}` appears more than once")]
    DuplicateHeader(&'static str),
    /// A header starts with `kairos-` but is not part of the contract.
    #[error("header `{0}` starts with `kairos-` but is not part of the wire contract")]
    UnknownHeader(String),
    /// A header's name is not UTF-8.
    #[error("header #{0} has a name that is not valid UTF-8")]
    HeaderNameNotUtf8(usize),
    /// A header the context requires is missing.
    #[error("header `{name}` is required {context}")]
    MissingHeader {
        /// The header's name.
        name: &'static str,
        /// Where it is required.
        context: &'static str,
    },
    /// The record speaks a contract version this build does not know.
    #[error("wire contract version `{0}` is not supported (this build reads version 1)")]
    UnknownVersion(String),
    /// An operation other than `schedule` on a work topic.
    #[error("operation `{0}` is only valid on the schedule topic")]
    OpNotAllowed(&'static str),
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

/// What a record on the schedule topic asks the scheduler to do.
#[derive(Clone, Debug, PartialEq, Eq)]
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
}

/// Where a record is read, which decides what it may contain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    /// A work topic: only jobs; `kairos-topic` defaults to the record's topic.
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

/// Encode a job as a record for `destination` (its work topic when firing or
/// enqueueing a due job, the schedule topic for a future one).
pub fn encode(job: &Job, destination: &str) -> OwnedRecord {
    let mut headers: HeaderList = Vec::with_capacity(8 + job.headers.len());
    job_headers(job, |name, value| {
        headers.push((name.to_string(), value.map(<[u8]>::to_vec)))
    });
    OwnedRecord {
        topic: destination.to_string(),
        key: job.key.clone(),
        value: Some(job.payload.clone()),
        headers,
    }
}

/// A job's headers as librdkafka takes them, built straight from the job
/// (the scheduler's fire path: no intermediate [`OwnedRecord`]).
pub fn kafka_headers(job: &Job) -> rdkafka::message::OwnedHeaders {
    let mut out = rdkafka::message::OwnedHeaders::new_with_capacity(8 + job.headers.len());
    job_headers(job, |key, value| {
        out = std::mem::replace(&mut out, rdkafka::message::OwnedHeaders::new())
            .insert(rdkafka::message::Header { key, value });
    });
    out
}

/// `n` in decimal, written into `buf` (no allocation: this runs for every fired job).
fn decimal(mut n: u32, buf: &mut [u8; 10]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[at..];
        }
    }
}

/// Call `put` with each header of `job`, in the order the contract writes them.
fn job_headers(job: &Job, mut put: impl FnMut(&str, Option<&[u8]>)) {
    put(header::VERSION, Some(VERSION.as_bytes()));
    let mut id = uuid::Uuid::encode_buffer();
    put(
        header::ID,
        Some(job.id.uuid().hyphenated().encode_lower(&mut id).as_bytes()),
    );
    put(header::RUN_AT, Some(format_time(job.run_at).as_bytes()));
    put(header::TOPIC, Some(job.topic.as_bytes()));
    let mut digits = [0u8; 10];
    put(header::ATTEMPT, Some(decimal(job.attempt, &mut digits)));
    if let Some(n) = job.max_attempts {
        put(header::MAX_ATTEMPTS, Some(decimal(n, &mut digits)));
    }
    if let Some(t) = &job.tenant {
        put(header::TENANT, Some(t.as_bytes()));
    }
    if let Some(e) = &job.last_error {
        put(header::LAST_ERROR, Some(e.as_bytes()));
    }
    for (k, v) in &job.headers {
        put(k, v.as_deref());
    }
}

/// Encode a cancel of `id` for one partition of the schedule topic. The key is
/// the job id's text, so the record is never keyless.
pub fn encode_cancel(id: JobId, schedule_topic: &str) -> OwnedRecord {
    control_record(id, schedule_topic, "cancel", None)
}

/// Encode a reschedule of `id` to `run_at` for the schedule topic.
pub fn encode_reschedule(id: JobId, run_at: DateTime<Utc>, schedule_topic: &str) -> OwnedRecord {
    control_record(id, schedule_topic, "reschedule", Some(run_at))
}

fn control_record(id: JobId, topic: &str, op: &str, run_at: Option<DateTime<Utc>>) -> OwnedRecord {
    let mut headers = vec![
        (header::VERSION.to_string(), Some(VERSION.as_bytes().to_vec())),
        (header::OP.to_string(), Some(op.as_bytes().to_vec())),
        (header::ID.to_string(), Some(id.to_string().into_bytes())),
    ];
    if let Some(t) = run_at {
        headers.push((header::RUN_AT.to_string(), Some(format_time(t).into_bytes())));
    }
    OwnedRecord {
        topic: topic.to_string(),
        key: id.to_string().into_bytes(),
        value: Some(Vec::new()),
        headers,
    }
}

/// The Kairos headers of one record, each found at most once.
#[derive(Default)]
struct Found<'a> {
    /// Indexed like [`header::ALL`].
    values: [Option<Option<&'a [u8]>>; header::ALL.len()],
}

impl<'a> Found<'a> {
    fn get(&self, name: &'static str) -> Option<Option<&'a [u8]>> {
        let i = header::ALL.iter().position(|n| *n == name)?;
        self.values[i]
    }

    fn text(&self, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.get(name) {
            None => Ok(None),
            Some(None) => Err(bad(name, HeaderProblem::NoValue)),
            Some(Some(bytes)) => std::str::from_utf8(bytes)
                .map(Some)
                .map_err(|_| bad(name, HeaderProblem::NotUtf8)),
        }
    }

    fn nonempty_text(&self, name: &'static str) -> Result<Option<&'a str>, DecodeError> {
        match self.text(name)? {
            Some(t) if t.trim().is_empty() => Err(bad(name, HeaderProblem::Empty)),
            other => Ok(other),
        }
    }

    fn count(&self, name: &'static str) -> Result<Option<u32>, DecodeError> {
        let Some(text) = self.nonempty_text(name)? else {
            return Ok(None);
        };
        let text = text.trim();
        let n: i128 = text
            .parse()
            .map_err(|_| bad(name, HeaderProblem::NotAnInteger(text.to_string())))?;
        if n < 1 {
            return Err(bad(name, HeaderProblem::TooSmall { value: n, min: 1 }));
        }
        u32::try_from(n)
            .map(Some)
            .map_err(|_| bad(name, HeaderProblem::TooLarge(text.to_string())))
    }

    fn time(&self, name: &'static str) -> Result<Option<DateTime<Utc>>, DecodeError> {
        match self.nonempty_text(name)? {
            None => Ok(None),
            Some(t) => parse_time(t).map(Some).map_err(|p| bad(name, p)),
        }
    }

    fn id(&self) -> Result<Option<JobId>, DecodeError> {
        match self.nonempty_text(header::ID)? {
            None => Ok(None),
            Some(t) => t
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| bad(header::ID, HeaderProblem::NotAUuid(t.to_string()))),
        }
    }
}

fn bad(name: &'static str, problem: HeaderProblem) -> DecodeError {
    DecodeError::BadHeader { name, problem }
}

/// Split a record's headers into the Kairos ones (checked for duplicates and
/// unknown names) and the user's own.
fn sort_headers<'a>(headers: &[(&'a str, Option<&'a [u8]>)]) -> Result<(Found<'a>, HeaderList), DecodeError> {
    let mut found = Found::default();
    let mut user = Vec::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if !lower.starts_with(PREFIX) {
            user.push((name.to_string(), value.map(<[u8]>::to_vec)));
            continue;
        }
        let Some(i) = header::ALL.iter().position(|n| n == name) else {
            return Err(DecodeError::UnknownHeader(name.to_string()));
        };
        if found.values[i].is_some() {
            return Err(DecodeError::DuplicateHeader(header::ALL[i]));
        }
        found.values[i] = Some(*value);
    }
    Ok((found, user))
}

/// Decode a record read in `context` into what it asks for.
///
/// ```
/// use kairos::wire::{self, Command, Context, Limits, RecordView};
///
/// let headers = vec![("kairos-run-at", Some(&b"2030-01-01T00:00:00Z"[..])),
///                    ("kairos-topic", Some(&b"emails"[..]))];
/// let view = RecordView { topic: "kairos.schedule", key: Some(b"user-1"), value: Some(b"hi"),
///                         headers, ..Default::default() };
/// let Command::Schedule(job) = wire::decode(&view, Context::Schedule, &Limits::default()).unwrap()
///     else { panic!() };
/// assert_eq!(job.topic, "emails");
/// assert_eq!(job.run_at.to_rfc3339(), "2030-01-01T00:00:00+00:00");
/// ```
pub fn decode(view: &RecordView<'_>, context: Context, limits: &Limits) -> Result<Command, DecodeError> {
    if let Some(i) = view.unreadable_header {
        return Err(DecodeError::HeaderNameNotUtf8(i));
    }
    let (found, user_headers) = sort_headers(&view.headers)?;
    if let Some(v) = found.text(header::VERSION)? {
        if v.trim() != VERSION {
            return Err(DecodeError::UnknownVersion(v.to_string()));
        }
    }
    let op = match found.nonempty_text(header::OP)? {
        None => "schedule",
        Some(t) => match t.trim() {
            "schedule" => "schedule",
            "cancel" => "cancel",
            "reschedule" => "reschedule",
            other => return Err(bad(header::OP, HeaderProblem::UnknownOp(other.to_string()))),
        },
    };
    if op != "schedule" {
        if context == Context::Work {
            return Err(DecodeError::OpNotAllowed(op));
        }
        let id = found.id()?.ok_or(DecodeError::MissingHeader {
            name: header::ID,
            context: "for cancel and reschedule",
        })?;
        if op == "cancel" {
            return Ok(Command::Cancel(id));
        }
        let run_at = found.time(header::RUN_AT)?.ok_or(DecodeError::MissingHeader {
            name: header::RUN_AT,
            context: "for reschedule",
        })?;
        return Ok(Command::Reschedule { id, run_at });
    }

    let key = view.key.ok_or(DecodeError::MissingKey)?;
    if key.is_empty() {
        return Err(DecodeError::MissingKey);
    }
    if key.len() > limits.max_key_bytes {
        return Err(DecodeError::KeyTooLarge {
            len: key.len(),
            max: limits.max_key_bytes,
        });
    }
    let payload = view.value.unwrap_or_default();
    if payload.is_empty() && !limits.allow_empty_payload {
        return Err(DecodeError::EmptyPayload);
    }
    if payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: payload.len(),
            max: limits.max_payload_bytes,
        });
    }
    let topic = match (found.nonempty_text(header::TOPIC)?, context) {
        (Some(t), _) if t.trim() != t => {
            return Err(bad(header::TOPIC, HeaderProblem::BadTopic(t.to_string())))
        }
        (Some(t), _) => t.to_string(),
        (None, Context::Work) => view.topic.to_string(),
        (None, Context::Schedule) => {
            return Err(DecodeError::MissingHeader {
                name: header::TOPIC,
                context: "on the schedule topic (where should the job fire?)",
            })
        }
    };
    let timestamp_ms = view.timestamp_ms.unwrap_or(0);
    let id = match found.id()? {
        Some(id) => id,
        None => JobId::derived(view.topic, view.partition, view.offset, timestamp_ms),
    };
    let run_at = match found.time(header::RUN_AT)? {
        Some(t) => t,
        // Due "now": the moment the record was written, so that re-reading the
        // record later gives the same job.
        None => Utc
            .timestamp_millis_opt(timestamp_ms)
            .single()
            .unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
    };
    Ok(Command::Schedule(Job {
        id,
        key: key.to_vec(),
        payload: payload.to_vec(),
        run_at,
        topic,
        attempt: found.count(header::ATTEMPT)?.unwrap_or(1),
        max_attempts: found.count(header::MAX_ATTEMPTS)?,
        tenant: found.nonempty_text(header::TENANT)?.map(str::to_string),
        last_error: found.text(header::LAST_ERROR)?.map(str::to_string),
        headers: user_headers,
    }))
}

/// Decode a record that must be a job (a work topic, or a schedule-topic
/// record already known to be a job).
pub fn decode_job(view: &RecordView<'_>, context: Context, limits: &Limits) -> Result<Job, DecodeError> {
    match decode(view, context, limits)? {
        Command::Schedule(job) => Ok(job),
        Command::Cancel(_) => Err(DecodeError::OpNotAllowed("cancel")),
        Command::Reschedule { .. } => Err(DecodeError::OpNotAllowed("reschedule")),
    }
}

/// Where a dead letter came from and why it died.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Human-readable reason, e.g. a [`DecodeError`]'s text or the handler's last error.
    pub reason: String,
    /// Topic the record was read from.
    pub origin_topic: String,
    /// Partition the record was read from.
    pub origin_partition: i32,
    /// Offset the record was read from.
    pub origin_offset: i64,
}

/// Build the dead-letter record for a record that could not be processed:
/// the original key, value and headers, plus the reason and origin. Any
/// reason or origin headers already on the record (a dead letter being
/// dead-lettered again) are replaced, so the result decodes without
/// duplicate headers. A key or value beyond `limits` is cut to the limit
/// (so that the dead letter itself can be written) and the cut is named in
/// `kairos-dead-truncated`; the whole record stays at its origin offset.
pub fn dead_letter_record(
    view: &RecordView<'_>,
    dead: &DeadLetter,
    dlq_topic: &str,
    limits: &Limits,
) -> OwnedRecord {
    let replaced = [
        header::DEAD_REASON,
        header::ORIGIN_TOPIC,
        header::ORIGIN_PARTITION,
        header::ORIGIN_OFFSET,
        header::DEAD_TRUNCATED,
    ];
    let mut headers: HeaderList = view
        .headers
        .iter()
        .filter(|(k, _)| !replaced.contains(k))
        .map(|(k, v)| (k.to_string(), v.map(<[u8]>::to_vec)))
        .collect();
    add_dead_headers(&mut headers, dead);
    let key = view.key.unwrap_or_default();
    let mut cut = Vec::new();
    if key.len() > limits.max_key_bytes {
        cut.push("key");
    }
    if view.value.is_some_and(|v| v.len() > limits.max_payload_bytes) {
        cut.push("payload");
    }
    if !cut.is_empty() {
        headers.push((
            header::DEAD_TRUNCATED.to_string(),
            Some(cut.join(",").into_bytes()),
        ));
    }
    OwnedRecord {
        topic: dlq_topic.to_string(),
        key: key[..key.len().min(limits.max_key_bytes)].to_vec(),
        value: view
            .value
            .map(|v| v[..v.len().min(limits.max_payload_bytes)].to_vec()),
        headers,
    }
}

/// Build the dead-letter record for a job that used up its attempts or that
/// its handler declared dead.
pub fn dead_job_record(job: &Job, dead: &DeadLetter, dlq_topic: &str) -> OwnedRecord {
    let mut rec = encode(job, dlq_topic);
    add_dead_headers(&mut rec.headers, dead);
    rec
}

fn add_dead_headers(headers: &mut HeaderList, dead: &DeadLetter) {
    let mut put = |k: &str, v: String| headers.push((k.to_string(), Some(v.into_bytes())));
    put(header::DEAD_REASON, dead.reason.clone());
    put(header::ORIGIN_TOPIC, dead.origin_topic.clone());
    put(header::ORIGIN_PARTITION, dead.origin_partition.to_string());
    put(header::ORIGIN_OFFSET, dead.origin_offset.to_string());
}

/// Check, before writing, that `job` would decode as the same job under
/// `limits`: the producer refuses what a consumer would dead-letter.
/// Agrees with [`decode`] (a property test holds them together).
pub fn check(job: &Job, limits: &Limits) -> Result<(), DecodeError> {
    if job.key.is_empty() {
        return Err(DecodeError::MissingKey);
    }
    if job.key.len() > limits.max_key_bytes {
        return Err(DecodeError::KeyTooLarge {
            len: job.key.len(),
            max: limits.max_key_bytes,
        });
    }
    if job.payload.is_empty() && !limits.allow_empty_payload {
        return Err(DecodeError::EmptyPayload);
    }
    if job.payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: job.payload.len(),
            max: limits.max_payload_bytes,
        });
    }
    let text = |name, t: &str| {
        if t.trim().is_empty() {
            Err(bad(name, HeaderProblem::Empty))
        } else {
            Ok(())
        }
    };
    text(header::TOPIC, &job.topic)?;
    if job.topic.trim() != job.topic {
        return Err(bad(header::TOPIC, HeaderProblem::BadTopic(job.topic.clone())));
    }
    if let Some(t) = &job.tenant {
        text(header::TENANT, t)?;
    }
    for (name, n) in [
        (header::ATTEMPT, Some(job.attempt)),
        (header::MAX_ATTEMPTS, job.max_attempts),
    ] {
        if n == Some(0) {
            return Err(bad(name, HeaderProblem::TooSmall { value: 0, min: 1 }));
        }
    }
    for (name, _) in &job.headers {
        if name.to_ascii_lowercase().starts_with(PREFIX) {
            return Err(DecodeError::UnknownHeader(name.clone()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
