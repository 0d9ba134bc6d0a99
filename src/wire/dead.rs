//! Dead-letter records: the original record with the reason and origin.

use super::encode::encode;
use super::{header, Limits, OwnedRecord, RecordView};

use crate::job::{HeaderList, Job};

/// Where a dead letter came from and why it died.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    /// Human-readable reason, e.g. a [`DecodeError`](crate::wire::DecodeError)'s text or the handler's last error.
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

pub(super) fn add_dead_headers(headers: &mut HeaderList, dead: &DeadLetter) {
    let mut put = |k: &str, v: String| headers.push((k.to_string(), Some(v.into_bytes())));
    put(header::DEAD_REASON, dead.reason.clone());
    put(header::ORIGIN_TOPIC, dead.origin_topic.clone());
    put(header::ORIGIN_PARTITION, dead.origin_partition.to_string());
    put(header::ORIGIN_OFFSET, dead.origin_offset.to_string());
}
