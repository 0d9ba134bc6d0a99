//! `[fair]`: the work topics whose jobs the scheduler releases fairly across
//! tenants, at the workers' pace.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Fair dispatch (see docs/fair-dispatch.md). Every job of a fair
/// topic goes through the scheduler, due now or later; the scheduler
/// releases due jobs only while the topic's backlog (jobs written and not
/// yet committed by the worker group) is below `backlog_target`, and picks
/// among tenants in weighted fair order.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FairConfig {
    /// Work topics dispatched fairly (each must also be in `[topics] work`).
    #[serde(deserialize_with = "super::string_or_list")]
    pub topics: Vec<String>,
    /// Weight of a tenant without an override (> 0).
    pub default_weight: f64,
    /// Per-tenant weights (> 0): a tenant of weight 3 gets three times the
    /// share of one of weight 1 while both have jobs waiting.
    pub weights: BTreeMap<String, f64>,
    /// How fast a tenant's recent service is forgotten: it halves every
    /// `half_life`, so a tenant that just had a big batch yields to others
    /// for about this long.
    #[serde(with = "humantime_serde")]
    pub half_life: Duration,
    /// Jobs of one fair topic released and not yet committed by the worker
    /// group, summed over the topic's partitions, that the scheduler aims
    /// at. Shared among scheduler instances by the schedule partitions each
    /// owns. Large enough to keep every worker busy between two polls;
    /// every job above what the workers can start is a job a newly
    /// arriving tenant waits behind.
    pub backlog_target: u64,
    /// The backlog aimed at also follows the workers' pace: at least what
    /// the worker group finishes in `backlog_time` (measured over the last
    /// half second), so that fast workers are not held to `backlog_target`
    /// per poll round trip, while a newly arriving tenant still waits
    /// behind about this much work. While the workers finish all that is
    /// released, the target doubles read by read, up to four times this
    /// paced target. `0s`: `backlog_target` only.
    #[serde(with = "humantime_serde")]
    pub backlog_time: Duration,
    /// How often the scheduler reads the worker group's committed offsets.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
}

impl Default for FairConfig {
    fn default() -> Self {
        FairConfig {
            topics: Vec::new(),
            default_weight: 1.0,
            weights: BTreeMap::new(),
            half_life: Duration::from_secs(60),
            backlog_target: 1000,
            backlog_time: Duration::from_millis(300),
            poll_interval: Duration::from_millis(30),
        }
    }
}

impl FairConfig {
    /// Whether `topic` is dispatched fairly.
    pub fn is_fair(&self, topic: &str) -> bool {
        self.topics.iter().any(|t| t == topic)
    }

    pub(super) fn validate(&self, work: &[String]) -> Result<(), ConfigError> {
        let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
        if let Some(t) = self.topics.iter().find(|t| !work.contains(t)) {
            return invalid(
                "fair.topics",
                format!("`{t}` is not a work topic (add it to [topics] work)"),
            );
        }
        let bad = |w: f64| !(w.is_finite() && w > 0.0);
        if bad(self.default_weight) {
            return invalid("fair.default_weight", "must be a number above 0".into());
        }
        if let Some((t, _)) = self.weights.iter().find(|(_, w)| bad(**w)) {
            return invalid("fair.weights", format!("tenant `{t}`: must be a number above 0"));
        }
        if self.half_life < Duration::from_millis(1) {
            return invalid("fair.half_life", "must be at least 1ms".into());
        }
        if self.backlog_target == 0 {
            return invalid("fair.backlog_target", "must be at least 1".into());
        }
        if self.backlog_time > Duration::from_secs(60) {
            return invalid("fair.backlog_time", "must be at most 60s".into());
        }
        if self.poll_interval < Duration::from_millis(10) || self.poll_interval > Duration::from_secs(60) {
            return invalid("fair.poll_interval", "must be between 10ms and 60s".into());
        }
        Ok(())
    }
}
