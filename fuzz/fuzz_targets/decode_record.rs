//! Fuzz target: decoding a Kafka record into a job ([`kairos::wire::decode`]).
//!
//! The input is a record written as text, one field per line, so the seed
//! corpus (`fuzz/corpus/decode_record/`) is readable and easy to extend:
//!
//! ```text
//! @topic: jobs            record coordinates and body (pseudo-headers)
//! @partition: 3
//! @offset: 42
//! @ts: 1700000000000      record timestamp, epoch ms (absent: none)
//! @key: user-1            absent, or a line without `: `: no key
//! @value: hello           likewise for the value
//! @limits: 16 64 true     max_key_bytes max_payload_bytes allow_empty_payload
//! kairos-run-at: 2030-01-01T00:00:00Z
//! trace                   a header with a null value
//! : x                     a header with an empty name
//! ```
//!
//! Every other line is a header, `name: value` (bytes after the first `: `
//! are the value, verbatim); a header name that is not UTF-8 is treated as
//! [`RecordView::from_message`] treats it. Both contexts (work topic and
//! schedule topic) are decoded.
//!
//! Invariants checked (the wire module's documentation):
//! - decoding never panics, and is deterministic;
//! - `decode_job` agrees with `decode`;
//! - a decoded job passes `wire::check` under the same limits (the producer
//!   never refuses what a consumer accepts);
//! - a decoded job, cancel or reschedule encodes to a record that decodes to
//!   the same thing, on the schedule topic and (jobs) on its work topic;
//! - the dead-letter record of any record never panics, fits the limits,
//!   names each dead-letter header once and says what it cut.
#![no_main]
#![forbid(unsafe_code)]

use kairos::wire::{self, Command, Context, DeadLetter, Limits, OwnedRecord, RecordView};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((view, limits)) = parse(data) else {
        return;
    };
    for context in [Context::Work, Context::Schedule] {
        check_decode(&view, context, &limits);
    }
    check_dead_letter(&view, &limits);
});

/// The record and limits an input describes; `None` for inputs that cannot
/// come from a broker (a topic name Kafka would refuse).
fn parse(data: &[u8]) -> Option<(RecordView<'_>, Limits)> {
    let mut view = RecordView {
        topic: "jobs",
        ..Default::default()
    };
    let mut limits = Limits::default();
    let mut index = 0;
    for line in data.split(|b| *b == b'\n') {
        if line.is_empty() {
            continue;
        }
        let (name, value) = match line.windows(2).position(|w| w == b": ") {
            Some(i) => (&line[..i], Some(&line[i + 2..])),
            None => (line, None),
        };
        let text = value.and_then(|v| std::str::from_utf8(v).ok());
        match name {
            b"@topic" => view.topic = text?,
            b"@partition" => view.partition = text.and_then(|t| t.parse().ok()).unwrap_or_default(),
            b"@offset" => view.offset = text.and_then(|t| t.parse().ok()).unwrap_or_default(),
            b"@ts" => view.timestamp_ms = text.and_then(|t| t.parse().ok()),
            b"@key" => view.key = value,
            b"@value" => view.value = value,
            b"@limits" => limits = parse_limits(text.unwrap_or_default()),
            _ => {
                match std::str::from_utf8(name) {
                    Ok(name) => view.headers.push((name, value)),
                    // rdkafka cannot read such a header; the view leaves it out and notes it.
                    Err(_) => {
                        view.unreadable_header.get_or_insert(index);
                    }
                }
                index += 1;
            }
        }
    }
    legal_topic(view.topic).then_some((view, limits))
}

/// `max_key_bytes max_payload_bytes allow_empty_payload`; missing or
/// unreadable fields keep their defaults.
fn parse_limits(text: &str) -> Limits {
    let mut limits = Limits::default();
    let mut fields = text.split_whitespace();
    if let Some(n) = fields.next().and_then(|f| f.parse().ok()) {
        limits.max_key_bytes = n;
    }
    if let Some(n) = fields.next().and_then(|f| f.parse().ok()) {
        limits.max_payload_bytes = n;
    }
    if let Some(b) = fields.next().and_then(|f| f.parse().ok()) {
        limits.allow_empty_payload = b;
    }
    limits
}

/// A topic name Kafka accepts: 1 to 249 of `[a-zA-Z0-9._-]`, not `.` or `..`.
/// Records are only ever read from such topics.
fn legal_topic(t: &str) -> bool {
    (1..=249).contains(&t.len())
        && t != "."
        && t != ".."
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn check_decode(view: &RecordView<'_>, context: Context, limits: &Limits) {
    let decoded = wire::decode(view, context, limits);
    assert_eq!(
        decoded,
        wire::decode(view, context, limits),
        "decoding is not deterministic"
    );
    let as_job = wire::decode_job(view, context, limits);
    match &decoded {
        Ok(Command::Schedule(job)) => assert_eq!(as_job.as_ref(), Ok(job), "decode_job disagrees"),
        _ => assert!(
            as_job.is_err(),
            "decode_job accepted what decode did not call a job"
        ),
    }
    let command = match decoded {
        Ok(c) => c,
        Err(e) => {
            // The reason goes into the dead-letter record: it must render.
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    match &command {
        Command::Schedule(job) => {
            if let Err(e) = wire::check(job, limits) {
                panic!("decode accepted a job that check refuses ({e}): {job:?}");
            }
            let rec = wire::encode(job, "kairos.schedule");
            assert_eq!(
                wire::decode(&view_of(&rec), Context::Schedule, limits),
                Ok(command.clone()),
                "a decoded job, encoded for the schedule topic, decodes differently: {rec:?}"
            );
            let rec = wire::encode(job, &job.topic);
            assert_eq!(
                wire::decode_job(&view_of(&rec), Context::Work, limits).as_ref(),
                Ok(job),
                "a decoded job, encoded for its work topic, decodes differently: {rec:?}"
            );
        }
        Command::Cancel(id) => {
            let rec = wire::encode_cancel(*id, "kairos.schedule");
            assert_eq!(
                wire::decode(&view_of(&rec), Context::Schedule, limits),
                Ok(command.clone()),
                "a decoded cancel, encoded again, decodes differently: {rec:?}"
            );
        }
        Command::Reschedule { id, run_at } => {
            let rec = wire::encode_reschedule(*id, *run_at, "kairos.schedule");
            assert_eq!(
                wire::decode(&view_of(&rec), Context::Schedule, limits),
                Ok(command.clone()),
                "a decoded reschedule, encoded again, decodes differently: {rec:?}"
            );
        }
        Command::Release { key, id } => {
            assert!(!key.is_empty(), "a release without a key decoded");
            assert_eq!(context, Context::Work, "a release decoded off a work topic");
            let rec = wire::encode_release(key, *id, "kairos.jobs");
            assert_eq!(
                wire::decode(&view_of(&rec), Context::Work, limits),
                Ok(command.clone()),
                "a decoded release, encoded again, decodes differently: {rec:?}"
            );
        }
        // `Command` is non-exhaustive: a new kind of record needs its round
        // trip checked here.
        other => panic!("a command this target does not check yet: {other:?}"),
    }
}

fn check_dead_letter(view: &RecordView<'_>, limits: &Limits) {
    let dead = DeadLetter {
        reason: "fuzz".into(),
        origin_topic: view.topic.to_string(),
        origin_partition: view.partition,
        origin_offset: view.offset,
    };
    let rec = wire::dead_letter_record(view, &dead, "kairos.dead-letter", limits);
    assert!(rec.key.len() <= limits.max_key_bytes);
    assert!(rec
        .value
        .as_ref()
        .is_none_or(|v| v.len() <= limits.max_payload_bytes));
    assert_eq!(rec.value.is_some(), view.value.is_some());
    for name in [
        wire::header::DEAD_REASON,
        wire::header::ORIGIN_TOPIC,
        wire::header::ORIGIN_PARTITION,
        wire::header::ORIGIN_OFFSET,
        wire::header::DEAD_TRUNCATED,
    ] {
        let n = rec.headers.iter().filter(|(k, _)| k == name).count();
        assert!(n <= 1, "dead letter has {n} `{name}` headers: {rec:?}");
    }
    assert_eq!(rec.header(wire::header::DEAD_REASON), Some(&b"fuzz"[..]));
    let key = view.key.unwrap_or_default();
    let key_cut = key.len() > limits.max_key_bytes;
    let value_cut = view.value.is_some_and(|v| v.len() > limits.max_payload_bytes);
    let expected = match (key_cut, value_cut) {
        (false, false) => None,
        (true, false) => Some(&b"key"[..]),
        (false, true) => Some(&b"payload"[..]),
        (true, true) => Some(&b"key,payload"[..]),
    };
    assert_eq!(rec.header(wire::header::DEAD_TRUNCATED), expected);
    assert_eq!(
        &rec.key[..],
        &key[..rec.key.len()],
        "the dead letter's key is not a prefix"
    );
}

fn view_of(rec: &OwnedRecord) -> RecordView<'_> {
    rec.view(0, 0, None)
}
