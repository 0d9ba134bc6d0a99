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

use rdkafka::consumer::BaseConsumer;
use rdkafka::error::KafkaError;
use serde::Serialize;

use crate::config::Config;
use crate::kafka::{self, group_lag, partitions_of, watermarks};

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
