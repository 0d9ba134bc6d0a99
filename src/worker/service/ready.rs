//! Starting jobs: the ready jobs the lock table and the paced turns hand
//! out, as many as free slots allow ([`start_ready`], called wherever a job
//! can become ready: a batch read, a job settled, a turn come, the
//! coordinator heard from again), and the task that hands out paced turns
//! when they come ([`release_turns`]).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::pace;
use super::{Entry, Shared, WorkerState};

/// A job taken from the lock table to run.
pub(super) struct Start {
    pub(super) entry: Entry,
    pub(super) cancel: CancellationToken,
    pub(super) generation: u64,
}

/// Take as many ready jobs as free slots allow (paced jobs whose turn came
/// first); the caller runs them.
pub(super) fn start_ready(shared: &Shared, st: &mut WorkerState) -> Vec<Start> {
    let mut starts = Vec::new();
    if !shared.in_touch(st) {
        return starts;
    }
    let now_ms = shared.clock.now().timestamp_millis();
    while st.running() < shared.cfg.worker.concurrency {
        let Some(entry) = st.paced.due.pop_front().or_else(|| st.table.next_ready()) else {
            break;
        };
        if !st.owned.contains_key(&entry.tp) {
            // Partition gone since the job was buffered: forget it.
            let key = entry.job.key.clone();
            st.table.complete(&key);
            continue;
        }
        // On a paced topic, a job whose turn is ahead waits for it.
        let Some(entry) = pace::gate(shared, st, entry, now_ms) else {
            continue;
        };
        let Some(owned) = st.owned.get(&entry.tp) else {
            continue;
        };
        if entry.instead.is_some() {
            // Settled without its handler (a write or two): no slot taken.
            st.no_slot += 1;
        }
        let cancel = owned.cancel.clone();
        let generation = owned.generation;
        *st.in_flight.entry(entry.tp).or_insert(0) += 1;
        starts.push(Start {
            entry,
            cancel,
            generation,
        });
    }
    starts
}

/// The task that starts paced jobs when their turn comes.
pub(super) async fn release_turns(shared: Arc<Shared>) {
    loop {
        let next = shared.jobs.next_turn();
        let now_ms = shared.clock.now().timestamp_millis();
        let sleep = next.map_or(Duration::from_secs(1), |t| {
            Duration::from_millis(t.saturating_sub(now_ms).max(0) as u64)
        });
        tokio::select! {
            _ = tokio::time::sleep(sleep) => {}
            _ = shared.signals.pace_wake.notified() => {}
            _ = shared.signals.stop.cancelled() => return,
        }
        let starts = {
            let mut st = shared.jobs.lock();
            let now_ms = shared.clock.now().timestamp_millis();
            if !st.paced.turns_come(now_ms) {
                continue;
            }
            start_ready(&shared, &mut st)
        };
        shared.dispatch(starts);
    }
}
