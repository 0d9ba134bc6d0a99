//! Dispatch: sleep until the earliest job in the window is due, take what
//! is due (and whose partition is read up to it), hand it to librdkafka in
//! order, and pass the batch to the finisher.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::finish::{finish_loop, FINISH_ROUND_JOBS};
use super::fire::{start_fire, FireBatch};
use super::jobs::SchedulerJobs;
use super::Shared;

use crate::clock::Clock;
use crate::hash::{HashMap, HashSet};
use crate::scheduler::refill::{refill, WindowLock};
use crate::scheduler::store::DueKey;
use crate::scheduler::store::{Store, StoreError};
use crate::scheduler::stored::StoredJob;

pub(super) async fn dispatch_loop(shared: Arc<Shared>) {
    let max_sleep = Duration::from_secs(1);
    // Batches are handed to librdkafka here, in firing order, and finished
    // (acknowledged, tombstoned, deleted) by the finisher, so that jobs coming
    // due meanwhile do not wait for that. The idempotent producer keeps the
    // order per partition; a write that fails fails the later ones of its
    // partition too, and they all go back into the window in run-at order.
    // The finisher's queue is bounded in jobs: a dispatcher ahead of it
    // waits, so the jobs fired and not yet finished stay bounded whatever
    // the backlog. (Not in batches: at a steady rate each round fires a
    // few jobs, and a few dozen small batches would make the dispatcher
    // wait on every store flush of the finisher.)
    let room = Arc::new(tokio::sync::Semaphore::new(FINISH_QUEUE_JOBS));
    let (to_finish, inbox) = tokio::sync::mpsc::unbounded_channel();
    let finisher = tokio::spawn(finish_loop(shared.clone(), inbox));
    let mut holding = Holding::default();
    loop {
        if shared.signals.stop.is_cancelled() {
            break;
        }
        // Read before the window: `until` only grows, so a stale copy only
        // holds jobs back a little longer.
        let mut until = shared.reads.caught_up().snapshot();
        if shared.reads.fire_unread.load(Ordering::Relaxed) {
            until.values_mut().for_each(|u| *u = i64::MAX);
        }
        let allowance = shared.fair.allowance(&shared);
        let round = Round::take(
            &shared.jobs,
            &shared.store,
            &*shared.clock,
            shared.cfg.scheduler.fire_batch,
            &until,
            &allowance,
        );
        let Round {
            now_ms: now,
            due,
            direct,
            parts,
            wake_at,
            held,
            behind_cascade,
            fair_from,
        } = match round {
            Ok(r) => r,
            Err(e) => {
                shared.fail(e.to_string());
                break;
            }
        };
        if behind_cascade {
            // The cascader wakes the dispatcher when it has moved on.
            shared.signals.cascade_wanted.notify_one();
        }
        holding.update(&shared, &held, now);
        shared.fair.after_round(&shared, &due[fair_from..], &allowance);
        if !due.is_empty() {
            let writes = start_fire(&shared, &due).await;
            let jobs = due.len().clamp(1, FINISH_QUEUE_JOBS) as u32;
            let Ok(room) = room.clone().acquire_many_owned(jobs).await else {
                break;
            };
            let batch = FireBatch {
                due,
                direct,
                writes,
                parts,
                room,
            };
            if to_finish.send(batch).is_err() {
                break; // the finisher ended: the scheduler is stopping
            }
            continue;
        }
        // Sleep until the next job is due; a wake-up re-reads the clock, so
        // the sleep is capped to notice a clock that jumps (tests' manual clocks).
        let sleep = wake_at
            .map(|t| Duration::from_millis(t.saturating_sub(now).max(0) as u64))
            .unwrap_or(max_sleep)
            .min(max_sleep);
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = shared.signals.wake.notified() => {}
            _ = shared.signals.stop.cancelled() => break,
        }
    }
    // Let the fires in flight finish (acknowledged jobs are deleted).
    drop(to_finish);
    let _ = finisher.await;
}

/// One round of the dispatcher: what to fire now and when to look again.
pub(super) struct Round {
    /// The clock's time the round was taken at, in ms.
    pub(super) now_ms: i64,
    /// Jobs due, in run-at order, at most a fire batch.
    pub(super) due: Vec<(DueKey, StoredJob)>,
    /// Which of `due` are direct jobs (not in the store, nor the
    /// changelog), with when each entered the window.
    pub(super) direct: HashMap<DueKey, i64>,
    /// The partitions of `due`.
    pub(super) parts: HashSet<i32>,
    /// When something next comes due or the window needs a refill.
    pub(super) wake_at: Option<i64>,
    /// Per partition, the latest run-at of due jobs held because the
    /// partition is not read up to it (`until`).
    pub(super) held: HashMap<i32, i64>,
    /// A partition's cascade point kept the window from reaching a span ahead.
    pub(super) behind_cascade: bool,
    /// Where the jobs of fair topics start in `due` (released after the others).
    pub(super) fair_from: usize,
}

impl Round {
    /// Refill the window from the store if it is time (reading the store
    /// with the window unlocked), then take what is due by `clock` (at most
    /// `max`), holding back a partition's jobs due after `until` (how far it
    /// has been read), and count the batch as firing.
    pub(super) fn take(
        jobs: &SchedulerJobs,
        store: &Store,
        clock: &dyn Clock,
        max: usize,
        until: &HashMap<i32, i64>,
        allowance: &HashMap<String, usize>,
    ) -> Result<Round, StoreError> {
        let now_ms = clock.now().timestamp_millis();
        let mut behind_cascade = if jobs
            .with_window(|w| w.refill_due_ms())
            .is_some_and(|t| t <= now_ms)
        {
            refill(jobs, store, now_ms)?.behind_cascade
        } else {
            false
        };
        // Fair topics read no further than each partition's cascade point
        // (looked up before the round is taken: an error leaves nothing
        // counted as firing).
        let fair_until = if jobs.has_fair() {
            let (fair_until, behind) = below_cascade(store, until, now_ms)?;
            behind_cascade |= behind;
            Some(fair_until)
        } else {
            None
        };
        let mut taken = jobs.take_round(now_ms, max, until);
        if let Some(fair_until) = fair_until {
            // After the window's round: as many as the fair topics'
            // backlogs allow and the round has room for, in fair order.
            let room = max.saturating_sub(taken.due.len());
            let allowance: HashMap<String, usize> = allowance
                .iter()
                .map(|(t, n)| (t.clone(), (*n).min(room)))
                .collect();
            let mut read = |p, after, until_ms, limit| store.scan_due(p, after, until_ms, limit);
            if let Err(e) = jobs.release_fair(now_ms, &fair_until, &allowance, &mut read, &mut taken) {
                // The window's jobs go back; the round is over.
                jobs.finished(&[], &taken.due, taken.due.clone(), &taken.direct);
                jobs.rounds_done([&taken.parts]);
                return Err(e);
            }
        }
        // Jobs due but held wake the dispatcher when their partition has
        // been read further (ingest and probes notify); a window held back
        // by the cascade point, when the cascader has moved it.
        let refill_at = taken.refill_ms.filter(|_| !behind_cascade);
        let fair_at = taken.fair_more.then_some(now_ms);
        let wake_at = [taken.next_ms, refill_at, fair_at].into_iter().flatten().min();
        Ok(Round {
            now_ms,
            due: taken.due,
            direct: taken.direct,
            parts: taken.parts,
            wake_at,
            held: taken.held,
            behind_cascade,
            fair_from: taken.fair_from,
        })
    }
}

/// How far the fair window may look into each partition: `until`, and not
/// past the store's cascade point. The window reads the store's near range
/// only, and every job due before the cascade point is there; a job past it
/// is still in a far bucket, and a cursor moved over it would never come
/// back for it once the cascade brings it near (after a take-over or an
/// outage, the cascade point can trail the clock). Also returns whether a
/// partition's cascade point is behind the clock (the cascader is asked).
fn below_cascade(
    store: &Store,
    until: &HashMap<i32, i64>,
    now_ms: i64,
) -> Result<(HashMap<i32, i64>, bool), StoreError> {
    let mut behind = false;
    let mut out = HashMap::default();
    for (p, u) in until {
        let cascaded_to = store.checkpoint(*p)?.cascaded_to;
        behind |= cascaded_to <= now_ms;
        out.insert(*p, (*u).min(cascaded_to.saturating_sub(1)));
    }
    Ok((out, behind))
}

/// About how many fired jobs may wait for the finisher (four of its rounds).
const FINISH_QUEUE_JOBS: usize = 4 * FINISH_ROUND_JOBS;

/// Due jobs held because their schedule partition has not been read up to
/// their run-at: asks for probes, and says so when it lasts.
#[derive(Default)]
pub(super) struct Holding {
    /// Since when jobs have been held, and when that was last logged.
    pub(super) since: Option<(Instant, Option<Instant>)>,
}

/// How long jobs may be held before the dispatcher logs it (then again as often).
pub(super) const HELD_WARNING: Duration = Duration::from_secs(5);

impl Holding {
    fn update(&mut self, shared: &Shared, held: &HashMap<i32, i64>, now_ms: i64) {
        if held.is_empty() {
            if let Some((since, Some(_))) = self.since.take() {
                info!(held_for = ?since.elapsed(), "held jobs released: schedule partitions read up to their run-at");
            }
            return;
        }
        let mut gate = shared.reads.caught_up();
        let ask = held
            .iter()
            .fold(false, |ask, (p, due_ms)| gate.want(*p, *due_ms) || ask);
        if ask {
            // Full: a probe is asked for already.
            let _ = shared.reads.probe.try_send(());
        }
        let (since, logged) = self.since.get_or_insert((Instant::now(), None));
        if logged.unwrap_or(*since).elapsed() >= HELD_WARNING {
            *logged = Some(Instant::now());
            for (p, due_ms) in held {
                let (read_to, end) = gate
                    .progress(*p)
                    .map_or((-1, None), |g| (g.read_to, g.probed_end));
                warn!(partition = p, held_for = ?since.elapsed(), latest_held_late_ms = now_ms - due_ms,
                    read_to, end = ?end, "due jobs held: the schedule partition is not read up to their run-at yet (a cancel written before then would be missed)");
            }
        }
    }
}

#[cfg(test)]
mod tests;
