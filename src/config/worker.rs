//! Settings of workers: the `[worker]` section.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{string_or_list, AdminConfig, OnFailure, Pacing};

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
    /// What a failing job that will be retried does to its key:
    /// `overtake` (its later jobs run meanwhile) or `hold_key` (none starts
    /// until it succeeded, was dead-lettered or released).
    pub on_failure: OnFailure,
    /// `on_failure` for named topics, instead of the one above.
    pub on_failure_by_topic: BTreeMap<String, OnFailure>,
    /// Most keys one worker holds at once. Beyond it a failing job's
    /// retry overtakes (logged, counted in
    /// `kairos_worker_hold_overflow_total`) instead of holding its key.
    pub max_held_keys: usize,
    /// How long a held key waits for a piece that does not come back (its
    /// blocker's next run, or a parked job due before one that came back)
    /// before it goes on without it, logged (`held key gave up`): its order
    /// may not hold then. Long enough to ride out a broker or scheduler
    /// outage; `kairos keys release` lets a key go sooner.
    #[serde(with = "humantime_serde")]
    pub hold_give_up: Duration,
    /// Pacing per work topic (`[worker.pacing."topic"]`): how often the
    /// jobs of one limiter key may start.
    pub pacing: BTreeMap<String, Pacing>,
    /// A paced job whose turn is at most this far ahead waits in memory
    /// (holding no concurrency slot); one further ahead goes through the
    /// scheduler, its key held until it comes back.
    #[serde(with = "humantime_serde")]
    pub pacing_horizon: Duration,
    /// How often the offsets of finished jobs are committed (in
    /// exactly-once mode, how often a transaction commits them with their
    /// jobs' writes). Shorter: less work run again after a crash, and
    /// follow-ups visible sooner in exactly-once mode; longer: fewer
    /// commits. At most a sixth of `session_timeout`.
    #[serde(with = "humantime_serde")]
    pub commit_interval: Duration,
    /// Settle in Kafka transactions: what the jobs finished in a commit
    /// round write (follow-ups, retries, deferrals, dead letters, jobs
    /// handed back to the scheduler) and the work offsets past them commit
    /// together, so each job's writes appear once to `read_committed`
    /// consumers, through crashes and zombies. A job's writes wait in
    /// memory until every job before it in its partition has finished too,
    /// then for the next commit round (`commit_interval`). Not with topics that
    /// hold keys (`hold_key`, pacing). Off: at least once.
    pub exactly_once: bool,
    /// With `exactly_once`: how long the broker lets a transaction stay
    /// open before it aborts it. A killed worker's open transaction holds
    /// back every `read_committed` reader of the partitions it wrote to
    /// until then (or until a worker with its `transactional_id` starts).
    /// Handlers run outside transactions: this does not bound them. At
    /// least 1 s.
    #[serde(with = "humantime_serde")]
    pub transaction_timeout: Duration,
    /// With `exactly_once`: this worker's `transactional.id`, unique per
    /// running worker. A worker restarted with the same id ends what its
    /// killed self left open at once, instead of after
    /// `transaction_timeout`. Empty: generated at each start (from the
    /// group and a random number).
    pub transactional_id: String,
    /// The worker's admin endpoint (`[worker.admin]`; off by default).
    pub admin: AdminConfig,
}

impl WorkerConfig {
    /// What a failure does to its key on `topic`.
    pub fn on_failure(&self, topic: &str) -> OnFailure {
        self.on_failure_by_topic
            .get(topic)
            .copied()
            .unwrap_or(self.on_failure)
    }

    /// Whether keys of `topic` can be held (hold-key retries, or pacing,
    /// whose long waits hold their key): its holds are then kept in the
    /// held topic and read back when its partitions are assigned.
    pub fn holds_keys(&self, topic: &str) -> bool {
        self.on_failure(topic) == OnFailure::HoldKey || self.pacing.contains_key(topic)
    }
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
            on_failure: OnFailure::Overtake,
            on_failure_by_topic: BTreeMap::new(),
            max_held_keys: 1_000_000,
            hold_give_up: Duration::from_millis(crate::worker::hold::GIVE_UP_MS as u64),
            pacing: BTreeMap::new(),
            pacing_horizon: Duration::from_secs(1),
            commit_interval: Duration::from_millis(100),
            exactly_once: false,
            transaction_timeout: Duration::from_secs(15),
            transactional_id: String::new(),
            admin: AdminConfig::default(),
        }
    }
}
