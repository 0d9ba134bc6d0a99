//! A fair topic with jobs waiting and none released for a while: said so,
//! with what holds the releases back, so that an operator (or a failed
//! test's log) tells a full backlog from a dispatcher that lost track.

use std::time::{Duration, Instant};

use tracing::warn;

use super::super::{fair_status, FairStatus};
use super::Shared;
use crate::hash::HashMap;

/// How long a fair topic may release nothing while it could before it is
/// logged (then again as often).
const STALL_WARNING: Duration = Duration::from_secs(5);

/// How long a fair topic may release nothing for want of allowance (the
/// workers finishing nothing of the backlog) before it is logged.
const SLOW_WORKERS: Duration = Duration::from_secs(60);

/// Per fair topic: since when it has had jobs waiting and released none,
/// and when that was last logged.
#[derive(Default)]
pub(super) struct Stalled {
    since: HashMap<String, (Instant, Option<Instant>)>,
}

impl Stalled {
    /// After a round: `released` jobs per topic this round, `allowance`
    /// what the round could release.
    pub(super) fn update(
        &mut self,
        shared: &Shared,
        released: &HashMap<&str, usize>,
        allowance: &HashMap<String, usize>,
    ) {
        // Most rounds release from every fair topic: nothing to look at,
        // and the window's lock is not taken again.
        let idle: Vec<&String> = (shared.cfg.fair.topics.iter())
            .filter(|t| released.get(t.as_str()).is_none_or(|n| *n == 0))
            .collect();
        if idle.is_empty() && self.since.is_empty() {
            return;
        }
        let Some(waiting) = shared.jobs.fair_waiting(idle) else {
            return;
        };
        self.since.retain(|t, _| waiting.contains(t));
        for topic in waiting {
            let (since, logged) = self.since.entry(topic.clone()).or_insert((Instant::now(), None));
            // A full backlog is the workers' pace, said only when it lasts.
            let can = allowance.get(&topic).is_some_and(|n| *n > 0);
            let after = if can { STALL_WARNING } else { SLOW_WORKERS };
            if logged.unwrap_or(*since).elapsed() < after {
                continue;
            }
            *logged = Some(Instant::now());
            let f = fair_status(shared);
            let (backlog, target) = (
                FairStatus::of(&f.backlog, &topic),
                FairStatus::of(&f.target, &topic),
            );
            let tenants = FairStatus::of(&f.tenants_waiting, &topic).unwrap_or(0);
            warn!(topic = %topic, stalled_for = ?since.elapsed(), allowance = allowance.get(&topic).copied().unwrap_or(0),
                backlog = ?backlog, target = ?target, tenants_waiting = tenants, buffered = f.buffered,
                "fair topic: jobs waiting and none released (allowance 0: the workers have not finished the backlog; backlog None: their progress was never read)");
        }
    }
}
