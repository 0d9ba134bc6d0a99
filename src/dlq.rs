//! The dead-letter topic for operators: list what is in it, and replay dead
//! jobs to their work topics (`kairos dlq list`, `kairos dlq replay`).
//!
//! A dead letter is the original record with `kairos-dead-reason` and where
//! it came from ([`crate::wire::DeadLetter`]). One that carries a job (a
//! job that failed its last attempt, or whose work topic was missing) can be
//! replayed: the same id, key, payload and headers (the user's own kept),
//! attempt reset to 1, written through the [`Producer`] to its work topic.
//! Replay is at-least-once. A replay without a filter replays the dead
//! letters written since the last one (a position per partition, committed
//! under the group `kairos-dlq-replay.<dead-letter topic>` once every job it
//! wrote was acknowledged), so a second one finds only newer dead letters;
//! `again` starts from the topic's beginning instead. A filtered replay (by
//! job id, origin topic, reason, or when the jobs died) replays every dead
//! letter that matches, each time, and moves no position. A job replayed
//! twice is written twice, under the same id, so a handler that
//! deduplicates on `job.id` runs it once.
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
    /// Only the jobs with these ids (none: any).
    pub job_ids: Vec<String>,
    /// Only those dead-lettered at or after this time (epoch ms).
    pub since_ms: Option<i64>,
    /// Only those dead-lettered before this time (epoch ms).
    pub until_ms: Option<i64>,
}

impl Filter {
    /// Whether it lets every dead letter through.
    pub fn is_empty(&self) -> bool {
        self.origin_topic.is_none()
            && self.reason.is_none()
            && self.job_ids.is_empty()
            && self.since_ms.is_none()
            && self.until_ms.is_none()
    }
}

/// One dead letter.
#[derive(Clone, Debug, Serialize)]
pub struct DeadEntry {
    /// Where it sits in the dead-letter topic.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// When it was dead-lettered (its record's time, epoch ms).
    pub dead_at_ms: Option<i64>,
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
    /// Whether it read on from the last replay's position (a replay
    /// without a filter, not `again`), and moved it to the end.
    pub since_last_replay: bool,
    /// Dead letters before that position, not read (replayed or passed
    /// over before; `again` or a filter reads them).
    pub earlier_not_read: i64,
}

/// The newest dead letters, for a page: at most `n`, newest last, and how
/// many the topic holds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Newest {
    /// Dead letters in the topic (all partitions, as of the read).
    pub total: i64,
    /// Records read to answer (at most `n` per partition).
    pub read: usize,
    /// The newest, by when they were dead-lettered, oldest first.
    pub entries: Vec<DeadEntry>,
}

/// Why listing or replaying failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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

/// The consumer group whose committed positions mark how far the replays
/// without a filter have gone.
pub fn replay_group(cfg: &Config) -> String {
    format!("kairos-dlq-replay.{}", cfg.topics.dead_letter)
}

/// The newest `n` dead letters (reading at most `n` from the end of each
/// partition), without their payloads, and how many the topic holds.
pub fn newest(cfg: &Config, n: usize) -> Result<Newest, DlqError> {
    let (mut entries, spans) = read(cfg, &Filter::default(), kafka::ReadFrom::Newest(n as i64))?;
    let read = entries.len();
    for job in entries.iter_mut().filter_map(|e| e.job.as_mut()) {
        job.payload = Vec::new();
    }
    entries.sort_by_key(|e| (e.dead_at_ms.unwrap_or(i64::MIN), e.partition, e.offset));
    entries.drain(..entries.len().saturating_sub(n));
    Ok(Newest {
        total: spans.iter().map(|s| s.end - s.low).sum(),
        read,
        entries,
    })
}

/// Every dead letter now in the topic (up to its end when called) that
/// matches `filter`, oldest first per partition.
pub fn list(cfg: &Config, filter: &Filter) -> Result<Vec<DeadEntry>, DlqError> {
    read(cfg, filter, kafka::ReadFrom::Start).map(|(entries, _)| entries)
}

/// The dead letters matching `filter` from `from` to the end, and what was read.
fn read(
    cfg: &Config,
    filter: &Filter,
    from: kafka::ReadFrom<'_>,
) -> Result<(Vec<DeadEntry>, Vec<kafka::Span>), DlqError> {
    let mut out = Vec::new();
    let spans = kafka::read_range(
        &cfg.kafka,
        "kairos-dlq-reader",
        &cfg.topics.dead_letter,
        None,
        from,
        READ_TIMEOUT,
        |msg| {
            let entry = entry_of(&RecordView::from_message(msg), &cfg.limits);
            if matches(&entry, filter) {
                out.push(entry);
            }
        },
    )?;
    Ok((out, spans))
}

/// Replay the dead jobs that match `filter` (see the module doc for which
/// are read: without a filter and without `again`, those since the last
/// replay); `progress` is called after every write with (replayed so far,
/// matched).
pub async fn replay(
    cfg: &Config,
    filter: &Filter,
    again: bool,
    mut progress: impl FnMut(usize, usize),
) -> Result<ReplayReport, DlqError> {
    let group = replay_group(cfg);
    let since_last = filter.is_empty() && !again;
    let (entries, spans) = {
        let (cfg, filter, group) = (cfg.clone(), filter.clone(), group.clone());
        tokio::task::spawn_blocking(move || {
            let from = if since_last {
                kafka::ReadFrom::Committed(&group)
            } else {
                kafka::ReadFrom::Start
            };
            read(&cfg, &filter, from)
        })
        .await
        .map_err(|e| DlqError::Task(e.to_string()))??
    };
    let producer = Producer::new(cfg)?;
    let mut report = ReplayReport {
        matched: entries.len(),
        since_last_replay: since_last,
        earlier_not_read: spans.iter().map(|s| s.from - s.low).sum(),
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
    // Every job above was acknowledged: the next replay starts after them.
    if filter.is_empty() {
        let (cfg, topic) = (cfg.clone(), cfg.topics.dead_letter.clone());
        tokio::task::spawn_blocking(move || kafka::commit_ends(&cfg.kafka, &group, &topic, &spans))
            .await
            .map_err(|e| DlqError::Task(e.to_string()))??;
    }
    Ok(report)
}

fn matches(e: &DeadEntry, f: &Filter) -> bool {
    let at = e.dead_at_ms.unwrap_or(i64::MIN);
    f.origin_topic.as_ref().is_none_or(|t| *t == e.origin_topic)
        && f.reason.as_ref().is_none_or(|r| e.reason.contains(r.as_str()))
        && (f.job_ids.is_empty() || e.job_id.as_ref().is_some_and(|id| f.job_ids.contains(id)))
        && f.since_ms.is_none_or(|s| at >= s)
        && f.until_ms.is_none_or(|u| at < u)
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
        dead_at_ms: view.timestamp_ms,
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
