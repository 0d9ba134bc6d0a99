//! Per-key flow control in the worker: what a failure does to its key
//! (`[worker] on_failure`), and pacing per limiter key (`[worker.pacing]`).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// What a failing job that will be retried does to its key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OnFailure {
    /// The retry goes through the scheduler and the key's later jobs run
    /// meanwhile (they overtake it).
    #[default]
    Overtake,
    /// The key is held: none of its later jobs starts until the failed job
    /// has succeeded, been dead-lettered or been released
    /// (`kairos keys release`). The hold is kept in the held topic, so it
    /// survives crashes and rebalances.
    HoldKey,
}

/// How often the jobs of one limiter key may start: a minimum spacing
/// between starts, a rate with a burst (GCRA), or both (a start waits for
/// both). A job over its limit waits; none is dropped.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limit {
    /// Least time between two starts of one limiter key.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub min_spacing: Option<Duration>,
    /// Starts allowed per `per`, on average.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// The period `rate` counts over (default 1 s).
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub per: Option<Duration>,
    /// Starts allowed at once after a quiet spell (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

/// One work topic's pacing: a limit for every limiter key, and overrides
/// for named ones.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Pacing {
    /// Least time between two starts of one limiter key.
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub min_spacing: Option<Duration>,
    /// Starts allowed per `per`, on average.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// The period `rate` counts over (default 1 s).
    #[serde(with = "humantime_serde", skip_serializing_if = "Option::is_none")]
    pub per: Option<Duration>,
    /// Starts allowed at once after a quiet spell (default 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
    /// Limits of named limiter keys, instead of the topic's.
    pub keys: BTreeMap<String, Limit>,
}

impl Pacing {
    /// The topic's own limit.
    pub fn limit(&self) -> Limit {
        Limit {
            min_spacing: self.min_spacing,
            rate: self.rate,
            per: self.per,
            burst: self.burst,
        }
    }

    /// The limit of limiter key `key`.
    pub fn limit_of(&self, key: &[u8]) -> Limit {
        std::str::from_utf8(key)
            .ok()
            .and_then(|k| self.keys.get(k))
            .cloned()
            .unwrap_or_else(|| self.limit())
    }
}

impl Limit {
    fn validate(&self, key: &'static str, what: &str) -> Result<(), ConfigError> {
        let invalid = |message: String| Err(ConfigError::Invalid { key, message });
        if let Some(r) = self.rate {
            if !(r.is_finite() && r > 0.0) {
                return invalid(format!("{what}: rate must be a number above 0"));
            }
        }
        if self.per.is_some_and(|p| p.is_zero()) {
            return invalid(format!("{what}: per must be longer than zero"));
        }
        if self.burst == Some(0) {
            return invalid(format!("{what}: burst must be at least 1"));
        }
        if self.rate.is_none() && (self.per.is_some() || self.burst.is_some()) {
            return invalid(format!("{what}: per and burst need a rate"));
        }
        Ok(())
    }
}

/// Check `[worker] on_failure_by_topic` and `[worker.pacing]` against the
/// worker's topics.
pub(super) fn validate(
    topics: &[String],
    by_topic: &BTreeMap<String, OnFailure>,
    pacing: &BTreeMap<String, Pacing>,
    horizon: Duration,
) -> Result<(), ConfigError> {
    let invalid = |key, message: String| Err(ConfigError::Invalid { key, message });
    for (key, names) in [
        ("worker.on_failure_by_topic", by_topic.keys().collect::<Vec<_>>()),
        ("worker.pacing", pacing.keys().collect()),
    ] {
        if let Some(t) = names.into_iter().find(|t| !topics.contains(t)) {
            return invalid(key, format!("`{t}` is not one of the worker's topics"));
        }
    }
    for (topic, p) in pacing {
        p.limit().validate("worker.pacing", topic)?;
        for (k, l) in &p.keys {
            l.validate("worker.pacing", &format!("{topic}, key `{k}`"))?;
        }
    }
    if horizon.is_zero() || horizon > Duration::from_secs(60) {
        return invalid(
            "worker.pacing_horizon",
            "must be longer than zero and at most 60s".into(),
        );
    }
    Ok(())
}
