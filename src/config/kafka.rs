//! `[kafka]`: where the cluster is, how clients join their groups, and the
//! librdkafka settings passed through.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::ConfigError;

/// How the scheduler's and the workers' consumers are members of their
/// groups (librdkafka's `group.protocol`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GroupProtocol {
    /// The classic protocol: the members agree on the assignment
    /// (cooperative-sticky); each member's session timeout is its own
    /// (`scheduler.session_timeout`, `worker.session_timeout`). A static
    /// member restarted after a kill -9 takes its partitions back at once.
    #[default]
    Classic,
    /// The consumer protocol of KIP-848 (Kafka 4.0 or later): the broker
    /// assigns partitions, and the session timeout is the group's, set on
    /// the broker (`group.consumer.session.timeout.ms`, or per group
    /// `consumer.session.timeout.ms`; 45 s by default); Kairos's
    /// `session_timeout` settings do not apply. A static member restarted
    /// after a kill -9 is refused its instance id until its old session
    /// expires, and takes its partitions back then.
    Consumer,
}

/// Settings librdkafka refuses under the consumer protocol: the broker
/// decides them.
const CLASSIC_ONLY: [&str; 4] = [
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "partition.assignment.strategy",
    "group.protocol.type",
];

/// librdkafka settings Kairos sets itself and that the pass-through maps
/// may not override, each with what rests on it.
const RESERVED: [(&str, &str); 14] = [
    ("bootstrap.servers", "set kafka.brokers instead"),
    (
        "group.id",
        "the scheduler's and the workers' groups are scheduler.group_id and worker.group_id",
    ),
    (
        "enable.idempotence",
        "each job is written once and in order per partition (idempotent producers)",
    ),
    (
        "acks",
        "a write counts once every in-sync replica has it (acks=all)",
    ),
    (
        "request.required.acks",
        "a write counts once every in-sync replica has it (acks=all)",
    ),
    (
        "enable.auto.commit",
        "an offset is committed only below jobs that are finished",
    ),
    (
        "enable.auto.offset.store",
        "an offset is committed only below jobs that are finished",
    ),
    (
        "isolation.level",
        "consumers read only records whose writes were committed",
    ),
    (
        "auto.offset.reset",
        "a new group reads its partitions from the start, skipping no job",
    ),
    (
        "enable.partition.eof",
        "a partition taken over is read to its end before it is worked",
    ),
    (
        "partitioner",
        "a key's jobs land on the partition every Kafka client picks for it (murmur2)",
    ),
    ("message.timeout.ms", "set kafka.produce_timeout instead"),
    ("transactional.id", "Kairos's producers are not transactional"),
    (
        "allow.auto.create.topics",
        "topics are created by `kairos topics init` with their settings",
    ),
];

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
    /// applied after Kairos's own defaults. The settings its guarantees
    /// rest on (`acks`, `enable.idempotence`, `enable.auto.commit`,
    /// `enable.auto.offset.store`, `isolation.level`, `auto.offset.reset`,
    /// `partitioner`, `group.id`, ...) are refused here and in the two maps
    /// below, with the guarantee named.
    pub client: BTreeMap<String, PassThrough>,
    /// librdkafka settings for producers only (`compression.type`, `linger.ms`, ...).
    pub producer: BTreeMap<String, PassThrough>,
    /// librdkafka settings for consumers only (`fetch.max.bytes`, `session.timeout.ms`, ...).
    pub consumer: BTreeMap<String, PassThrough>,
    /// The consumer group protocol of the scheduler's and the workers'
    /// groups: `classic` (the default) or `consumer` (KIP-848, Kafka 4.0+).
    pub group_protocol: GroupProtocol,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            produce_timeout: Duration::from_secs(30),
            client: BTreeMap::new(),
            producer: BTreeMap::new(),
            consumer: BTreeMap::new(),
            group_protocol: GroupProtocol::Classic,
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

impl KafkaConfig {
    /// Check the pass-through maps against the group protocol.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let all = [
            ("kafka.client", &self.client),
            ("kafka.producer", &self.producer),
            ("kafka.consumer", &self.consumer),
        ];
        for (section, map) in all {
            if let Some((key, why)) = RESERVED.iter().find(|(k, _)| map.contains_key(*k)) {
                return Err(ConfigError::Invalid {
                    key: "kafka",
                    message: format!("`{key}` in [{section}] is Kairos's to set: {why}"),
                });
            }
        }
        let maps = [("kafka.client", &self.client), ("kafka.consumer", &self.consumer)];
        for (section, map) in maps {
            if map.contains_key("group.protocol") {
                return Err(ConfigError::Invalid {
                    key: "kafka.group_protocol",
                    message: format!(
                        "`group.protocol` in [{section}]: choose the protocol with kafka.group_protocol \
                         (\"classic\" or \"consumer\"), which also leaves out the settings the other one refuses"
                    ),
                });
            }
            if self.group_protocol == GroupProtocol::Consumer {
                if let Some(key) = CLASSIC_ONLY.iter().find(|k| map.contains_key(**k)) {
                    return Err(ConfigError::Invalid {
                        key: "kafka.group_protocol",
                        message: format!(
                            "`{key}` in [{section}] is a classic-protocol setting; under group_protocol = \
                             \"consumer\" the broker decides it (see the group's consumer.* configs)"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}
