//! Records as jobs and commands: headers sorted and checked, and the
//! producer-side check that agrees with decoding.

use chrono::DateTime;
use chrono::{TimeZone, Utc};

use super::{
    header, parse_time, Command, Context, DecodeError, HeaderProblem, Limits, RecordView, MAX_EARLY_MS,
    PREFIX, VERSION,
};

use crate::job::{HeaderList, Job, JobId, Priority};

/// The Kairos headers of one record, each found at most once.
#[derive(Default)]
pub(super) struct Found<'a> {
    /// Indexed like [`header::ALL`].
    pub(super) values: [Option<Option<&'a [u8]>>; header::ALL.len()],
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

    /// An integer header, with its trimmed text; at least 1.
    fn positive(&self, name: &'static str) -> Result<Option<(i128, &'a str)>, DecodeError> {
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
        Ok(Some((n, text)))
    }

    fn count(&self, name: &'static str) -> Result<Option<u32>, DecodeError> {
        let n = self.at_most(name, u64::from(u32::MAX))?;
        Ok(n.map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
    }

    /// A positive integer header no larger than `max`.
    fn at_most(&self, name: &'static str, max: u64) -> Result<Option<u64>, DecodeError> {
        let Some((n, text)) = self.positive(name)? else {
            return Ok(None);
        };
        match u64::try_from(n) {
            Ok(n) if n <= max => Ok(Some(n)),
            _ => Err(bad(
                name,
                HeaderProblem::TooLarge {
                    value: text.to_string(),
                    max,
                },
            )),
        }
    }

    fn priority(&self) -> Result<Priority, DecodeError> {
        match self.nonempty_text(header::PRIORITY)? {
            None => Ok(Priority::Normal),
            Some(t) => Priority::parse(t.trim())
                .ok_or_else(|| bad(header::PRIORITY, HeaderProblem::UnknownPriority(t.to_string()))),
        }
    }

    fn early(&self) -> Result<Option<std::time::Duration>, DecodeError> {
        let name = header::EARLY;
        let Some((ms, text)) = self.positive(name)? else {
            return Ok(None);
        };
        if ms > MAX_EARLY_MS as i128 {
            return Err(bad(name, HeaderProblem::EarlyTooLong(text.to_string())));
        }
        Ok(Some(std::time::Duration::from_millis(ms as u64)))
    }

    /// `kairos-limit-key`: any bytes but none, within the key limit.
    fn limit_key(&self, limits: &Limits) -> Result<Option<Vec<u8>>, DecodeError> {
        let name = header::LIMIT_KEY;
        match self.get(name) {
            None => Ok(None),
            Some(None) => Err(bad(name, HeaderProblem::NoValue)),
            Some(Some([])) => Err(bad(name, HeaderProblem::Empty)),
            Some(Some(k)) if k.len() > limits.max_key_bytes => Err(bad(
                name,
                HeaderProblem::TooLong {
                    len: k.len(),
                    max: limits.max_key_bytes,
                },
            )),
            Some(Some(k)) => Ok(Some(k.to_vec())),
        }
    }

    /// `kairos-if-busy`: `skip` or `queue` (the default).
    fn skip_if_busy(&self) -> Result<bool, DecodeError> {
        match self.nonempty_text(header::IF_BUSY)?.map(str::trim) {
            None | Some("queue") => Ok(false),
            Some("skip") => Ok(true),
            Some(other) => Err(bad(
                header::IF_BUSY,
                HeaderProblem::UnknownIfBusy(other.to_string()),
            )),
        }
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

pub(super) fn bad(name: &'static str, problem: HeaderProblem) -> DecodeError {
    DecodeError::BadHeader { name, problem }
}

/// Split a record's headers into the Kairos ones (checked for duplicates and
/// unknown names) and the user's own.
pub(super) fn sort_headers<'a>(
    headers: &[(&'a str, Option<&'a [u8]>)],
) -> Result<(Found<'a>, HeaderList), DecodeError> {
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
            "release" => "release",
            other => return Err(bad(header::OP, HeaderProblem::UnknownOp(other.to_string()))),
        },
    };
    if op != "schedule" {
        let allowed = if op == "release" {
            Context::Work
        } else {
            Context::Schedule
        };
        if context != allowed {
            return Err(DecodeError::OpNotAllowed(op));
        }
        let id = found.id()?.ok_or(DecodeError::MissingHeader {
            name: header::ID,
            context: "for cancel, reschedule and release",
        })?;
        if op == "cancel" {
            return Ok(Command::Cancel(id));
        }
        if op == "release" {
            let key = view
                .key
                .filter(|k| !k.is_empty())
                .ok_or(DecodeError::MissingKey)?;
            return Ok(Command::Release {
                key: key.to_vec(),
                id,
            });
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
        priority: found.priority()?,
        early: found.early()?,
        last_error: found.text(header::LAST_ERROR)?.map(str::to_string),
        limit_key: found.limit_key(limits)?,
        parked: found.at_most(header::PARKED, u64::MAX)?,
        skip_if_busy: found.skip_if_busy()?,
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
        Command::Release { .. } => Err(DecodeError::OpNotAllowed("release")),
    }
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
    match &job.limit_key {
        Some(k) if k.is_empty() => return Err(bad(header::LIMIT_KEY, HeaderProblem::Empty)),
        Some(k) if k.len() > limits.max_key_bytes => {
            return Err(bad(
                header::LIMIT_KEY,
                HeaderProblem::TooLong {
                    len: k.len(),
                    max: limits.max_key_bytes,
                },
            ))
        }
        _ => {}
    }

    if let Some(d) = job.early {
        let ms = d.as_millis();
        if ms < 1 || d.subsec_nanos() % 1_000_000 != 0 {
            // Sub-millisecond allowances do not survive the wire.
            return Err(bad(
                header::EARLY,
                HeaderProblem::TooSmall {
                    value: ms as i128,
                    min: 1,
                },
            ));
        }
        if ms > MAX_EARLY_MS as u128 {
            return Err(bad(header::EARLY, HeaderProblem::EarlyTooLong(ms.to_string())));
        }
    }
    for (name, n) in [
        (header::ATTEMPT, Some(u64::from(job.attempt))),
        (header::MAX_ATTEMPTS, job.max_attempts.map(u64::from)),
        (header::PARKED, job.parked),
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
