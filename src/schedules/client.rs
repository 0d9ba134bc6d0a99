//! Managing schedules from Rust: write, read, pause, resume and delete
//! definitions in the schedules topic.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, TimeZone as _, Utc};
use rdkafka::message::Message as _;
use rdkafka::producer::FutureProducer;

use super::{Schedule, ScheduleError};
use crate::config::Config;
use crate::kafka;
use crate::wire::OwnedRecord;

/// Why a schedules call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulesError {
    /// The definition is refused (nothing was written).
    #[error(transparent)]
    Invalid(#[from] ScheduleError),
    /// No schedule has this id.
    #[error("no schedule `{0}`")]
    Unknown(String),
    /// Writing to Kafka failed.
    #[error("writing to `{topic}`: {source}")]
    Write {
        /// The topic.
        topic: String,
        /// What Kafka said.
        source: rdkafka::error::KafkaError,
    },
    /// Reading the topics failed.
    #[error(transparent)]
    Read(#[from] kafka::ReadError),
}

/// A schedule as the topics hold it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct ScheduleView {
    /// Its id.
    pub id: String,
    /// Its definition (`None` when the record is not a valid one).
    pub schedule: Option<Schedule>,
    /// The last occurrence enqueued or dropped (its cursor), if any.
    pub last: Option<DateTime<Utc>>,
    /// Its next occurrence after the later of `last` and now, if any.
    pub next: Option<DateTime<Utc>>,
    /// Occurrences enqueued late and dropped (its cursor's counts).
    pub late: u64,
    /// Occurrences missed and dropped by its misfire policy.
    pub dropped: u64,
    /// Why the definition cannot run, when the record is not a valid one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub invalid: Option<String>,
}

/// Writes and reads schedule definitions (see the module doc of [`crate::schedules`]).
pub struct Schedules {
    cfg: Config,
    producer: FutureProducer,
}

impl Schedules {
    /// A client for `cfg`'s schedules topic.
    pub fn new(cfg: &Config) -> Result<Schedules, SchedulesError> {
        let producer =
            kafka::producer(&cfg.kafka, "kairos-schedules").map_err(|source| SchedulesError::Write {
                topic: cfg.topics.schedules.clone(),
                source,
            })?;
        Ok(Schedules {
            cfg: cfg.clone(),
            producer,
        })
    }

    /// Write `schedule` (checked first). Writing the same definition again
    /// changes nothing: its cursor and next occurrence stay.
    pub async fn upsert(&self, schedule: &Schedule) -> Result<(), SchedulesError> {
        schedule.compile()?;
        self.write(&schedule.id, Some(schedule.to_json())).await
    }

    /// Delete schedule `id` (a tombstone): no occurrence is enqueued after
    /// its scheduler reads it (one already enqueued still runs).
    pub async fn delete(&self, id: &str) -> Result<(), SchedulesError> {
        super::check_id(id)?;
        self.write(id, None).await
    }

    /// Pause schedule `id`, saying why.
    pub async fn pause(&self, id: &str, note: Option<String>) -> Result<(), SchedulesError> {
        let mut s = self.require(id).await?;
        s.paused = true;
        s.note = note;
        self.upsert(&s).await
    }

    /// Resume schedule `id`: occurrences from now on run; those missed
    /// while it was paused do not.
    pub async fn resume(&self, id: &str) -> Result<(), SchedulesError> {
        let mut s = self.require(id).await?;
        s.paused = false;
        s.note = None;
        s.resumed_at = Some(Utc::now());
        self.upsert(&s).await
    }

    /// Enqueue every occurrence of schedule `id` from `from` to `to` (both
    /// included) again, under their ids (at most 10,000): its scheduler
    /// does it once, so asking again for the same range does nothing, and
    /// for an overlapping one only what was not backfilled yet.
    pub async fn backfill(
        &self,
        id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<(), SchedulesError> {
        self.require(id).await?;
        if to < from {
            return Err(ScheduleError::Invalid("a backfill's `to` is before its `from`".into()).into());
        }
        let value = serde_json::to_vec(&Backfill { from, to }).expect("a backfill serialises");
        self.write(&format!("{id}{BACKFILL_SUFFIX}"), Some(value)).await
    }

    /// Schedule `id`, if defined.
    pub async fn get(&self, id: &str) -> Result<Option<ScheduleView>, SchedulesError> {
        Ok(self.list().await?.into_iter().find(|v| v.id == id))
    }

    /// Every schedule, by id.
    pub async fn list(&self) -> Result<Vec<ScheduleView>, SchedulesError> {
        let cfg = self.cfg.clone();
        tokio::task::spawn_blocking(move || list_blocking(&cfg))
            .await
            .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
    }

    async fn require(&self, id: &str) -> Result<Schedule, SchedulesError> {
        match self.get(id).await?.and_then(|v| v.schedule) {
            Some(s) => Ok(s),
            None => Err(SchedulesError::Unknown(id.to_string())),
        }
    }

    async fn write(&self, id: &str, value: Option<Vec<u8>>) -> Result<(), SchedulesError> {
        let rec = OwnedRecord {
            topic: self.cfg.topics.schedules.clone(),
            key: id.as_bytes().to_vec(),
            value,
            headers: Vec::new(),
        };
        kafka::send(&self.producer, &rec, None)
            .await
            .map(|_| ())
            .map_err(|source| SchedulesError::Write {
                topic: rec.topic,
                source,
            })
    }
}

fn list_blocking(cfg: &Config) -> Result<Vec<ScheduleView>, SchedulesError> {
    let timeout = Duration::from_secs(30);
    let mut defs: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
    kafka::read_to_end(
        &cfg.kafka,
        "kairos-schedules-reader",
        &cfg.topics.schedules,
        None,
        timeout,
        |m| {
            if let Some(k) = m.key() {
                defs.insert(
                    String::from_utf8_lossy(k).into_owned(),
                    m.payload().map(<[u8]>::to_vec),
                );
            }
        },
    )?;
    let mut cursors: BTreeMap<String, Cursor> = BTreeMap::new();
    kafka::read_to_end(
        &cfg.kafka,
        "kairos-schedules-reader",
        &cfg.topics.schedule_cursors,
        None,
        timeout,
        |m| {
            if let Some(k) = m.key() {
                let id = String::from_utf8_lossy(k).into_owned();
                match m.payload().and_then(decode_cursor) {
                    Some(c) => cursors.insert(id, c),
                    None => cursors.remove(&id),
                };
            }
        },
    )?;
    let now = Utc::now();
    Ok(defs
        .into_iter()
        .filter_map(|(id, v)| {
            let v = v?;
            let cursor = cursors.remove(&id).unwrap_or_default();
            let last = cursor.last();
            let (late, dropped) = (cursor.late, cursor.dropped);
            Some(match Schedule::from_json(&v) {
                Ok((schedule, r)) => ScheduleView {
                    id,
                    next: r.next_after(last.map_or(now, |l| l.max(now))),
                    schedule: Some(schedule),
                    last,
                    late,
                    dropped,
                    invalid: None,
                },
                Err(e) => ScheduleView {
                    id,
                    schedule: None,
                    last,
                    next: None,
                    late,
                    dropped,
                    invalid: Some(e.to_string()),
                },
            })
        })
        .collect())
}

/// How far a schedule has run, as the cursors topic keeps it (JSON).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct Cursor {
    /// The last occurrence handled (enqueued or dropped), in epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_ms: Option<i64>,
    /// Ranges of nominal times backfilled (epoch ms, both ends included),
    /// merged: a backfill within them enqueues nothing again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backfilled: Vec<[i64; 2]>,
    /// Occurrences enqueued after they were missed, since the schedule
    /// was first seen.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub late: u64,
    /// Occurrences missed and dropped by the misfire policy, since the
    /// schedule was first seen.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dropped: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Cursor {
    /// The last occurrence handled.
    pub fn last(&self) -> Option<DateTime<Utc>> {
        self.last_ms.and_then(|ms| Utc.timestamp_millis_opt(ms).single())
    }

    /// This cursor and `other` together: the later last occurrence, every
    /// range backfilled by either.
    pub fn merged(&self, other: &Cursor) -> Cursor {
        let mut ranges: Vec<[i64; 2]> = self.backfilled.iter().chain(&other.backfilled).copied().collect();
        ranges.sort_unstable();
        let mut backfilled: Vec<[i64; 2]> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match backfilled.last_mut() {
                Some(last) if r[0] <= last[1].saturating_add(1) => last[1] = last[1].max(r[1]),
                _ => backfilled.push(r),
            }
        }
        // The counts only grow along a schedule's history: the larger is the later.
        Cursor {
            last_ms: self.last_ms.max(other.last_ms),
            backfilled,
            late: self.late.max(other.late),
            dropped: self.dropped.max(other.dropped),
        }
    }
}

/// The record of schedule `id`'s cursor for the cursors topic `topic` (a
/// tombstone when `None`: the schedule is gone).
pub fn cursor_record(topic: &str, id: &str, cursor: Option<&Cursor>) -> OwnedRecord {
    OwnedRecord {
        topic: topic.to_string(),
        key: id.as_bytes().to_vec(),
        value: cursor.map(|c| serde_json::to_vec(c).expect("a cursor serialises")),
        headers: Vec::new(),
    }
}

/// A cursor record's value (`None` if it does not decode).
pub fn decode_cursor(v: &[u8]) -> Option<Cursor> {
    serde_json::from_slice(v).ok()
}

/// The suffix of a backfill request's key in the schedules topic
/// (`<schedule id>` + this; an id cannot hold a control character).
pub const BACKFILL_SUFFIX: &str = "\u{0}backfill";

/// A backfill request: every occurrence of a schedule from `from` to `to`
/// (both included) enqueued again under its id, once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backfill {
    /// The first nominal time.
    pub from: DateTime<Utc>,
    /// The last nominal time.
    pub to: DateTime<Utc>,
}
