//! The dead-letter topic for operators: list what is in it, and replay dead
//! jobs to their work topics (`kairos dlq list`, `kairos dlq replay`).
//!
//! A dead letter is the original record with `kairos-dead-reason` and where
//! it came from ([`crate::wire::DeadLetter`]). One that carries a job (a
//! job that failed its last attempt, or whose work topic was missing) can be
//! replayed: the same id, key, payload and headers (the user's own kept),
//! attempt reset to 1, written through the [`Producer`] to its work topic.
//! Replay is at-least-once: run twice, it writes the jobs twice, under the
//! same ids, so a handler that deduplicates on `job.id` runs each once.
//! Records that never decoded as a job (bad headers, oversized, truncated)
//! are listed, with why, and left alone.

use std::time::Duration;

use serde::Serialize;

use crate::config::Config;
use crate::job::Job;
use crate::kafka;
use crate::producer::{ProduceError, Producer};
use crate::wire::{self, header, Command, Context, RecordView};

/// Which dead letters to look at.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only those whose origin topic (the topic they died from) is this.
    pub origin_topic: Option<String>,
    /// Only those whose reason contains this text.
    pub reason: Option<String>,
}

/// One dead letter.
#[derive(Clone, Debug, Serialize)]
pub struct DeadEntry {
    /// Where it sits in the dead-letter topic.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// Why it died (`kairos-dead-reason`).
    pub reason: String,
    /// The topic it died from.
    pub origin_topic: String,
    /// Its partition there (-1: unknown).
    pub origin_partition: i32,
    /// Its offset there (-1: unknown).
    pub origin_offset: i64,
    /// The job, when the record carries one (then it can be replayed).
    #[serde(skip)]
    pub job: Option<Job>,
    /// The job's id, when it carries one.
    pub job_id: Option<String>,
    /// Its key (lossy text), when it carries a job.
    pub key: Option<String>,
    /// The attempt it died on, when it carries a job.
    pub attempt: Option<u32>,
    /// Why it cannot be replayed, when it carries no job.
    pub not_a_job: Option<String>,
}

/// What a replay did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplayReport {
    /// Dead letters read that matched the filter.
    pub matched: usize,
    /// Jobs written back to their work topics.
    pub replayed: usize,
    /// Matching dead letters that carry no job (left alone).
    pub not_jobs: usize,
}

/// Why listing or replaying failed.
#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    /// Reading the dead-letter topic failed.
    #[error("reading the dead-letter topic: {0}")]
    Read(#[from] kafka::ReadError),
    /// Writing a replayed job failed (those before it were written).
    #[error("replaying: {0}")]
    Produce(#[from] ProduceError),
    /// The read stopped abnormally.
    #[error("reading the dead-letter topic: {0}")]
    Task(String),
}

/// Longest a read of the dead-letter topic to its end may take.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Every dead letter now in the topic (up to its end when called) that
/// matches `filter`, oldest first per partition.
pub fn list(cfg: &Config, filter: &Filter) -> Result<Vec<DeadEntry>, DlqError> {
    let mut out = Vec::new();
    kafka::read_to_end(
        &cfg.kafka,
        "kairos-dlq-reader",
        &cfg.topics.dead_letter,
        None,
        READ_TIMEOUT,
        |msg| {
            let entry = entry_of(&RecordView::from_message(msg), &cfg.limits);
            if matches(&entry, filter) {
                out.push(entry);
            }
        },
    )?;
    Ok(out)
}

/// Replay the dead jobs `list` finds for `filter`; `progress` is called
/// after every write with (replayed so far, matched).
pub async fn replay(
    cfg: &Config,
    filter: &Filter,
    mut progress: impl FnMut(usize, usize),
) -> Result<ReplayReport, DlqError> {
    let entries = {
        let (cfg, filter) = (cfg.clone(), filter.clone());
        tokio::task::spawn_blocking(move || list(&cfg, &filter))
            .await
            .map_err(|e| DlqError::Task(e.to_string()))??
    };
    let producer = Producer::new(cfg)?;
    let mut report = ReplayReport {
        matched: entries.len(),
        ..ReplayReport::default()
    };
    for e in entries {
        let Some(mut job) = e.job else {
            report.not_jobs += 1;
            continue;
        };
        job.attempt = 1;
        producer.enqueue(job).await?;
        report.replayed += 1;
        progress(report.replayed, report.matched);
    }
    Ok(report)
}

fn matches(e: &DeadEntry, f: &Filter) -> bool {
    f.origin_topic.as_ref().is_none_or(|t| *t == e.origin_topic)
        && f.reason.as_ref().is_none_or(|r| e.reason.contains(r.as_str()))
}

/// A dead-letter record as an entry: its reason and origin, and the job it
/// carries, decoded as it was before it died.
pub fn entry_of(view: &RecordView<'_>, limits: &wire::Limits) -> DeadEntry {
    let text = |name: &str| {
        view.headers
            .iter()
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| *v)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let reason = text(header::DEAD_REASON).unwrap_or_else(|| "(no reason given)".into());
    let origin_topic = text(header::ORIGIN_TOPIC).unwrap_or_default();
    let number = |name| text(name).and_then(|t| t.parse().ok());
    let origin_partition = number(header::ORIGIN_PARTITION).unwrap_or(-1) as i32;
    let origin_offset = number(header::ORIGIN_OFFSET).unwrap_or(-1);
    let dead_headers = [
        header::DEAD_REASON,
        header::ORIGIN_TOPIC,
        header::ORIGIN_PARTITION,
        header::ORIGIN_OFFSET,
    ];
    let job = if text(header::DEAD_TRUNCATED).is_some() {
        Err("truncated when dead-lettered".to_string())
    } else {
        let original = RecordView {
            topic: &origin_topic,
            partition: origin_partition,
            offset: origin_offset,
            headers: view
                .headers
                .iter()
                .filter(|(k, _)| !dead_headers.contains(k))
                .copied()
                .collect(),
            ..view.clone()
        };
        // A job dead from the schedule topic names its work topic; one
        // from a work topic may leave it to the record's topic.
        match wire::decode(&original, Context::Schedule, limits)
            .or_else(|_| wire::decode(&original, Context::Work, limits))
        {
            Ok(Command::Schedule(job)) => Ok(job),
            Ok(_) => Err("a cancel or reschedule, not a job".to_string()),
            Err(e) => Err(e.to_string()),
        }
    };
    let (job, not_a_job) = match job {
        Ok(j) => (Some(j), None),
        Err(why) => (None, Some(why)),
    };
    DeadEntry {
        partition: view.partition,
        offset: view.offset,
        reason,
        origin_topic,
        origin_partition,
        origin_offset,
        job_id: job.as_ref().map(|j| j.id.to_string()),
        key: job.as_ref().map(|j| j.key_lossy().into_owned()),
        attempt: job.as_ref().map(|j| j.attempt),
        job,
        not_a_job,
    }
}
