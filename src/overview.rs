//! `kairos stats`: where jobs stand, read from Kafka alone. Per topic: the
//! records it holds and how far its consumer group is behind (the work
//! topics' worker group: jobs waiting for a worker or running; the schedule
//! topic's scheduler group: records not yet ingested), and the dead-letter
//! topic's size. Jobs waiting in the scheduler's store are not in these
//! figures (the records cannot say which are still waiting): the
//! scheduler's `/metrics` and `/status` give them ([`crate::admin`]), and
//! [`schedulers()`] asks them.

mod schedulers;
mod text;

pub use schedulers::{
    admin_addrs, find_job, schedulers, workers, JobLookupError, SchedulerFigures, WorkerFigures, DUE_SPANS,
};
pub use text::text;

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::Config;
use crate::kafka;

/// One topic's figures.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TopicFigures {
    /// The topic.
    pub topic: String,
    /// `work`, `schedule` or `dead-letter`.
    pub role: &'static str,
    /// Records it holds now (end − start, summed over partitions).
    pub records: i64,
    /// The consumer group that reads it, if any.
    pub group: Option<String>,
    /// Records the group has not committed yet (end − committed, summed
    /// over partitions; a partition it never committed counts from its
    /// start).
    pub lag: Option<i64>,
}

/// The figures of every topic Kairos uses: the work topics (`[topics]
/// work`) with the worker group, the schedule topic with the scheduler
/// group, the dead-letter topic. A topic that does not exist is left out.
pub fn topics(cfg: &Config) -> Result<Vec<TopicFigures>, KafkaError> {
    let t = &cfg.topics;
    let mut wanted: Vec<(&str, &'static str, Option<&str>)> = t
        .work
        .iter()
        .map(|w| (w.as_str(), "work", Some(cfg.worker.group_id.as_str())))
        .collect();
    wanted.push((&t.schedule, "schedule", Some(&cfg.scheduler.group_id)));
    wanted.push((&t.dead_letter, "dead-letter", None));
    let mut out = Vec::new();
    for (topic, role, group) in wanted {
        if let Some(f) = figures(cfg, topic, role, group)? {
            out.push(f);
        }
    }
    Ok(out)
}

fn figures(
    cfg: &Config,
    topic: &str,
    role: &'static str,
    group: Option<&str>,
) -> Result<Option<TopicFigures>, KafkaError> {
    let timeout = Duration::from_secs(10);
    let mut rc = kafka::base_config(&cfg.kafka, "kairos-stats");
    // Reads the group's committed offsets; never joins it or commits.
    rc.set("group.id", group.unwrap_or("kairos-stats"))
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = rc.create()?;
    let Some(partitions) = partitions_of(&consumer, topic, timeout)? else {
        return Ok(None);
    };
    let ends = watermarks(&consumer, topic, &partitions, timeout)?;
    let records = ends.iter().map(|(_, (low, high))| high - low).sum();
    let lag = match group {
        None => None,
        Some(_) => Some(group_lag(&consumer, topic, &ends, timeout)?),
    };
    Ok(Some(TopicFigures {
        topic: topic.to_string(),
        role,
        records,
        group: group.map(str::to_string),
        lag,
    }))
}

/// The partitions of `topic` (`None` when it does not exist or has none).
pub(crate) fn partitions_of<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    timeout: Duration,
) -> Result<Option<Vec<i32>>, KafkaError> {
    let meta = consumer.fetch_metadata(Some(topic), timeout)?;
    let Some(m) = meta
        .topics()
        .iter()
        .find(|m| m.name() == topic && m.error().is_none())
    else {
        return Ok(None);
    };
    let partitions: Vec<i32> = m.partitions().iter().map(|p| p.id()).collect();
    Ok((!partitions.is_empty()).then_some(partitions))
}

/// A partition and its (low, high) watermarks.
pub(crate) type Watermarks = (i32, (i64, i64));

/// Each of `partitions`' (low, high) watermarks.
pub(crate) fn watermarks<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    partitions: &[i32],
    timeout: Duration,
) -> Result<Vec<Watermarks>, KafkaError> {
    partitions
        .iter()
        .map(|p| Ok((*p, consumer.fetch_watermarks(topic, *p, timeout)?)))
        .collect()
}

/// Records of `topic` that `consumer`'s group has not committed yet, summed
/// over the partitions of `ends` (their watermarks); a partition never
/// committed counts from its start.
pub(crate) fn group_lag<C: rdkafka::consumer::ConsumerContext>(
    consumer: &BaseConsumer<C>,
    topic: &str,
    ends: &[Watermarks],
    timeout: Duration,
) -> Result<i64, KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for (p, _) in ends {
        tpl.add_partition(topic, *p);
    }
    let committed = consumer.committed_offsets(tpl, timeout)?;
    Ok(ends
        .iter()
        .map(|(p, (low, high))| {
            let at = match committed.find_partition(topic, *p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o.max(*low),
                _ => *low,
            };
            (high - at).max(0)
        })
        .sum())
}
