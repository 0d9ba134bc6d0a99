//! Jobs, cancels and reschedules as records.

use chrono::{DateTime, Utc};

use super::{format_time, header, OwnedRecord, VERSION};

use crate::job::{HeaderList, Job, JobId, Priority};

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
pub(super) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
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
pub(super) fn job_headers(job: &Job, mut put: impl FnMut(&str, Option<&[u8]>)) {
    put(header::VERSION, Some(VERSION.as_bytes()));
    let mut id = uuid::Uuid::encode_buffer();
    put(
        header::ID,
        Some(job.id.uuid().hyphenated().encode_lower(&mut id).as_bytes()),
    );
    put(header::RUN_AT, Some(format_time(job.run_at).as_bytes()));
    put(header::TOPIC, Some(job.topic.as_bytes()));
    let mut digits = [0u8; 20];
    put(header::ATTEMPT, Some(decimal(job.attempt.into(), &mut digits)));
    if let Some(n) = job.max_attempts {
        put(header::MAX_ATTEMPTS, Some(decimal(n.into(), &mut digits)));
    }
    if let Some(t) = &job.tenant {
        put(header::TENANT, Some(t.as_bytes()));
    }
    if job.priority != Priority::Normal {
        put(header::PRIORITY, Some(job.priority.as_str().as_bytes()));
    }
    if let Some(d) = job.early {
        put(header::EARLY, Some(d.as_millis().to_string().as_bytes()));
    }
    if let Some(e) = &job.last_error {
        put(header::LAST_ERROR, Some(e.as_bytes()));
    }
    if let Some(k) = &job.limit_key {
        put(header::LIMIT_KEY, Some(k));
    }
    if let Some(n) = job.parked {
        put(header::PARKED, Some(decimal(n, &mut digits)));
    }
    if job.skip_if_busy {
        put(header::IF_BUSY, Some(b"skip"));
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

/// Encode a release of `key`, held by job `id`, for work topic `topic`
/// (written to the partition the key's hold is in).
pub fn encode_release(key: &[u8], id: JobId, topic: &str) -> OwnedRecord {
    OwnedRecord {
        key: key.to_vec(),
        ..control_record(id, topic, "release", None)
    }
}

pub(super) fn control_record(id: JobId, topic: &str, op: &str, run_at: Option<DateTime<Utc>>) -> OwnedRecord {
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
