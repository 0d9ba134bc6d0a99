//! Early release: jobs within their early allowance, for idle workers.

use std::sync::Arc;

use super::{FairWindow, InFlight, Reader, Released, READ_JOBS};
use crate::hash::{HashMap, HashSet};
use crate::job::JobId;
use crate::scheduler::store::{DueKey, StoreError};

impl FairWindow {
    /// Release up to `max` jobs of `topic` before their run-at, for idle
    /// workers: nothing of the topic waits and each partition's due jobs
    /// have all been looked at. Jobs due within `lookahead_ms` whose early
    /// allowance has begun (`kairos-early`; retries never carry one) go,
    /// earliest first, and only the first pending job of each key, so a
    /// key's jobs keep their order. A partition not read up to now
    /// (`until`) releases nothing early: it is returned, to be read further.
    #[allow(clippy::too_many_arguments)]
    pub fn release_early(
        &mut self,
        topic: &str,
        max: usize,
        now_ms: i64,
        lookahead_ms: i64,
        until: &HashMap<i32, i64>,
        in_flight: &InFlight,
        changing: &dyn Fn(i32, &JobId) -> bool,
        read: &mut Reader<'_>,
    ) -> Result<(Released, Vec<i32>), StoreError> {
        let mut out = Vec::new();
        let mut behind = Vec::new();
        if max == 0 || self.is_waiting(topic) {
            return Ok((out, behind));
        }
        let mut parts: Vec<(i32, DueKey)> = self
            .cursors
            .iter()
            .filter_map(|(p, c)| c.filter(|c| c.seq == u64::MAX).map(|c| (*p, c)))
            .collect();
        parts.sort_unstable_by_key(|(p, _)| *p);
        for (p, cursor) in parts {
            let read_up = until.get(&p).is_some_and(|u| *u >= now_ms) && cursor.run_at_ms >= now_ms;
            let mut seen: HashSet<Vec<u8>> = HashSet::default();
            for (k, job) in read(p, Some(cursor), now_ms.saturating_add(lookahead_ms), READ_JOBS)? {
                let j = &job.job;
                if j.topic != topic || !seen.insert(j.key.clone()) {
                    continue;
                }
                let early =
                    j.early.is_some() && j.attempt <= 1 && j.earliest_start().timestamp_millis() <= now_ms;
                if !early || in_flight.contains(&k) || changing(p, &j.stored_id()) {
                    continue;
                }
                if !read_up {
                    // A cancel written until now must be read first.
                    behind.push(p);
                    break;
                }
                if let Some(t) = self.topics.get_mut(topic) {
                    let pick = crate::scheduler::fair::Pick {
                        tenant: Arc::from(j.tenant.as_deref().unwrap_or("")),
                        class: j.priority.class(),
                    };
                    t.order.charge(&pick, now_ms, 1.0);
                }
                out.push((k, job));
                if out.len() >= max {
                    return Ok((out, behind));
                }
            }
        }
        Ok((out, behind))
    }
}
