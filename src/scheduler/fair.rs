//! Fair release across tenants: which tenant's due job goes next.
//!
//! [`TenantOrder`] is the decision, pure and in memory: among the tenants
//! with due jobs waiting, release from the one with the least recent
//! service relative to its weight. Recent service decays exponentially with
//! a configured half-life (a tenant that just had a big batch yields to a
//! newcomer for a while, then shares equally again); it is charged per
//! tenant, not per key, so spreading jobs over many keys buys nothing.
//! Priority classes come first (a higher class is released before a lower
//! one), with a guard so that a lower class waiting is served at least once
//! every [`STARVATION_GUARD`] releases.
//!
//! Work-conserving: whenever any tenant waits, one is picked, so a lone
//! tenant gets all the capacity. Memory: one entry per tenant waiting or
//! served recently (until its service has decayed away, see
//! [`TenantOrder::sweep`]); a tenant with nothing waiting and nothing
//! recent costs nothing.

mod order;
mod window;

pub use order::{Pick, TenantOrder, Weights, PRIORITY_CLASSES, STARVATION_GUARD};
pub use window::{Discovered, FairWindow, InFlight, Reader, LANE_JOBS};
