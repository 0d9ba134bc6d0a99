//! Held keys for operators (`kairos keys blocked`, `kairos keys release`),
//! read from the held topic, where workers keep every key they hold.
//!
//! A key is held while a failed job of it waits for its retry (a
//! `hold_key` topic), or while its job waits for a pacing turn too far
//! ahead to wait in memory, and until the jobs parked behind it have run.
//! Releasing a key writes a release record to the work partition the key
//! is held in; the worker that owns it dead-letters the failing job
//! (bringing its retry forward to do so) and lets the key's other jobs run.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::config::Config;
use crate::kafka;
use crate::wire;
use crate::worker::hold::{claim, record, Cause, Hold};

/// One held key, as the held topic says now.
#[derive(Clone, Debug, Serialize)]
pub struct HeldKey {
    /// The work topic.
    pub topic: String,
    /// The entity key (lossy text).
    pub key: String,
    /// The key's bytes.
    #[serde(skip)]
    pub key_bytes: Vec<u8>,
    /// The work partition it is held in.
    pub partition: i32,
    /// The job holding it (`None`: it is done, and the jobs parked behind
    /// it are still coming back).
    pub job_id: Option<String>,
    /// The attempt its next run is.
    pub attempt: Option<u32>,
    /// Why it holds the key: `failed` or `paced`.
    pub cause: Option<Cause>,
    /// When its next run is due, ms since the epoch.
    pub due_ms: Option<i64>,
    /// Jobs parked behind it and not yet run.
    pub parked: u64,
    /// How long the key has been held, ms.
    pub age_ms: i64,
    /// A job released by an operator, dead-lettered when it comes back.
    pub released: Option<String>,
}

/// Why listing or releasing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeysError {
    /// Reading the held topic failed.
    #[error("reading the held topic: {0}")]
    Read(#[from] kafka::ReadError),
    /// Writing the release record failed.
    #[error("writing the release: {0}")]
    Write(#[from] rdkafka::error::KafkaError),
    /// The key is not held by any job.
    #[error("key `{0}` is not held by a job{1}")]
    NotHeld(String, String),
    /// The key is held on several topics; name one.
    #[error("key `{0}` is held on several topics ({1}); name one with --topic")]
    Ambiguous(String, String),
}

/// Longest a read of the held topic may take.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// Every key held now (of `topic`, or of every topic), longest held first.
pub fn blocked(cfg: &Config, topic: Option<&str>) -> Result<Vec<HeldKey>, KeysError> {
    let mut last: BTreeMap<(i32, Vec<u8>), Option<Hold>> = BTreeMap::new();
    kafka::read_to_end(
        &cfg.kafka,
        "kairos-keys",
        &cfg.topics.held,
        None,
        READ_TIMEOUT,
        |m| {
            use rdkafka::Message as _;
            let Some(k) = m.key() else { return };
            // An unreadable value counts as let go.
            last.insert(
                (m.partition(), k.to_vec()),
                record::decode(m.payload()).ok().flatten(),
            );
        },
    )?;
    // Only the records of the claim each partition's worker committed last
    // count (see `worker::hold::claim`).
    let mut partitions: Vec<(String, i32)> = last
        .keys()
        .filter_map(|(p, k)| Some((record::split_key(k)?.1.to_string(), *p)))
        .collect();
    partitions.sort();
    partitions.dedup();
    let claims = kafka::committed_metadata(&cfg.kafka, &cfg.worker.group_id, &partitions, READ_TIMEOUT)?;
    let now = chrono::Utc::now().timestamp_millis();
    let mut out: Vec<HeldKey> = last
        .into_iter()
        .filter_map(|((partition, k), hold)| {
            let hold = hold?;
            let (claim, t, key) = record::split_key(&k)?;
            if topic.is_some_and(|want| want != t) {
                return None;
            }
            let committed = claims
                .get(&(t.to_string(), partition))
                .and_then(|m| claim::of_metadata(m));
            if claim != committed {
                return None;
            }
            let b = hold.blocker.as_ref();
            Some(HeldKey {
                topic: t.to_string(),
                key: String::from_utf8_lossy(key).into_owned(),
                key_bytes: key.to_vec(),
                partition,
                job_id: b.map(|b| b.id.to_string()),
                attempt: b.map(|b| b.attempt),
                cause: b.map(|b| b.cause),
                due_ms: b.map(|b| b.due_ms),
                parked: hold.parked(),
                age_ms: now - hold.since_ms,
                released: hold.released().map(|id| id.to_string()),
            })
        })
        .collect();
    out.sort_by_key(|h| std::cmp::Reverse(h.age_ms));
    Ok(out)
}

/// Release `key` (on `topic`, needed when it is held on several): write
/// the release record the owning worker acts on. Returns the key as it was.
pub async fn release(cfg: &Config, key: &str, topic: Option<&str>) -> Result<HeldKey, KeysError> {
    let cfg2 = cfg.clone();
    let topic_owned = topic.map(str::to_string);
    let held = tokio::task::spawn_blocking(move || blocked(&cfg2, topic_owned.as_deref()))
        .await
        .map_err(|e| KeysError::NotHeld(key.to_string(), format!(" ({e})")))??;
    let mut matching: Vec<HeldKey> = held
        .into_iter()
        .filter(|h| h.key == key && h.job_id.is_some())
        .collect();
    let which = topic.map(|t| format!(" on `{t}`")).unwrap_or_default();
    if matching.len() > 1 {
        let topics: Vec<&str> = matching.iter().map(|h| h.topic.as_str()).collect();
        return Err(KeysError::Ambiguous(key.to_string(), topics.join(", ")));
    }
    let h = matching.pop().ok_or(KeysError::NotHeld(key.to_string(), which))?;
    let id = h
        .job_id
        .as_deref()
        .and_then(|id| id.parse().ok())
        .ok_or_else(|| KeysError::NotHeld(key.to_string(), String::new()))?;
    let producer = kafka::producer(&cfg.kafka, "kairos-keys")?;
    let rec = wire::encode_release(&h.key_bytes, id, &h.topic);
    kafka::send(&producer, &rec, Some(h.partition)).await?;
    Ok(h)
}

/// `kairos keys blocked` as a table.
pub fn text(held: &[HeldKey]) -> String {
    if held.is_empty() {
        return "no key is held\n".into();
    }
    let mut out = format!(
        "{:<24} {:<24} {:>4} {:<36} {:>7} {:<7} {:>7} {:>10}\n",
        "TOPIC", "KEY", "PART", "HELD BY JOB", "ATTEMPT", "CAUSE", "PARKED", "AGE"
    );
    for h in held {
        let job = h.job_id.as_deref().unwrap_or("(done; parked jobs coming back)");
        let cause = match h.cause {
            Some(Cause::Failed) => "failed",
            Some(Cause::Paced) => "paced",
            None => "-",
        };
        out.push_str(&format!(
            "{:<24} {:<24} {:>4} {:<36} {:>7} {:<7} {:>7} {:>9.1}s\n",
            h.topic,
            h.key,
            h.partition,
            job,
            h.attempt.map_or("-".to_string(), |a| a.to_string()),
            cause,
            h.parked,
            h.age_ms as f64 / 1000.0
        ));
    }
    out
}
