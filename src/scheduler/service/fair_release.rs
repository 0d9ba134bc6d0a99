//! Fair release, the dispatcher's side: how many jobs of each fair topic a
//! round may release, what a round released, and a fair topic that has
//! released nothing for a while. How many is the workers' backlog against
//! its target ([`backlog`], read by thread `kairos-backlog`); which
//! tenant's job goes next is the fair lanes' decision
//! (`service/jobs/fair.rs`).

use std::sync::Mutex;

use super::Shared;

use crate::hash::HashMap;
use crate::scheduler::store::DueKey;
use crate::scheduler::stored::StoredJob;
use crate::sync::Lock;

/// The fair topics' release policy: their backlogs and the stall watch.
pub(super) struct FairRelease {
    /// Jobs released and not yet finished by the workers, per fair topic.
    backlog: Backlog,
    /// Fair topics with jobs waiting and none released lately.
    stalled: Mutex<Stalled>,
}

impl FairRelease {
    /// Nothing released yet of `topics`.
    pub(super) fn new(topics: &[String]) -> Self {
        FairRelease {
            backlog: Backlog::new(topics),
            stalled: Mutex::new(Stalled::default()),
        }
    }

    /// The fair topics' backlogs.
    pub(super) fn backlog(&self) -> &Backlog {
        &self.backlog
    }

    /// Jobs of each fair topic this instance may release now: its share of
    /// the topic's backlog target (by the schedule partitions it owns) less
    /// the topic's backlog.
    pub(super) fn allowance(&self, shared: &Shared) -> HashMap<String, usize> {
        let fair = &shared.cfg.fair;
        if fair.topics.is_empty() {
            return HashMap::default();
        }
        let owned = shared.jobs.partitions().len() as u64;
        let total = (shared.cfg.topics.schedule_partitions.max(1) as u64).max(owned);
        let share = owned as f64 / total as f64;
        self.backlog
            .allowance(fair.backlog_target, fair.backlog_time, share)
    }

    /// A round released `jobs` of fair topics, out of `allowance`: they
    /// count in their topics' backlogs (a topic released up to its
    /// allowance was capped by it), and a topic with jobs waiting that
    /// released none is watched.
    pub(super) fn after_round(
        &self,
        shared: &Shared,
        jobs: &[(DueKey, StoredJob)],
        allowance: &HashMap<String, usize>,
    ) {
        if shared.cfg.fair.topics.is_empty() {
            return;
        }
        let mut released: HashMap<&str, usize> = HashMap::default();
        for (_, s) in jobs {
            *released.entry(s.job.topic.as_str()).or_default() += 1;
        }
        for (topic, n) in &released {
            self.backlog.released(topic, *n as u64);
            if allowance.get(*topic).is_some_and(|a| n >= a) {
                self.backlog.capped(topic);
            }
        }
        self.stalled.locked().update(shared, &released, allowance);
    }
}

mod backlog;
mod stalled;

pub(super) use backlog::{backlog_loop, Backlog};
use stalled::Stalled;
