//! Pacing: how often the jobs of one limiter key may start (`[worker.pacing]`).
//!
//! A rule is a minimum spacing between starts, a rate with a burst, or
//! both; each is a GCRA (generic cell rate algorithm: a *theoretical
//! arrival time* per key; a start is allowed from that time less the burst
//! tolerance, and pushes it one emission interval on). Every limiter key
//! keeps two of them: the *plan*, which hands out turns to jobs as they
//! become ready (a job's turn may be ahead: it waits, in memory when near,
//! through the scheduler when far), and the *record* of actual starts,
//! which a start must also satisfy, so that a job back late from the
//! scheduler never starts closer to its neighbours than the rule allows.
//!
//! Memory: one small entry per limiter key whose plan or record is still
//! ahead of the clock; a key idle for a turn is forgotten ([`Pacer::sweep`]),
//! which is the same as keeping it.

use crate::config::{Limit, Pacing};
use crate::hash::HashMap;

/// One topic's rules: its own, and those of named limiter keys.
#[derive(Clone, Debug, Default)]
pub struct TopicRules {
    default: Rule,
    keys: HashMap<Vec<u8>, Rule>,
}

impl TopicRules {
    /// The rules of a topic's `[worker.pacing."topic"]`.
    pub fn of(p: &Pacing) -> Self {
        TopicRules {
            default: Rule::of(&p.limit()),
            keys: p
                .keys
                .iter()
                .map(|(k, l)| (k.as_bytes().to_vec(), Rule::of(l)))
                .collect(),
        }
    }

    /// The rule of limiter key `key`.
    pub fn rule(&self, key: &[u8]) -> &Rule {
        self.keys.get(key).unwrap_or(&self.default)
    }
}

/// One GCRA: emission interval and burst tolerance, in ms.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Gcra {
    interval: f64,
    tolerance: f64,
}

impl Gcra {
    /// When a start may happen at or after `now`, given theoretical arrival time `tat`.
    fn allowed_at(&self, tat: f64, now: f64) -> f64 {
        now.max(tat - self.tolerance)
    }

    /// The theoretical arrival time after a start at `at`.
    fn after(&self, tat: f64, at: f64) -> f64 {
        tat.max(at) + self.interval
    }
}

/// A limiter key's rule: its spacing and rate GCRAs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rule {
    gcras: [Option<Gcra>; 2],
}

impl Rule {
    /// The rule of a configured limit.
    pub fn of(limit: &Limit) -> Rule {
        let spacing = limit.min_spacing.map(|s| Gcra {
            interval: s.as_secs_f64() * 1000.0,
            tolerance: 0.0,
        });
        let rate = limit.rate.map(|r| {
            let per = limit.per.unwrap_or(std::time::Duration::from_secs(1));
            let interval = per.as_secs_f64() * 1000.0 / r;
            let burst = f64::from(limit.burst.unwrap_or(1).max(1));
            Gcra {
                interval,
                tolerance: interval * (burst - 1.0),
            }
        });
        Rule {
            gcras: [spacing, rate],
        }
    }
}

/// One limiter key's state, ms since the epoch.
#[derive(Clone, Copy, Default)]
struct KeyPace {
    /// Theoretical arrival times of the plan, per GCRA.
    plan: [f64; 2],
    /// Theoretical arrival times of the starts made, per GCRA.
    record: [f64; 2],
    /// Nothing starts before this (a rate-limited outcome).
    paused_until: f64,
}

impl KeyPace {
    fn idle_at(&self, now: f64) -> bool {
        self.plan.iter().chain(&self.record).all(|t| *t <= now) && self.paused_until <= now
    }
}

/// The limiter keys of a worker (see the module doc). `K` names a key (the
/// worker uses its topic and limiter key).
#[derive(Debug)]
pub struct Pacer<K> {
    keys: HashMap<K, KeyPace>,
    /// Keys held after the last sweep; the next sweep is due at twice that.
    swept_at: usize,
}

impl<K> Default for Pacer<K> {
    fn default() -> Self {
        Pacer {
            keys: HashMap::default(),
            swept_at: 0,
        }
    }
}

impl std::fmt::Debug for KeyPace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "plan {:?} record {:?} paused {}",
            self.plan, self.record, self.paused_until
        )
    }
}

impl<K: Eq + std::hash::Hash + Clone> Pacer<K> {
    /// Limiter keys with state now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no limiter key has state.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Hand a job of `key` its turn, at or after `now_ms`, and reserve it.
    pub fn reserve(&mut self, key: &K, rule: &Rule, now_ms: i64) -> i64 {
        self.sweep_if_grown(now_ms);
        let now = now_ms as f64;
        let st = self.keys.entry(key.clone()).or_default();
        let mut at = now.max(st.paused_until);
        for (g, tat) in rule.gcras.iter().zip(&st.plan) {
            if let Some(g) = g {
                at = at.max(g.allowed_at(*tat, now));
            }
        }
        for (g, tat) in rule.gcras.iter().zip(st.plan.iter_mut()) {
            if let Some(g) = g {
                *tat = g.after(*tat, at);
            }
        }
        at.ceil() as i64
    }

    /// When a start of `key` may happen, at or after `now_ms`, by the starts
    /// made so far (and a pause).
    pub fn allowed_at(&self, key: &K, rule: &Rule, now_ms: i64) -> i64 {
        let now = now_ms as f64;
        let Some(st) = self.keys.get(key) else {
            return now_ms;
        };
        let mut at = now.max(st.paused_until);
        for (g, tat) in rule.gcras.iter().zip(&st.record) {
            if let Some(g) = g {
                at = at.max(g.allowed_at(*tat, now));
            }
        }
        at.ceil() as i64
    }

    /// A job of `key` started at `now_ms`.
    pub fn started(&mut self, key: &K, rule: &Rule, now_ms: i64) {
        let now = now_ms as f64;
        let st = self.keys.entry(key.clone()).or_default();
        for (g, tat) in rule.gcras.iter().zip(st.record.iter_mut()) {
            if let Some(g) = g {
                *tat = g.after(*tat, now);
            }
        }
        // A start the plan did not hand out (a job back from the
        // scheduler after a restart) moves the plan on too.
        for (p, r) in st.plan.iter_mut().zip(&st.record) {
            *p = p.max(*r);
        }
    }

    /// Nothing of `key` starts before `until_ms` (a rate-limited outcome);
    /// the job that was told so gets the first turn then.
    pub fn pause(&mut self, key: &K, rule: &Rule, until_ms: i64) {
        let until = until_ms as f64;
        let st = self.keys.entry(key.clone()).or_default();
        st.paused_until = st.paused_until.max(until);
        for (g, tat) in rule.gcras.iter().zip(st.plan.iter_mut()) {
            if let Some(g) = g {
                *tat = g.after(*tat, until);
            }
        }
    }

    /// Forget keys idle at `now_ms` (as good as fresh).
    pub fn sweep(&mut self, now_ms: i64) {
        let now = now_ms as f64;
        self.keys.retain(|_, st| !st.idle_at(now));
        self.swept_at = self.keys.len();
    }

    fn sweep_if_grown(&mut self, now_ms: i64) {
        if self.keys.len() >= (2 * self.swept_at).max(1024) {
            self.sweep(now_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spacing(ms: u64) -> Rule {
        Rule::of(&Limit {
            min_spacing: Some(Duration::from_millis(ms)),
            ..Limit::default()
        })
    }

    #[test]
    fn turns_are_spaced_and_starts_keep_the_spacing_even_when_late() {
        let mut p = Pacer::default();
        let r = spacing(100);
        let turns: Vec<i64> = (0..4).map(|_| p.reserve(&"h", &r, 1_000)).collect();
        assert_eq!(turns, vec![1_000, 1_100, 1_200, 1_300]);
        assert_eq!(p.reserve(&"other", &r, 1_000), 1_000, "keys are independent");
        p.started(&"h", &r, 1_000);
        // The second turn's job is late (back from the scheduler at 1_150):
        // the third may not start at its turn, only 100 ms after it.
        assert_eq!(p.allowed_at(&"h", &r, 1_150), 1_150);
        p.started(&"h", &r, 1_150);
        assert_eq!(p.allowed_at(&"h", &r, 1_200), 1_250);
    }

    #[test]
    fn a_rate_with_a_burst_lets_the_burst_through_then_paces() {
        let mut p = Pacer::default();
        let r = Rule::of(&Limit {
            rate: Some(10.0),
            per: Some(Duration::from_secs(1)),
            burst: Some(3),
            ..Limit::default()
        });
        let turns: Vec<i64> = (0..6).map(|_| p.reserve(&"k", &r, 0)).collect();
        assert_eq!(turns, vec![0, 0, 0, 100, 200, 300]);
        // Over a long run, 10 per second.
        let mut p = Pacer::default();
        let last = (0..1_000).map(|_| p.reserve(&"k", &r, 0)).max().unwrap();
        assert_eq!(last, 99_700);
    }

    #[test]
    fn both_limits_hold_at_once() {
        let mut p = Pacer::default();
        let r = Rule::of(&Limit {
            min_spacing: Some(Duration::from_millis(50)),
            rate: Some(5.0),
            burst: Some(5),
            ..Limit::default()
        });
        let turns: Vec<i64> = (0..7).map(|_| p.reserve(&"k", &r, 0)).collect();
        assert_eq!(turns, vec![0, 50, 100, 150, 200, 250, 400]);
    }

    #[test]
    fn a_pause_holds_every_job_of_the_key_and_the_paused_job_goes_first() {
        let mut p = Pacer::default();
        let r = spacing(100);
        p.reserve(&"h", &r, 0);
        p.started(&"h", &r, 0);
        p.pause(&"h", &r, 5_000);
        assert_eq!(p.allowed_at(&"h", &r, 1_000), 5_000);
        assert_eq!(
            p.reserve(&"h", &r, 1_000),
            5_100,
            "after the paused job's turn at 5 000"
        );
        assert_eq!(p.allowed_at(&"k", &r, 1_000), 1_000, "other keys go on");
    }

    #[test]
    fn idle_keys_are_forgotten() {
        let mut p = Pacer::default();
        let r = spacing(100);
        for i in 0..5_000 {
            let k = format!("host{i}");
            let at = p.reserve(&k, &r, 0);
            p.started(&k, &r, at);
        }
        assert!(p.len() <= 5_000);
        p.sweep(99);
        assert_eq!(p.len(), 5_000, "all still within their spacing");
        p.sweep(100);
        assert_eq!(p.len(), 0);
        assert!(p.is_empty());
    }
}
