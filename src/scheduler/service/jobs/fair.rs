//! The fair topics' jobs in memory, a peer of the window: their due jobs
//! wait in the [`FairWindow`]'s lanes behind a lock of their own, and are
//! released after the window's round ([`SchedulerJobs::release_fair`]).
//! A release reads the store under this lock only, never under the
//! window's.
//!
//! Locks: this one, then the window's (then the rounds'), never the other
//! way. A release takes the window's briefly: to ask whether the next job
//! it would release is being changed by an ingest batch, and at the end to
//! count the jobs it took as firing (a claim from then on finds them
//! firing) and to give back those a batch started changing meanwhile. Store changes reach the lanes
//! before the window un-marks the jobs a batch changed, so a job cancelled
//! in the store is never released from a lane that has not heard of it.

use super::{SchedulerJobs, Taken};

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::fair::{FairWindow, InFlight, Reader};
use crate::scheduler::store::{Applied, DueKey, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::sync::Lock;

/// The fair lanes and which of their jobs are being fired.
pub(super) struct FairJobs {
    /// Due jobs of fair topics, per tenant, waiting to be released.
    pub(super) lanes: FairWindow,
    /// Jobs released and not yet finished, by where they are stored (a job
    /// put again under a firing id is another entry, not in flight).
    pub(super) firing: InFlight,
}

impl FairJobs {
    /// The lanes of `window`, nothing in flight.
    pub(super) fn new(lanes: FairWindow) -> FairJobs {
        FairJobs {
            lanes,
            firing: InFlight::default(),
        }
    }

    /// Follow the store's changes to fair jobs (the lanes find a removed
    /// key by its place; an added job of another topic is not theirs).
    pub(super) fn follow(&mut self, applied: &[Applied]) {
        for a in applied {
            match a {
                Applied::Removed(k, _) => self.lanes.removed(k),
                Applied::Added(k, job) if self.lanes.is_fair(&job.job.topic) => {
                    self.lanes.added(*k, job, &self.firing)
                }
                Applied::Added(..) => {}
            }
        }
    }

    /// `due`'s fires are over; `retry` of fair topics (their write failed)
    /// waits in the lanes again.
    pub(super) fn finished(&mut self, due: &[(DueKey, StoredJob)], retry: &mut Vec<(DueKey, StoredJob)>) {
        if !self.firing.is_empty() {
            for (k, _) in due {
                self.firing.remove(k);
            }
        }
        let lanes = &self.lanes;
        let fair: Vec<(DueKey, StoredJob)> = retry
            .extract_if(.., |(_, j)| lanes.is_fair(&j.job.topic))
            .collect();
        for (k, j) in fair {
            self.lanes.put_back(k, j);
        }
    }
}

impl SchedulerJobs {
    /// Release due jobs of fair topics at `now_ms` into `round`: up to
    /// `allowance[topic]` of each, in fair order, looking no further into a
    /// partition than `until` (how far it is read, and below its cascade
    /// point); `read` reads the store. Workers idle and nothing due: jobs
    /// that allow it go early. The jobs count as firing, their partitions
    /// as part of the round.
    pub(in crate::scheduler::service) fn release_fair(
        &self,
        now_ms: i64,
        until: &HashMap<i32, i64>,
        allowance: &HashMap<String, usize>,
        read: &mut Reader<'_>,
        round: &mut Taken,
    ) -> Result<(), StoreError> {
        let Some(fair) = &self.fair else {
            return Ok(());
        };
        let mut f = fair.locked();
        let f = &mut *f;
        // Asked once per job picked, the window's lock taken for each ask
        // (an ingest batch marks every job it names: a copy of them all
        // per round would cost more).
        let is_changing = |p: i32, id: &JobId| self.window().is_changing(p, id);
        let mut found = f.lanes.discover(now_ms, until, &f.firing, read)?;
        let mut jobs = Vec::new();
        let mut topics: Vec<&String> = allowance.keys().collect();
        topics.sort();
        for topic in topics {
            let n = allowance[topic];
            if n == 0 {
                continue;
            }
            let due = f.lanes.release(topic, n, now_ms, &f.firing, &is_changing, read)?;
            let left = n - due.len().min(n);
            jobs.extend(due);
            let (early, behind) = f.lanes.release_early(
                topic,
                left,
                now_ms,
                self.span_ms,
                until,
                &f.firing,
                &is_changing,
                read,
            )?;
            jobs.extend(early);
            for p in behind {
                // Held like a due job: the partition is probed and read further.
                found.held.insert(p, now_ms);
            }
        }
        if !jobs.is_empty() {
            let mut w = self.window();
            let (back, released): (Vec<_>, Vec<_>) = jobs
                .into_iter()
                .partition(|(k, j)| w.is_changing(k.partition, &j.job.stored_id()));
            for (k, j) in back {
                // A batch started changing it since it was picked: it waits
                // (its tenant keeps the charge for it, a rare race).
                f.lanes.put_back(k, j);
            }
            let mut rounds = self.firing();
            for (k, j) in &released {
                w.firing_from_elsewhere(k.partition, j.job.stored_id());
                f.firing.insert(*k);
                if round.parts.insert(k.partition) {
                    *rounds.entry(k.partition).or_insert(0) += 1;
                }
            }
            round.due.extend(released);
        }
        for (p, at) in found.held {
            let h = round.held.entry(p).or_insert(at);
            *h = (*h).max(at);
        }
        round.fair_more = found.more;
        Ok(())
    }

    /// Forget fair tenants with nothing waiting and no recent service left.
    pub(in crate::scheduler::service) fn sweep_fair(&self, now_ms: i64) {
        if let Some(mut f) = self.fair_lanes() {
            f.lanes.sweep(now_ms);
        }
    }

    /// The fair window's jobs buffered, tenants waiting and tenants known
    /// per topic (`None`: no fair topics).
    pub(in crate::scheduler::service) fn fair_counts(&self) -> Option<FairCounts> {
        let f = self.fair_lanes()?;
        let l = &f.lanes;
        Some((l.buffered(), l.tenants_waiting(), l.tenants_known()))
    }

    /// Which of `topics` have due jobs waiting in the fair window (`None`:
    /// no fair topics).
    pub(in crate::scheduler::service) fn fair_waiting<'a>(
        &self,
        topics: impl IntoIterator<Item = &'a String>,
    ) -> Option<Vec<String>> {
        let f = self.fair_lanes()?;
        Some(
            topics
                .into_iter()
                .filter(|t| f.lanes.is_waiting(t))
                .cloned()
                .collect(),
        )
    }
}

/// Jobs buffered, then (topic, tenants waiting) and (topic, tenants known).
pub(in crate::scheduler::service) type FairCounts = (usize, Vec<(String, usize)>, Vec<(String, usize)>);
