//! Pacing in the running worker ([`crate::worker::pacing`] hands out the
//! turns): a job about to start on a paced topic starts now if its limiter
//! key's turn is now; waits here, holding no concurrency slot, if its turn
//! is within `[worker] pacing_horizon`; else goes through the scheduler, due
//! at its turn, its key held until it is back (so nothing of its key
//! overtakes it, and memory stays bounded however far ahead turns go).
//! While it waits its entity key stays locked, so its key's later jobs wait
//! behind it; other keys run.

use std::collections::{BTreeMap, VecDeque};

use super::{Entry, Shared, Tp, WorkerState};

use crate::worker::hold::Cause;
use crate::worker::pacing::Pacer;
use crate::worker::Outcome;

/// Paced jobs of a worker.
#[derive(Default)]
pub(super) struct Paced {
    /// Turns handed out and starts made, per (topic, limiter key).
    pacer: Pacer<(usize, Box<[u8]>)>,
    /// Jobs waiting for their turn, by (turn in ms, arrival).
    waiting: BTreeMap<(i64, u64), Entry>,
    arrivals: u64,
    /// Jobs whose turn came: they start before the lock table's.
    pub(super) due: VecDeque<Entry>,
}

impl Paced {
    /// Jobs held here (their keys count as running in the lock table).
    pub(super) fn holding(&self) -> usize {
        self.waiting.len() + self.due.len()
    }

    /// When the earliest waiting job's turn comes, in ms.
    pub(super) fn next_turn(&self) -> Option<i64> {
        self.waiting.keys().next().map(|(t, _)| *t)
    }

    /// Move the jobs whose turn has come by `now_ms` to [`Paced::due`];
    /// whether any job is due.
    pub(super) fn turns_come(&mut self, now_ms: i64) -> bool {
        while let Some(entry) = self.waiting.first_entry() {
            if entry.key().0 > now_ms {
                break;
            }
            let e = entry.remove();
            self.due.push_back(e);
        }
        !self.due.is_empty()
    }

    /// Drop the jobs of a partition let go; the caller unlocks their keys.
    pub(super) fn drop_partition(&mut self, tp: Tp) -> Vec<Entry> {
        let mut out: Vec<Entry> = Vec::new();
        let (gone, keep): (VecDeque<Entry>, VecDeque<Entry>) = std::mem::take(&mut self.due)
            .into_iter()
            .partition(|e| e.tp == tp);
        self.due = keep;
        out.extend(gone);
        let turns: Vec<(i64, u64)> = self
            .waiting
            .iter()
            .filter(|(_, e)| e.tp == tp)
            .map(|(k, _)| *k)
            .collect();
        out.extend(turns.into_iter().filter_map(|k| self.waiting.remove(&k)));
        out
    }
}

/// Whether `entry` may start now: `Some(entry)` to start it (perhaps as a
/// deferral through the scheduler), `None` when it waits here for its turn.
pub(super) fn gate(shared: &Shared, st: &mut WorkerState, mut entry: Entry, now_ms: i64) -> Option<Entry> {
    let Some(rules) = &shared.topics.rules[entry.tp.0] else {
        return Some(entry);
    };
    if entry.instead.is_some() {
        return Some(entry);
    }
    let limiter = entry.job.pacing_key();
    let rule = *rules.rule(limiter);
    let key = (entry.tp.0, Box::from(limiter));
    // A job whose turn was handed out already: waited here, or back from the
    // scheduler where it waited for it.
    let back = st
        .holds
        .get(entry.tp, &entry.job.key)
        .and_then(|h| h.blocker.as_ref())
        .is_some_and(|b| b.id == entry.job.id && b.cause == Cause::Paced);
    let turn = if entry.turn_given || back {
        now_ms
    } else {
        st.paced.pacer.reserve(&key, &rule, now_ms)
    };
    let at = turn.max(st.paced.pacer.allowed_at(&key, &rule, now_ms));
    if at <= now_ms {
        st.paced.pacer.started(&key, &rule, now_ms);
        return Some(entry);
    }
    let horizon = shared.cfg.worker.pacing_horizon.as_millis() as i64;
    let room = st.paced.holding() < shared.cfg.worker.max_buffered / 2;
    if at - now_ms <= horizon && room {
        entry.turn_given = true;
        let first = st.paced.waiting.keys().next().is_none_or(|(t, _)| at < *t);
        st.paced.arrivals += 1;
        st.paced.waiting.insert((at, st.paced.arrivals), entry);
        if first {
            shared.signals.pace_wake.notify_one();
        }
        return None;
    }
    // Far ahead: through the scheduler, due half a horizon before its turn
    // (so that the scheduler's and the consumer's delays are waited out
    // here, in memory, not added to its start); it holds its key.
    let back_at = at - horizon / 2;
    let until = chrono::DateTime::from_timestamp_millis(back_at).unwrap_or_else(chrono::Utc::now);
    entry.instead = Some(Outcome::rate_limited(until));
    Some(entry)
}

/// A handler said its job is rate limited until `until`: its limiter key
/// pauses until then.
pub(super) fn pause(shared: &Shared, tp: Tp, limiter: &[u8], until_ms: i64) {
    let Some(rules) = &shared.topics.rules[tp.0] else {
        return;
    };
    let rule = *rules.rule(limiter);
    shared
        .jobs
        .lock()
        .paced
        .pacer
        .pause(&(tp.0, Box::from(limiter)), &rule, until_ms);
}
