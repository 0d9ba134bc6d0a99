//! Configuration: TOML files under `config/`, overridden by `KAIROS_...`
//! environment variables, with pass-through maps for any librdkafka setting.
//!
//! Every role (scheduler, worker, command line) reads the same [`Config`];
//! each file under `config/` documents the sections its role uses. A key
//! that is not known is an error naming the key, so a typo never silently
//! falls back to a default.
//!
//! Environment variables: `KAIROS_<SECTION>__<KEY>` sets `[section] key`
//! (double underscore between levels), e.g. `KAIROS_KAFKA__BROKERS=host:9092`
//! or `KAIROS_SCHEDULER__DATA_DIR=/var/lib/kairos`. Inside the librdkafka
//! maps a single underscore stands for a dot:
//! `KAIROS_KAFKA__CLIENT__SASL_PASSWORD=...` sets `sasl.password`. Values
//! are read as TOML when they parse as such (`5`, `true`, `["a", "b"]`) and
//! as plain text otherwise.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

mod fair;
mod kafka;
mod keys;
mod load;
#[cfg(test)]
mod tests;
mod worker;

pub use fair::FairConfig;
pub use kafka::{GroupProtocol, KafkaConfig, PassThrough};
pub use keys::{Limit, OnFailure, Pacing};
pub use load::{load, load_from, ConfigError, ENV_PREFIX};
pub use worker::WorkerConfig;

pub use crate::wire::Limits;

/// Everything Kairos can be configured with.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// How to reach Kafka, and librdkafka settings passed through.
    pub kafka: KafkaConfig,
    /// Topic names and the shapes `kairos topics init` gives them.
    pub topics: TopicsConfig,
    /// Size limits on keys and payloads; larger records are dead-lettered.
    pub limits: Limits,
    /// The scheduler service.
    pub scheduler: SchedulerConfig,
    /// Workers.
    pub worker: WorkerConfig,
    /// Fair dispatch across tenants.
    pub fair: FairConfig,
}

/// Settings of the scheduler service (`kairos scheduler`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Consumer group of the scheduler instances; they share the schedule
    /// topic's partitions.
    pub group_id: String,
    /// Directory of the sled store of pending jobs (one per instance).
    pub data_dir: PathBuf,
    /// Bytes of sled page cache; with `window_capacity`, what bounds the
    /// scheduler's memory whatever the number of pending jobs. sled counts
    /// its pages at their size on disk; in memory they take about four
    /// times that (measured: BENCHMARKS.md, scheduler memory).
    pub cache_capacity: u64,
    /// How far ahead of now jobs are held in memory. Jobs due within three
    /// windows sit in sorted runs in the store; later ones in chunks per
    /// time bucket.
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    /// Most jobs held in memory at once (jobs already due on arrival, fired
    /// straight from memory, take at most half of it).
    pub window_capacity: usize,
    /// Most jobs fired in one batch.
    pub fire_batch: usize,
    /// Most schedule records read in one batch (and at most 16 MiB of keys
    /// and payloads). Batches read while one is being persisted are merged
    /// and persisted together (one fsync), up to twice this many waiting
    /// per apply thread.
    pub ingest_batch: usize,
    /// Threads that persist ingested batches, each for a fixed share of the
    /// schedule partitions (partition `p` on thread `p % apply_threads`):
    /// one waits for its changelog acknowledgements while another works.
    /// More (up to one per partition an instance owns) ingest a flood
    /// faster; each costs memory while a flood is applied (BENCHMARKS.md).
    pub apply_threads: usize,
    /// How often the scheduler logs what it owns, pending counts and lag.
    #[serde(with = "humantime_serde")]
    pub report_interval: Duration,
    /// Longest a partition's rebuild from the changelog may take.
    #[serde(with = "humantime_serde")]
    pub rebuild_timeout: Duration,
    /// How far the brokers' clocks may run ahead of the scheduler's. A job
    /// fires only once its schedule partition has been read up to its
    /// run-at, so that a cancel or reschedule written before then wins; a
    /// record the broker appended at T (its LogAppendTime timestamp) tells
    /// the scheduler that every record written before T, less this margin,
    /// has been read. Producers' own times (CreateTime) are not used.
    #[serde(with = "humantime_serde")]
    pub max_clock_skew: Duration,
    /// Join the group as a static member (`group.instance.id`): a
    /// restarted instance gets its partitions back at once instead of after
    /// `session_timeout`. Off: dynamic membership (a restart waits for the
    /// dead member's session to expire).
    pub static_membership: bool,
    /// The static member id; empty: generated on first start and kept in
    /// `data_dir` (file `instance-id`). Each instance needs its own. A
    /// `group.instance.id` in `[kafka.consumer]` wins.
    pub instance_id: String,
    /// How long an instance that stopped heartbeating keeps its partitions
    /// (librdkafka's `session.timeout.ms`): with static membership, also
    /// after a clean stop, until it comes back or this has passed; then the
    /// other instances take them over. A `session.timeout.ms` in
    /// `[kafka.consumer]` wins.
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    /// Longest a partition taken away waits for its fires in flight to be
    /// acknowledged and for the records read from it to be stored, before
    /// it is let go. What is not finished by then is done again by the next
    /// owner (a duplicate fire at worst). At most 300 s, what librdkafka
    /// allows a rebalance to take.
    #[serde(with = "humantime_serde")]
    pub revocation_deadline: Duration,
    /// Fire in Kafka transactions: each fire round's work records, their
    /// changelog tombstones and the schedule offsets commit together, and
    /// each ingest round's changelog records likewise, so a job fires once
    /// as `read_committed` consumers see it, through crashes and zombies.
    /// Every job then goes through the store (none fires straight from
    /// memory). Off: at least once.
    pub exactly_once: bool,
    /// With `exactly_once`: how long the broker lets a transaction stay
    /// open before it aborts it. A dead instance's open transaction holds
    /// back every `read_committed` reader of its partitions (the next
    /// owner's catch-up included) until then. A record of a transaction not
    /// acknowledged within this (or `kafka.produce_timeout`, if shorter)
    /// fails it. At least 1 s.
    #[serde(with = "humantime_serde")]
    pub transaction_timeout: Duration,
    /// Recurring schedules: how long before its time an occurrence is
    /// enqueued (written to the schedule topic as a job), so that it fires
    /// on time through the store. A change to a schedule within this much
    /// of an occurrence applies from the next one.
    #[serde(with = "humantime_serde")]
    pub schedules_lead: Duration,
    /// Recurring schedules: an occurrence not enqueued within this long
    /// after its time (the scheduler was down, its partition moving) was
    /// missed, and its schedule's misfire policy decides whether it runs.
    #[serde(with = "humantime_serde")]
    pub schedules_misfire_after: Duration,
    /// The scheduler's admin endpoint (`[scheduler.admin]`; off by default).
    pub admin: AdminConfig,
}

/// An admin endpoint ([`crate::admin`]): `/metrics`, `/healthz`, `/readyz`,
/// `/status`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Address to serve, e.g. `127.0.0.1:9464`; unset: no endpoint. An
    /// address other than loopback needs `token`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<std::net::SocketAddr>,
    /// Bearer token every request must carry (`Authorization: Bearer
    /// <token>`); better set through the environment
    /// (`KAIROS_SCHEDULER__ADMIN__TOKEN`, `KAIROS_WORKER__ADMIN__TOKEN`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl AdminConfig {
    /// Refuse an endpoint open beyond this machine without a token.
    fn validate(&self, key: &'static str) -> Result<(), ConfigError> {
        let has_token = self.token.as_deref().is_some_and(|t| !t.trim().is_empty());
        match self.listen {
            Some(addr) if !addr.ip().is_loopback() && !has_token => Err(ConfigError::Invalid {
                key,
                message: format!(
                    "the admin endpoint on {addr} is reachable from other machines: set a token \
                     (or listen on 127.0.0.1)"
                ),
            }),
            _ => Ok(()),
        }
    }
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            group_id: "kairos-scheduler".into(),
            data_dir: PathBuf::from("data/scheduler"),
            cache_capacity: 16 * 1024 * 1024,
            window: Duration::from_secs(60),
            window_capacity: 100_000,
            fire_batch: 1000,
            ingest_batch: 2000,
            apply_threads: 3,
            report_interval: Duration::from_secs(30),
            rebuild_timeout: Duration::from_secs(600),
            max_clock_skew: Duration::from_millis(100),
            static_membership: true,
            instance_id: String::new(),
            session_timeout: Duration::from_secs(30),
            revocation_deadline: Duration::from_secs(60),
            exactly_once: false,
            transaction_timeout: Duration::from_secs(15),
            schedules_lead: Duration::from_secs(2),
            schedules_misfire_after: Duration::from_secs(30),
            admin: AdminConfig::default(),
        }
    }
}

/// Topic names and shapes.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TopicsConfig {
    /// Where future-dated jobs, retries, cancels and reschedules go; the scheduler consumes it.
    pub schedule: String,
    /// The scheduler's compacted state changelog, keyed by job id. Has as many
    /// partitions as the schedule topic: changelog partition N holds the state
    /// of schedule partition N.
    pub changelog: String,
    /// Where records that cannot be processed go, with the reason in `kairos-dead-reason`.
    pub dead_letter: String,
    /// Recurring schedules' definitions (JSON, keyed by schedule id; a
    /// tombstone deletes): compacted, with as many partitions as the
    /// schedule topic (schedule partition N's owner runs the schedules of
    /// partition N).
    pub schedules: String,
    /// How far each recurring schedule has run (written by schedulers):
    /// compacted, partitioned like `schedules`.
    pub schedule_cursors: String,
    /// Keys held by workers (hold-key retries, long pacing waits):
    /// compacted, keyed by work topic and entity key; partition N holds the
    /// keys of partition N of every work topic, so it needs as many
    /// partitions as the largest work topic that holds keys.
    pub held: String,
    /// Work topics that `kairos topics init` creates (workers name theirs in `[worker]`).
    #[serde(deserialize_with = "string_or_list")]
    pub work: Vec<String>,
    /// Partitions of the schedule topic (and so of the changelog); the most
    /// scheduler instances that can share the load.
    pub schedule_partitions: i32,
    /// Partitions of each work topic created by `kairos topics init`.
    pub work_partitions: i32,
    /// Partitions of the dead-letter topic.
    pub dead_letter_partitions: i32,
    /// Replication factor of created topics (3 on a production cluster).
    pub replication_factor: i32,
    /// `min.insync.replicas` of created topics: how many replicas must have
    /// a write before it is acknowledged (Kairos's producers ask for
    /// `acks=all`). Unset: the broker's default. With replication factor 3,
    /// 2 keeps every acknowledged write on two brokers and lets one be down.
    pub min_insync_replicas: Option<i32>,
}

impl Default for TopicsConfig {
    fn default() -> Self {
        TopicsConfig {
            schedule: "kairos.schedule".into(),
            changelog: "kairos.schedule.changelog".into(),
            dead_letter: "kairos.dead-letter".into(),
            schedules: "kairos.schedules".into(),
            schedule_cursors: "kairos.schedules.cursors".into(),
            held: "kairos.held".into(),
            work: vec!["kairos.jobs".into()],
            schedule_partitions: 6,
            work_partitions: 6,
            dead_letter_partitions: 1,
            replication_factor: 1,
            min_insync_replicas: None,
        }
    }
}

/// Accept either `["a", "b"]` or `"a,b"` (handy from environment variables).
pub(crate) fn string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Either::deserialize(d)? {
        Either::One(s) => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        Either::Many(v) => v,
    })
}

impl Config {
    /// Check ranges that the types alone cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key, message: &str| ConfigError::Invalid {
            key,
            message: message.to_string(),
        };
        if self.kafka.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must name at least one broker"));
        }
        if self.scheduler.transaction_timeout < Duration::from_secs(1) {
            return Err(invalid("scheduler.transaction_timeout", "must be at least 1s"));
        }
        if self.scheduler.schedules_misfire_after <= self.scheduler.schedules_lead {
            return Err(invalid(
                "scheduler.schedules_misfire_after",
                "must be longer than scheduler.schedules_lead",
            ));
        }
        for (key, n) in [
            ("topics.schedule_partitions", self.topics.schedule_partitions),
            ("topics.work_partitions", self.topics.work_partitions),
            (
                "topics.dead_letter_partitions",
                self.topics.dead_letter_partitions,
            ),
            ("topics.replication_factor", self.topics.replication_factor),
        ] {
            if n < 1 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if let Some(n) = self.topics.min_insync_replicas {
            if n < 1 || n > self.topics.replication_factor {
                return Err(invalid(
                    "topics.min_insync_replicas",
                    "must be at least 1 and at most topics.replication_factor",
                ));
            }
        }
        for (key, name) in [
            ("topics.schedule", &self.topics.schedule),
            ("topics.changelog", &self.topics.changelog),
            ("topics.dead_letter", &self.topics.dead_letter),
            ("topics.held", &self.topics.held),
        ] {
            if name.trim().is_empty() {
                return Err(invalid(key, "must not be empty"));
            }
        }
        let mut names = vec![
            &self.topics.schedule,
            &self.topics.changelog,
            &self.topics.dead_letter,
            &self.topics.held,
        ];
        names.extend(&self.topics.work);
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = names.into_iter().find(|n| !seen.insert(n.as_str())) {
            return Err(ConfigError::Invalid {
                key: "topics",
                message: format!("topic `{dup}` is named for two roles; every topic needs its own name"),
            });
        }
        if self.limits.max_key_bytes == 0 {
            return Err(invalid("limits.max_key_bytes", "must be at least 1"));
        }
        let s = &self.scheduler;
        for (key, n) in [
            ("scheduler.window_capacity", s.window_capacity),
            ("scheduler.fire_batch", s.fire_batch),
            ("scheduler.ingest_batch", s.ingest_batch),
            ("scheduler.apply_threads", s.apply_threads),
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        let w = &self.worker;
        for (key, n) in [
            ("worker.concurrency", w.concurrency),
            ("worker.max_buffered", w.max_buffered),
            ("worker.max_attempts", w.max_attempts as usize),
            ("worker.max_held_keys", w.max_held_keys),
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if s.window.is_zero() {
            return Err(invalid("scheduler.window", "must be longer than zero"));
        }
        if w.hold_give_up < Duration::from_secs(1) {
            return Err(invalid("worker.hold_give_up", "must be at least 1s"));
        }
        if w.transaction_timeout < Duration::from_secs(1) {
            return Err(invalid("worker.transaction_timeout", "must be at least 1s"));
        }
        // librdkafka refuses a session longer than max.poll.interval.ms
        // (300 s by default); Kafka brokers refuse one under 6 s by default.
        for (key, d) in [
            ("scheduler.session_timeout", s.session_timeout),
            ("worker.session_timeout", w.session_timeout),
        ] {
            if d < Duration::from_secs(1) || d > Duration::from_secs(300) {
                return Err(invalid(
                    key,
                    "must be between 1s and 300s (the broker may ask for 6s or more)",
                ));
            }
        }
        if w.commit_interval.is_zero() || w.commit_interval > w.session_timeout / 6 {
            return Err(invalid(
                "worker.commit_interval",
                "must be longer than zero and at most a sixth of worker.session_timeout",
            ));
        }
        if s.revocation_deadline.is_zero() || s.revocation_deadline > Duration::from_secs(300) {
            return Err(invalid(
                "scheduler.revocation_deadline",
                "must be longer than zero and at most 300s",
            ));
        }
        self.kafka.validate()?;
        s.admin.validate("scheduler.admin.token")?;
        w.admin.validate("worker.admin.token")?;
        self.fair.validate(&self.topics.work)?;
        keys::validate(&w.topics, &w.on_failure_by_topic, &w.pacing, w.pacing_horizon)?;
        Ok(())
    }
}
