//! The window's side of fair dispatch: jobs of fair topics wait in a
//! [`FairWindow`] instead of the window, and are released from it.

use super::TimerWheel;

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::fair::{Discovered, FairWindow, Reader};
use crate::scheduler::store::{DueKey, StoreError};
use crate::scheduler::stored::StoredJob;

impl TimerWheel {
    /// Release the jobs of these fair topics through `fair` instead of
    /// firing them when due.
    pub fn set_fair(&mut self, fair: FairWindow) {
        self.fair = Some(fair);
    }

    /// Whether `topic` is dispatched fairly.
    pub fn is_fair(&self, topic: &str) -> bool {
        self.fair.as_ref().is_some_and(|f| f.is_fair(topic))
    }

    /// The fair window, if fair topics are configured.
    pub fn fair(&self) -> Option<&FairWindow> {
        self.fair.as_ref()
    }

    /// Forget the fair topics' tenants with nothing waiting and no recent
    /// service left at `now_ms` ([`FairWindow::sweep`]); returns the tenants
    /// still known.
    pub fn sweep_fair(&mut self, now_ms: i64) -> usize {
        self.fair.as_mut().map_or(0, |f| f.sweep(now_ms))
    }

    /// Look at due fair jobs and release up to `allowance[topic]` of each
    /// fair topic in fair order (see [`FairWindow`]), counting them as
    /// firing. `read` reads the store (under this window's lock: reads are
    /// bounded). Returns the jobs and the partitions whose due jobs wait
    /// to be read up to (as in [`Due::held`]).
    pub fn take_fair(
        &mut self,
        now_ms: i64,
        until: &HashMap<i32, i64>,
        allowance: &HashMap<String, usize>,
        read: &mut Reader<'_>,
    ) -> Result<(Vec<(DueKey, StoredJob)>, Discovered), StoreError> {
        let Some(fair) = self.fair.as_mut() else {
            return Ok(Default::default());
        };
        let mut found = fair.discover(now_ms, until, &self.fair_firing, read)?;
        let changing = &self.changing;
        let is_changing = |p: i32, id: &JobId| !changing.is_empty() && changing.contains_key(&(p, *id));
        let mut jobs = Vec::new();
        let mut topics: Vec<&String> = allowance.keys().collect();
        topics.sort();
        for topic in topics {
            let n = allowance[topic];
            if n > 0 {
                let due = fair.release(topic, n, now_ms, &self.fair_firing, &is_changing, read)?;
                let left = n - due.len().min(n);
                jobs.extend(due);
                // Workers idle and nothing due: jobs that allow it go early.
                let (early, behind) = fair.release_early(
                    topic,
                    left,
                    now_ms,
                    self.span_ms,
                    until,
                    &self.fair_firing,
                    &is_changing,
                    read,
                )?;
                jobs.extend(early);
                for p in behind {
                    // Held like a due job: the partition is probed and read further.
                    found.held.insert(p, now_ms);
                }
            }
        }
        for (k, j) in &jobs {
            *self.firing.entry((k.partition, j.job.id)).or_default() += 1;
            self.fair_firing.insert(*k);
        }
        Ok((jobs, found))
    }
}
