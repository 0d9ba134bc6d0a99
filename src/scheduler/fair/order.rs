//! The tenant order: weighted, decaying, by priority class.
//!
//! Each tenant's recent service `s` decays as `s(t) = s(t0) · 2^(-(t - t0) / h)`.
//! Decay scales every tenant's service by the same factor, so it never
//! changes their order: service is kept *inflated* to a common base time
//! (`s · 2^((t - base) / h)`), charged as `cost · 2^((now - base) / h)`,
//! and compared as is. The base moves forward (every value rescaled) before
//! the factor could overflow.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::hash::HashMap;

/// Priority classes, 0 the highest.
pub const PRIORITY_CLASSES: usize = 3;

/// A lower class waiting is served at least once every this many releases.
pub const STARVATION_GUARD: u32 = 16;

/// Rebase once the inflation factor's exponent passes this (2^64 ≪ f64::MAX).
const REBASE_EXPONENT: f64 = 64.0;

/// Below this much decayed service, a tenant with nothing waiting is forgotten.
const FORGET_BELOW: f64 = 1e-3;

/// Tenant weights: a default and per-tenant overrides, all > 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// Weight of a tenant without an override.
    pub default: f64,
    /// Overrides by tenant name.
    pub tenants: HashMap<String, f64>,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            default: 1.0,
            tenants: HashMap::default(),
        }
    }
}

impl Weights {
    /// The weight of `tenant`.
    pub fn of(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).copied().unwrap_or(self.default)
    }
}

/// The tenant (and class) to release from next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pick {
    /// The tenant's name (`""`: jobs without a tenant).
    pub tenant: Arc<str>,
    /// Its priority class.
    pub class: usize,
}

#[derive(Debug)]
struct Tenant {
    name: Arc<str>,
    /// Inflated service (see the module doc).
    service: f64,
    weight: f64,
    /// Bit `c` set: jobs of class `c` waiting.
    waiting: u8,
    /// When it was last served (a release counter): ties go to the one
    /// served longest ago.
    tick: u64,
}

impl Tenant {
    fn entry(&self) -> Entry {
        Entry {
            share: Share(self.service / self.weight),
            tick: self.tick,
            name: self.name.clone(),
        }
    }
}

/// A finite, non-negative f64, ordered.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Share(f64);

impl Eq for Share {}

impl PartialOrd for Share {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Share {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    share: Share,
    tick: u64,
    name: Arc<str>,
}

/// Which tenant's due job to release next (see the parent module).
#[derive(Debug)]
pub struct TenantOrder {
    weights: Weights,
    half_life_ms: f64,
    /// The time inflated service is relative to.
    base_ms: i64,
    tenants: HashMap<Arc<str>, Tenant>,
    /// Per class, the tenants with jobs of that class waiting, least served first.
    classes: [BTreeSet<Entry>; PRIORITY_CLASSES],
    /// Per class, releases since it was last served.
    since_served: [u32; PRIORITY_CLASSES],
    releases: u64,
}

impl TenantOrder {
    /// An empty order with these weights and this half-life of recent
    /// service (at least 1 ms), starting at `now_ms`.
    pub fn new(weights: Weights, half_life_ms: i64, now_ms: i64) -> Self {
        TenantOrder {
            weights,
            half_life_ms: half_life_ms.max(1) as f64,
            base_ms: now_ms,
            tenants: HashMap::default(),
            classes: Default::default(),
            since_served: [0; PRIORITY_CLASSES],
            releases: 0,
        }
    }

    /// Whether `tenant` has jobs of `class` (clamped to the lowest) waiting.
    pub fn set_waiting(&mut self, tenant: &str, class: usize, waiting: bool) {
        let class = class.min(PRIORITY_CLASSES - 1);
        let bit = 1u8 << class;
        if !waiting {
            let Some(t) = self.tenants.get_mut(tenant) else {
                return;
            };
            if t.waiting & bit != 0 {
                t.waiting &= !bit;
                self.classes[class].remove(&t.entry());
            }
            return;
        }
        let weight = self.weights.of(tenant);
        let t = self
            .tenants
            .entry(Arc::from(tenant))
            .or_insert_with_key(|name| Tenant {
                name: name.clone(),
                service: 0.0,
                weight,
                waiting: 0,
                tick: 0,
            });
        if t.waiting & bit == 0 {
            t.waiting |= bit;
            self.classes[class].insert(t.entry());
        }
    }

    /// The shared name of `tenant`, if it is known (waiting, or recently
    /// served): a look-up by name that allocates nothing.
    pub fn name(&self, tenant: &str) -> Option<&Arc<str>> {
        self.tenants.get_key_value(tenant).map(|(name, _)| name)
    }

    /// Whether `tenant` is known to have jobs of `class` waiting.
    pub fn is_waiting(&self, tenant: &str, class: usize) -> bool {
        let bit = 1u8 << class.min(PRIORITY_CLASSES - 1);
        self.tenants.get(tenant).is_some_and(|t| t.waiting & bit != 0)
    }

    /// The tenant and class to release from next, if any waits: the
    /// highest class waiting (or a lower one the guard says is due), and in
    /// it the tenant with the least recent service per weight.
    pub fn pick(&self) -> Option<Pick> {
        let top = self.classes.iter().position(|c| !c.is_empty())?;
        let starved = (top + 1..PRIORITY_CLASSES)
            .filter(|c| !self.classes[*c].is_empty() && self.since_served[*c] >= STARVATION_GUARD)
            .max_by_key(|c| self.since_served[*c]);
        let class = starved.unwrap_or(top);
        let e = self.classes[class].first()?;
        Some(Pick {
            tenant: e.name.clone(),
            class,
        })
    }

    /// A job of `pick` was released at `now_ms`, costing `cost` (1 per job).
    pub fn charge(&mut self, pick: &Pick, now_ms: i64, cost: f64) {
        self.maybe_rebase(now_ms);
        self.releases += 1;
        let factor = self.inflation(now_ms);
        for (c, n) in self.since_served.iter_mut().enumerate() {
            // The class served starts over; one with nothing waiting waits for nothing.
            *n = if c == pick.class || self.classes[c].is_empty() {
                0
            } else {
                n.saturating_add(1)
            };
        }
        let Some(t) = self.tenants.get_mut(&*pick.tenant) else {
            return;
        };
        let before = t.entry();
        t.service += cost.max(0.0) * factor;
        t.tick = self.releases;
        let after = t.entry();
        for (c, class) in self.classes.iter_mut().enumerate() {
            if t.waiting & (1 << c) != 0 {
                class.remove(&before);
                class.insert(after.clone());
            }
        }
    }

    /// Forget tenants with nothing waiting whose service has decayed away
    /// by `now_ms`. Returns how many remain.
    pub fn sweep(&mut self, now_ms: i64) -> usize {
        let factor = self.inflation(now_ms);
        self.tenants
            .retain(|_, t| t.waiting != 0 || t.service / factor >= FORGET_BELOW);
        self.tenants.len()
    }

    /// A tenant's recent service at `now_ms` (decayed), if it is known.
    pub fn recent_service(&self, tenant: &str, now_ms: i64) -> Option<f64> {
        let t = self.tenants.get(tenant)?;
        Some(t.service / self.inflation(now_ms))
    }

    /// Tenants known (waiting or recently served).
    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    /// Whether no tenant is known.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// Set new weights (tenants known take theirs at once).
    pub fn set_weights(&mut self, weights: Weights) {
        self.weights = weights;
        let weights = &self.weights;
        for t in self.tenants.values_mut() {
            t.weight = weights.of(&t.name);
        }
        self.rebuild();
    }

    /// `2^((now - base) / half-life)`.
    fn inflation(&self, now_ms: i64) -> f64 {
        ((now_ms - self.base_ms) as f64 / self.half_life_ms).exp2()
    }

    fn maybe_rebase(&mut self, now_ms: i64) {
        let exponent = (now_ms - self.base_ms) as f64 / self.half_life_ms;
        if exponent < REBASE_EXPONENT {
            return;
        }
        let factor = exponent.exp2();
        for t in self.tenants.values_mut() {
            t.service /= factor;
        }
        self.base_ms = now_ms;
        self.rebuild();
    }

    fn rebuild(&mut self) {
        for class in self.classes.iter_mut() {
            class.clear();
        }
        for t in self.tenants.values() {
            for (c, class) in self.classes.iter_mut().enumerate() {
                if t.waiting & (1 << c) != 0 {
                    class.insert(t.entry());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
