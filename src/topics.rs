//! `kairos topics init`: create the topics Kairos needs, safely twice.
//!
//! - the schedule topic (future-dated jobs, retries, cancels);
//! - the scheduler's changelog, compacted, with as many partitions as the
//!   schedule topic (partition N of one mirrors partition N of the other);
//! - the dead-letter topic;
//! - the held topic (keys held by workers), compacted, with as many
//!   partitions as a work topic (partition N holds the keys of work
//!   partition N);
//! - the work topics named in `[topics] work`.
//!
//! A topic that exists already is left as it is and reported; the one
//! property Kairos relies on, equal partition counts of schedule topic and
//! changelog, is checked against the cluster's metadata every time.

use std::time::Duration;

use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use tracing::info;

use crate::config::Config;
use crate::kafka;

/// What `init` did with one topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopicOutcome {
    /// Created now.
    Created,
    /// Was there already; left untouched.
    AlreadyExists,
}

/// One line of `init`'s report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicReport {
    /// The topic's name.
    pub name: String,
    /// What its role is.
    pub role: &'static str,
    /// Partitions asked for.
    pub partitions: i32,
    /// What happened.
    pub outcome: TopicOutcome,
}

/// Why topics could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopicsError {
    /// The admin client failed (connection, authorization, timeout).
    #[error("admin request failed: {0}")]
    Kafka(#[from] KafkaError),
    /// The broker refused to create a topic.
    #[error("creating topic `{topic}` failed: {code}")]
    Create {
        /// The topic.
        topic: String,
        /// The broker's error code.
        code: RDKafkaErrorCode,
    },
    /// The broker refused to delete a topic.
    #[error("deleting topic `{topic}` failed: {code}")]
    Delete {
        /// The topic.
        topic: String,
        /// The broker's error code.
        code: RDKafkaErrorCode,
    },
    /// The broker's answer did not mention a topic that was asked for.
    #[error("the broker did not answer for topic `{0}`")]
    NoAnswer(String),
    /// Schedule topic and changelog disagree on partition count.
    #[error(
        "schedule topic `{schedule}` has {schedule_partitions} partitions but changelog `{changelog}` has \
         {changelog_partitions}; they must match (recreate the changelog with the same count)"
    )]
    PartitionMismatch {
        /// Schedule topic name.
        schedule: String,
        /// Its partitions.
        schedule_partitions: i32,
        /// Changelog topic name.
        changelog: String,
        /// Its partitions.
        changelog_partitions: i32,
    },
}

/// One topic `init` creates, with its settings.
struct Planned<'a> {
    name: &'a str,
    role: &'static str,
    partitions: i32,
    settings: &'static [(&'static str, &'static str)],
}

/// Changelog settings: compacted; tombstones outlive a scheduler restart so
/// a rebuild sees the delete (a day is ample).
const CHANGELOG_SETTINGS: &[(&str, &str)] =
    &[("cleanup.policy", "compact"), ("delete.retention.ms", "86400000")];

/// Settings of the recurring schedules' topics: compacted (one record per
/// schedule, a tombstone when it is deleted).
const SCHEDULES_SETTINGS: &[(&str, &str)] = &[("cleanup.policy", "compact")];

/// Held-topic settings: compacted (one record per held key, a tombstone
/// when it is let go).
const HELD_SETTINGS: &[(&str, &str)] = &[("cleanup.policy", "compact")];

/// How long `kairos topics init` makes the changelog keep tombstones (its
/// `delete.retention.ms` above).
pub fn changelog_tombstone_retention() -> std::time::Duration {
    let ms = CHANGELOG_SETTINGS
        .iter()
        .find(|(k, _)| *k == "delete.retention.ms")
        .and_then(|(_, v)| v.parse().ok())
        .expect("the changelog settings name delete.retention.ms in ms");
    std::time::Duration::from_millis(ms)
}

/// Schedule-topic settings: the broker stamps each record with its append
/// time. The cancel-wins rule takes a partition as read up to the newest
/// record time it has read; a producer's own time (CreateTime) could be
/// forged, an append time cannot.
const SCHEDULE_SETTINGS: &[(&str, &str)] = &[("message.timestamp.type", "LogAppendTime")];

/// A topic's setting `name`, as the broker says; `None` if it cannot say.
pub async fn setting(cfg: &Config, topic: &str, name: &str) -> Option<String> {
    use rdkafka::admin::ResourceSpecifier;
    let admin = kafka::admin(&cfg.kafka).ok()?;
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let answer = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &opts)
        .await;
    let resource = answer.ok()?.into_iter().next()?.ok()?;
    resource.get(name)?.value.clone()
}

/// Whether the schedule topic's records carry the broker's append time;
/// `None` if the broker cannot say.
pub async fn schedule_has_append_time(cfg: &Config) -> Option<bool> {
    let kind = setting(cfg, &cfg.topics.schedule, "message.timestamp.type").await?;
    Some(kind == "LogAppendTime")
}

fn plan(cfg: &Config) -> Vec<Planned<'_>> {
    let t = &cfg.topics;
    let topic = |name, role, partitions, settings| Planned {
        name,
        role,
        partitions,
        settings,
    };
    let mut out = vec![
        topic(
            t.schedule.as_str(),
            "schedule",
            t.schedule_partitions,
            SCHEDULE_SETTINGS,
        ),
        topic(
            &t.changelog,
            "changelog",
            t.schedule_partitions,
            CHANGELOG_SETTINGS,
        ),
        topic(&t.dead_letter, "dead-letter", t.dead_letter_partitions, &[]),
        topic(
            &t.schedules,
            "schedules",
            t.schedule_partitions,
            SCHEDULES_SETTINGS,
        ),
        topic(
            &t.schedule_cursors,
            "schedule cursors",
            t.schedule_partitions,
            SCHEDULES_SETTINGS,
        ),
        topic(&t.held, "held keys", t.work_partitions, HELD_SETTINGS),
    ];
    for w in &t.work {
        out.push(topic(w, "work", t.work_partitions, &[]));
    }
    out
}

/// Name and partition count of every topic `init` creates (for brokers
/// without the admin API, such as the development broker).
pub fn planned(cfg: &Config) -> Vec<(String, i32)> {
    plan(cfg)
        .into_iter()
        .map(|p| (p.name.to_string(), p.partitions))
        .collect()
}

/// Create every topic Kairos needs; existing ones are reported, not changed.
pub async fn init(cfg: &Config) -> Result<Vec<TopicReport>, TopicsError> {
    let admin = kafka::admin(&cfg.kafka)?;
    let planned = plan(cfg);
    let min_isr = cfg.topics.min_insync_replicas.map(|n| n.to_string());
    let new_topics: Vec<NewTopic<'_>> = planned
        .iter()
        .map(|p| {
            let rf = TopicReplication::Fixed(cfg.topics.replication_factor);
            let t = p
                .settings
                .iter()
                .fold(NewTopic::new(p.name, p.partitions, rf), |t, (k, v)| t.set(k, v));
            match &min_isr {
                Some(n) => t.set("min.insync.replicas", n),
                None => t,
            }
        })
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin.create_topics(new_topics.iter(), &opts).await?;
    let mut outcomes = std::collections::HashMap::new();
    for res in results {
        match res {
            Ok(name) => outcomes.insert(name, TopicOutcome::Created),
            Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => {
                outcomes.insert(name, TopicOutcome::AlreadyExists)
            }
            Err((name, code)) => return Err(TopicsError::Create { topic: name, code }),
        };
    }
    let mut report = Vec::new();
    for p in &planned {
        let outcome = outcomes
            .get(p.name)
            .cloned()
            .ok_or_else(|| TopicsError::NoAnswer(p.name.to_string()))?;
        info!(topic = p.name, role = p.role, ?outcome, "topic");
        report.push(TopicReport {
            name: p.name.to_string(),
            role: p.role,
            partitions: p.partitions,
            outcome,
        });
    }
    let producer = kafka::producer(&cfg.kafka, "kairos-admin")?;
    for p in &planned {
        wait_served(&producer, p.name, Duration::from_secs(30)).await?;
    }
    check_partitions(cfg).await?;
    Ok(report)
}

/// Delete every topic [`init`] creates for `cfg` (the demo's own, on a
/// real cluster); a topic already gone is not an error. Returns the topics
/// deleted.
pub async fn delete(cfg: &Config) -> Result<Vec<String>, TopicsError> {
    let admin = kafka::admin(&cfg.kafka)?;
    let names: Vec<String> = planned(cfg).into_iter().map(|(n, _)| n).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let mut gone = Vec::new();
    for res in admin.delete_topics(&refs, &opts).await? {
        match res {
            Ok(name) => gone.push(name),
            Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
            Err((topic, code)) => return Err(TopicsError::Delete { topic, code }),
        }
    }
    Ok(gone)
}

/// Wait until the cluster's metadata serves `topic`: a topic just created
/// reaches the brokers a moment after CreateTopics answers, and a client
/// that asks in between is told it does not exist.
async fn wait_served(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    timeout: Duration,
) -> Result<(), TopicsError> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match kafka::partition_count(producer, topic, Duration::from_secs(5)).await {
            Ok(_) => return Ok(()),
            Err(KafkaError::MetadataFetch(
                RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::LeaderNotAvailable,
            )) if std::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Fail unless the schedule topic and its changelog have the same partition count.
pub async fn check_partitions(cfg: &Config) -> Result<(), TopicsError> {
    let producer = kafka::producer(&cfg.kafka, "kairos-admin")?;
    let timeout = Duration::from_secs(10);
    let s = kafka::partition_count(&producer, &cfg.topics.schedule, timeout).await?;
    let c = kafka::partition_count(&producer, &cfg.topics.changelog, timeout).await?;
    if s != c {
        return Err(TopicsError::PartitionMismatch {
            schedule: cfg.topics.schedule.clone(),
            schedule_partitions: s,
            changelog: cfg.topics.changelog.clone(),
            changelog_partitions: c,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_changelog_keeps_tombstones_a_day_as_the_readme_says() {
        assert_eq!(
            super::changelog_tombstone_retention(),
            std::time::Duration::from_secs(24 * 3600)
        );
    }
}
