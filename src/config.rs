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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

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
}

/// Settings of workers (the [`crate::worker`] library and `kairos worker`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Consumer group of the workers; they share the work topics' partitions.
    pub group_id: String,
    /// Work topics to consume.
    #[serde(deserialize_with = "string_or_list")]
    pub topics: Vec<String>,
    /// Most jobs running at once (of different keys: one per key at a time).
    pub concurrency: usize,
    /// Most jobs read ahead and buffered; when it is full the worker stops
    /// reading until a job finishes (polling once a second to serve rebalances).
    pub max_buffered: usize,
    /// Attempts before a failing job is dead-lettered (a job's
    /// `kairos-max-attempts` overrides it).
    pub max_attempts: u32,
    /// Retry delay after the first failure; doubles per attempt, with jitter.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Longest retry delay.
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    /// How long a revoked partition's running handlers get to finish (they
    /// are told through their cancellation token) before it is released.
    #[serde(with = "humantime_serde")]
    pub revocation_deadline: Duration,
    /// A job read up to this much before its run-at waits in the worker;
    /// further ahead, it goes back to the scheduler (clocks differ a little
    /// between machines).
    #[serde(with = "humantime_serde")]
    pub early_tolerance: Duration,
    /// How long a worker that stopped heartbeating keeps its partitions
    /// before the group gives them to the others (librdkafka's
    /// `session.timeout.ms`; a killed worker's jobs wait this long). A
    /// `session.timeout.ms` in `[kafka.consumer]` wins.
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            group_id: "kairos-worker".into(),
            topics: vec!["kairos.jobs".into()],
            concurrency: 64,
            max_buffered: 1024,
            max_attempts: 5,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(600),
            revocation_deadline: Duration::from_secs(30),
            early_tolerance: Duration::from_secs(1),
            session_timeout: Duration::from_secs(10),
        }
    }
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
    /// Most schedule records read in one batch. Batches read while one is
    /// being persisted are merged and persisted together (one fsync).
    pub ingest_batch: usize,
    /// How often the scheduler logs what it owns, pending counts and lag.
    #[serde(with = "humantime_serde")]
    pub report_interval: Duration,
    /// Longest a partition's rebuild from the changelog may take.
    #[serde(with = "humantime_serde")]
    pub rebuild_timeout: Duration,
    /// How far producers' clocks may run ahead of the scheduler's. A job
    /// fires only once its schedule partition has been read up to its
    /// run-at, so that a cancel or reschedule written before then wins; a
    /// record created at T (its Kafka timestamp) tells the scheduler that
    /// every record written before T, less this margin, has been read.
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
            report_interval: Duration::from_secs(30),
            rebuild_timeout: Duration::from_secs(600),
            max_clock_skew: Duration::from_millis(100),
            static_membership: true,
            instance_id: String::new(),
            session_timeout: Duration::from_secs(30),
        }
    }
}

/// Connection to Kafka.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// Bootstrap servers, comma-separated `host:port` (librdkafka's `bootstrap.servers`).
    pub brokers: String,
    /// How long a produce may wait for the broker's acknowledgement before it
    /// fails (librdkafka's `message.timeout.ms`).
    #[serde(with = "humantime_serde")]
    pub produce_timeout: Duration,
    /// librdkafka settings for every client (TLS, SASL, `client.id`, ...),
    /// applied after Kairos's own defaults, so they win.
    pub client: BTreeMap<String, PassThrough>,
    /// librdkafka settings for producers only (`compression.type`, `linger.ms`, ...).
    pub producer: BTreeMap<String, PassThrough>,
    /// librdkafka settings for consumers only (`fetch.max.bytes`, `session.timeout.ms`, ...).
    pub consumer: BTreeMap<String, PassThrough>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            produce_timeout: Duration::from_secs(30),
            client: BTreeMap::new(),
            producer: BTreeMap::new(),
            consumer: BTreeMap::new(),
        }
    }
}

/// A librdkafka setting's value: TOML strings, integers, floats and booleans
/// are all accepted and passed to librdkafka as text.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(transparent)]
pub struct PassThrough(pub String);

impl<'de> Deserialize<'de> for PassThrough {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Any {
            S(String),
            I(i64),
            F(f64),
            B(bool),
        }
        Ok(PassThrough(match Any::deserialize(d)? {
            Any::S(s) => s,
            Any::I(i) => i.to_string(),
            Any::F(f) => f.to_string(),
            Any::B(b) => b.to_string(),
        }))
    }
}

impl From<&str> for PassThrough {
    fn from(s: &str) -> Self {
        PassThrough(s.to_string())
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
}

impl Default for TopicsConfig {
    fn default() -> Self {
        TopicsConfig {
            schedule: "kairos.schedule".into(),
            changelog: "kairos.schedule.changelog".into(),
            dead_letter: "kairos.dead-letter".into(),
            work: vec!["kairos.jobs".into()],
            schedule_partitions: 6,
            work_partitions: 6,
            dead_letter_partitions: 1,
            replication_factor: 1,
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

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key is unknown or a value has the wrong type.
    #[error("config key `{key}`: {message}")]
    Key {
        /// Dotted path of the offending key, e.g. `kafka.brokerz`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// An environment override could not be applied.
    #[error("environment variable {var}: {message}")]
    Env {
        /// The variable's name.
        var: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of its allowed range.
    #[error("config key `{key}`: {message}")]
    Invalid {
        /// Dotted path of the key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "KAIROS_";

/// Load a configuration section (`T` is [`Config`] or a role's config that
/// flattens it) from an optional file, then apply `KAIROS_...` overrides from
/// the process environment.
pub fn load<T: serde::de::DeserializeOwned>(path: Option<&Path>) -> Result<T, ConfigError> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
            path: p.to_path_buf(),
            source,
        })?,
        None => String::new(),
    };
    let name = path.map_or_else(|| "(none)".to_string(), |p| p.display().to_string());
    load_from(&name, &text, std::env::vars())
}

/// Load from TOML text and an explicit set of environment variables (for tests).
pub fn load_from<T: serde::de::DeserializeOwned>(
    name: &str,
    text: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError> {
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::Syntax {
        path: name.to_string(),
        message: e.to_string(),
    })?;
    let mut env: Vec<(String, String)> = env.into_iter().collect();
    env.sort();
    for (var, value) in env {
        if let Some(rest) = var.strip_prefix(ENV_PREFIX) {
            if rest.contains("__") {
                apply_env(&mut table, &var, rest, &value)?;
            }
        }
    }
    let value = toml::Value::Table(table);
    serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().to_string();
        ConfigError::Key {
            key,
            message: e.into_inner().to_string(),
        }
    })
}

/// The librdkafka maps, where `_` in a variable stands for `.` in the key.
const PASS_THROUGH_MAPS: [&str; 3] = ["client", "producer", "consumer"];

fn apply_env(table: &mut toml::Table, var: &str, rest: &str, value: &str) -> Result<(), ConfigError> {
    let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if parts.iter().any(String::is_empty) {
        return Err(ConfigError::Env {
            var: var.to_string(),
            message: "empty name between `__` separators".into(),
        });
    }
    let pass_through =
        parts.len() == 3 && parts[0] == "kafka" && PASS_THROUGH_MAPS.contains(&parts[1].as_str());
    let (last, path) = parts.split_last().expect("split yields at least one part");
    let mut cur = table;
    for p in path {
        let entry = cur
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| ConfigError::Env {
            var: var.to_string(),
            message: format!("`{p}` is a value, not a section"),
        })?;
    }
    let (key, val) = if pass_through {
        (last.replace('_', "."), toml::Value::String(value.to_string()))
    } else {
        (last.clone(), parse_env_value(value))
    };
    cur.insert(key, val);
    Ok(())
}

fn parse_env_value(value: &str) -> toml::Value {
    format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()))
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
        for (key, name) in [
            ("topics.schedule", &self.topics.schedule),
            ("topics.changelog", &self.topics.changelog),
            ("topics.dead_letter", &self.topics.dead_letter),
        ] {
            if name.trim().is_empty() {
                return Err(invalid(key, "must not be empty"));
            }
        }
        let mut names = vec![
            &self.topics.schedule,
            &self.topics.changelog,
            &self.topics.dead_letter,
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
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if s.window.is_zero() {
            return Err(invalid("scheduler.window", "must be longer than zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn empty_file_gives_defaults() {
        let c: Config = load_from("t", "", env(&[])).unwrap();
        assert_eq!(c, Config::default());
        c.validate().unwrap();
    }

    #[test]
    fn shipped_files_parse_and_validate() {
        for file in ["config/scheduler.toml", "config/worker.toml"] {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            let text = std::fs::read_to_string(&path).unwrap();
            let c: toml::Table = text.parse().unwrap();
            // The file's common sections must load as Config.
            let cfg: Config = load_from(file, &c.to_string(), env(&[])).unwrap();
            cfg.validate().unwrap();
        }
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = load_from::<Config>("t", "[kafka]\nbrokerz = \"x\"\n", env(&[])).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("brokerz"), "{text}");
        let err = load_from::<Config>("t", "[kafak]\n", env(&[])).unwrap_err();
        assert!(err.to_string().contains("kafak"), "{err}");
    }

    #[test]
    fn wrong_types_name_the_key() {
        let err =
            load_from::<Config>("t", "[topics]\nschedule_partitions = \"six\"\n", env(&[])).unwrap_err();
        match err {
            ConfigError::Key { key, .. } => assert_eq!(key, "topics.schedule_partitions"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn syntax_errors_are_reported_with_the_file() {
        let err = load_from::<Config>("my.toml", "[kafka\n", env(&[])).unwrap_err();
        assert!(
            matches!(err, ConfigError::Syntax { ref path, .. } if path == "my.toml"),
            "{err}"
        );
    }

    #[test]
    fn environment_overrides_file_and_defaults() {
        let c: Config = load_from(
            "t",
            "[kafka]\nbrokers = \"file:9092\"\n[kafka.client]\n\"socket.timeout.ms\" = 1000\n",
            env(&[
                ("KAIROS_KAFKA__BROKERS", "env:9092"),
                ("KAIROS_KAFKA__CLIENT__SASL_PASSWORD", "s3cret"),
                ("KAIROS_KAFKA__PRODUCER__COMPRESSION_TYPE", "zstd"),
                ("KAIROS_TOPICS__SCHEDULE_PARTITIONS", "12"),
                ("KAIROS_TOPICS__WORK", "a, b"),
                ("KAIROS_LIMITS__ALLOW_EMPTY_PAYLOAD", "true"),
                ("KAIROS_KAFKA__PRODUCE_TIMEOUT", "5s"),
                ("KAIROS_CONFIG", "ignored: no double underscore"),
                ("OTHER__THING", "ignored: no prefix"),
            ]),
        )
        .unwrap();
        assert_eq!(c.kafka.brokers, "env:9092");
        assert_eq!(c.kafka.client["socket.timeout.ms"], PassThrough::from("1000"));
        assert_eq!(c.kafka.client["sasl.password"], PassThrough::from("s3cret"));
        assert_eq!(c.kafka.producer["compression.type"], PassThrough::from("zstd"));
        assert_eq!(c.topics.schedule_partitions, 12);
        assert_eq!(c.topics.work, vec!["a", "b"]);
        assert!(c.limits.allow_empty_payload);
        assert_eq!(c.kafka.produce_timeout, Duration::from_secs(5));
    }

    #[test]
    fn unknown_environment_keys_are_errors_too() {
        let err = load_from::<Config>("t", "", env(&[("KAIROS_KAFKA__BROKER", "x")])).unwrap_err();
        assert!(err.to_string().contains("broker"), "{err}");
    }

    #[test]
    fn validation_rejects_out_of_range_values() {
        let mut c = Config::default();
        c.topics.schedule_partitions = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::Invalid {
                key: "topics.schedule_partitions",
                ..
            })
        ));
    }
}
