//! The worker's jobs in memory, with one owner: [`WorkerJobs`] keeps the
//! lock table, the offset tracker, the owned partitions, the running
//! handlers per partition, held keys and paced jobs ([`WorkerState`]) behind
//! one lock, with the condvar that says a handler finished and the lock
//! that orders commits.
//!
//! The steps that touch one piece at a time are transitions here, each
//! taking the lock once: a partition's assignment ([`WorkerJobs::assign`])
//! and release ([`WorkerJobs::drop_partitions`], [`WorkerJobs::wait_idle`],
//! [`WorkerJobs::let_go`]), a record written off the poll thread
//! ([`WorkerJobs::begin_write`], [`WorkerJobs::write_done`]), the commit
//! points to store ([`WorkerJobs::take_commit_points`]). The decisions that
//! weigh several pieces together under the lock (which jobs start, how a
//! settled job changes its key's hold) take the state with
//! [`WorkerJobs::lock`] and run as functions over [`WorkerState`].

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::held_round::{self, Naming};
use super::round::{CommitPoint, Round};
use super::{Owned, Tp, WorkerState};

use crate::hash::HashMap;
use crate::sync::{Lock, Wait};
use crate::wire::OwnedRecord;
use crate::worker::hold::Holds;

/// The worker's jobs in memory (see the module doc).
pub(super) struct WorkerJobs {
    state: Mutex<WorkerState>,
    /// Signalled whenever a handler finishes.
    finished: Condvar,
    /// Whether a thread waits on `finished` (saves a wake-up syscall per
    /// batch of finished jobs when nobody does).
    waiters: AtomicUsize,
    /// Held by the keep-alive thread from reading the commit points to the
    /// end of its commit, and by a release around its last commit: a
    /// keep-alive commit of older commit points never lands after it.
    commit_lock: Mutex<()>,
    /// Keys held now (the state's `holds`, read without its lock).
    held_now: Arc<AtomicUsize>,
    /// Exactly-once mode: how held-topic records are named (the
    /// transactions of holdable partitions write them).
    naming: Option<Naming>,
}

impl WorkerState {
    /// Mark the record at `offset` of `tp` finished; if it belongs to the
    /// current ownership of its partition (`generation`; `None`: any), its
    /// commit point may advance.
    pub(super) fn finish(&mut self, tp: Tp, offset: i64, generation: Option<u64>) {
        let current = self.owned.get(&tp).map(|o| o.generation);
        if current.is_none() || (generation.is_some() && generation != current) {
            return;
        }
        if let Some(c) = self.tracker.finish(tp, offset) {
            self.to_store.insert(tp, c);
        }
    }

    /// `tp`'s commit point `offset`, with the claim its commits carry.
    pub(super) fn commit_point(&self, tp: Tp, offset: i64) -> CommitPoint {
        (tp, offset, self.owned.get(&tp).and_then(|o| o.claim))
    }

    /// Keep `records`, the writes of the record of `tp` at `offset`, for
    /// the transaction past it; false when `tp` is not owned in
    /// `generation` any more.
    fn stage(&mut self, tp: Tp, generation: u64, offset: i64, records: Vec<OwnedRecord>) -> bool {
        if self.owned.get(&tp).map(|o| o.generation) != Some(generation) {
            return false;
        }
        self.keep_staged(tp, offset, records);
        true
    }

    /// Add `records` to those staged for the record of `tp` at `offset`.
    pub(super) fn keep_staged(&mut self, tp: Tp, offset: i64, records: Vec<OwnedRecord>) {
        if !records.is_empty() {
            let at = self.staged.entry(tp).or_default().entry(offset).or_default();
            at.extend(records);
        }
    }

    /// The staged writes of `points`' partitions below their points, taken
    /// out, in order.
    fn staged_below(&mut self, points: &[CommitPoint]) -> Vec<(Tp, i64, Vec<OwnedRecord>)> {
        let mut out = Vec::new();
        for (tp, point, _) in points {
            let Some(by_offset) = self.staged.get_mut(tp) else {
                continue;
            };
            let above = by_offset.split_off(point);
            let below = std::mem::replace(by_offset, above);
            if by_offset.is_empty() {
                self.staged.remove(tp);
            }
            out.extend(below.into_iter().map(|(o, r)| (*tp, o, r)));
        }
        out
    }
}

impl WorkerJobs {
    /// An empty state, with `holds` for the held keys; `naming` in
    /// exactly-once mode.
    pub(super) fn new(holds: Holds<Tp>, naming: Option<Naming>) -> WorkerJobs {
        WorkerJobs {
            naming,
            held_now: holds.counter(),
            state: Mutex::new(WorkerState {
                holds,
                ..WorkerState::default()
            }),
            finished: Condvar::new(),
            waiters: AtomicUsize::new(0),
            commit_lock: Mutex::new(()),
        }
    }

    /// The state, for a decision that weighs several of its pieces.
    pub(super) fn lock(&self) -> MutexGuard<'_, WorkerState> {
        self.state.locked()
    }

    /// Wait until a handler finishes, or `timeout`.
    pub(super) fn wait_finished<'a>(
        &self,
        st: MutexGuard<'a, WorkerState>,
        timeout: Duration,
    ) -> MutexGuard<'a, WorkerState> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let st = self.finished.waiting_at_most(st, timeout);
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        st
    }

    /// Wake the threads waiting in [`WorkerJobs::wait_finished`], if any.
    /// Called after the state lock is released; a waiter registers under
    /// the lock, so it either sees the change or is counted here.
    pub(super) fn notify_finished(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.finished.notify_all();
        }
    }

    /// The commit order lock: taken before the state's, by whoever reads
    /// commit points and commits them synchronously.
    pub(super) fn committing(&self) -> MutexGuard<'_, ()> {
        self.commit_lock.locked()
    }

    // --- partitions ---

    /// `tps` are assigned, each a new ownership (its handlers cancelled by
    /// a child of `stop`) with its claim from `claims`; the coordinator
    /// just answered.
    pub(super) fn assign(&self, tps: &[Tp], claims: &HashMap<Tp, u64>, stop: &CancellationToken) {
        let mut st = self.lock();
        st.heard = Some(Instant::now());
        for tp in tps {
            st.next_generation += 1;
            let owned = Owned {
                cancel: stop.child_token(),
                generation: st.next_generation,
                claim: claims.get(tp).copied(),
            };
            st.owned.insert(*tp, owned);
        }
    }

    /// The partitions owned.
    pub(super) fn owned(&self) -> Vec<Tp> {
        self.lock().owned.keys().copied().collect()
    }

    /// First step of a release: drop `tps`' buffered jobs (paced ones
    /// unlock their keys) and cancel their running handlers. Returns how
    /// many jobs were dropped.
    pub(super) fn drop_partitions(&self, tps: &[Tp]) -> usize {
        let mut st = self.lock();
        let mut dropped = 0;
        for tp in tps {
            dropped += st.table.drop_partition(*tp).len();
            // Paced jobs waiting for their turn hold their keys: unlock them.
            for e in st.paced.drop_partition(*tp) {
                st.table.complete(&e.job.key);
                dropped += 1;
            }
            if let Some(o) = st.owned.get(tp) {
                o.cancel.cancel();
            }
        }
        dropped
    }

    /// Wait until nothing of `tps` runs (handlers and writes); returns the
    /// partitions still running something at `deadline`.
    pub(super) fn wait_idle(&self, tps: &[Tp], deadline: Instant) -> Vec<Tp> {
        let mut st = self.lock();
        loop {
            let busy: Vec<Tp> = tps
                .iter()
                .filter(|tp| st.in_flight.get(tp).copied().unwrap_or(0) > 0)
                .copied()
                .collect();
            let left = deadline.saturating_duration_since(Instant::now());
            if busy.is_empty() || left.is_zero() {
                return busy;
            }
            st = self.wait_finished(st, left.min(Duration::from_millis(100)));
        }
    }

    /// Last step of a release (under [`WorkerJobs::committing`]): forget
    /// `tps`; returns what to commit for them (their staged writes above
    /// their commit points are dropped: those jobs run again elsewhere;
    /// in exactly-once mode a partition whose keys can be held commits its
    /// finished jobs' writes with its progress instead).
    pub(super) fn let_go(&self, tps: &[Tp]) -> Round {
        let mut st = self.lock();
        let mut points = Vec::new();
        for tp in tps {
            if let Some(c) = st.tracker.commit_point(*tp) {
                points.push(st.commit_point(*tp, c));
            }
        }
        let round = self.round_of(&mut st, points, tps.iter().copied());
        for tp in tps {
            st.dirty.remove(tp);
            st.done_above.remove(tp);
            st.staged.remove(tp);
            st.tracker.remove(*tp);
            st.owned.remove(tp);
            st.to_store.remove(tp);
            st.holds.drop_partition(*tp);
            st.waiting.retain(|(p, _), _| p != tp);
        }
        round
    }

    // --- records and offsets ---

    /// The jobs among a batch's records count as unfinished (those of
    /// partitions not owned are left out).
    pub(super) fn track_read(&self, records: impl IntoIterator<Item = (Tp, i64)>) {
        let mut st = self.lock();
        for (tp, offset) in records {
            if st.owned.contains_key(&tp) {
                st.tracker.read(tp, offset);
            }
        }
    }

    /// A record of `tp` at `offset` is written off the poll thread: it
    /// counts as unfinished and as running for its partition's release.
    /// Returns the ownership's cancel token and generation (`None`: `tp` is
    /// not owned).
    pub(super) fn begin_write(&self, tp: Tp, offset: i64) -> Option<(CancellationToken, u64)> {
        let mut st = self.lock();
        let owned = st.owned.get(&tp)?;
        let ours = (owned.cancel.clone(), owned.generation);
        st.tracker.read(tp, offset);
        *st.in_flight.entry(tp).or_insert(0) += 1;
        Some(ours)
    }

    /// The write begun by [`WorkerJobs::begin_write`] is over; `written`:
    /// acknowledged, or made into `staged` records to stage (the record is
    /// finished), else given up.
    pub(super) fn write_done(&self, tp: Tp, offset: i64, generation: u64, written: Option<Vec<OwnedRecord>>) {
        {
            let mut st = self.lock();
            if let Some(n) = st.in_flight.get_mut(&tp) {
                *n = n.saturating_sub(1);
            }
            if let Some(records) = written {
                if st.stage(tp, generation, offset, records) {
                    st.finish(tp, offset, Some(generation));
                }
            }
        }
        self.notify_finished();
    }

    /// Stage the writes of the record of `tp` at `offset` (see
    /// [`crate::worker::settle::Stage`]).
    pub(super) fn stage(&self, tp: Tp, generation: u64, offset: i64, records: Vec<OwnedRecord>) -> bool {
        self.lock().stage(tp, generation, offset, records)
    }

    /// A record of `tp` at `offset` needs nothing done: it is finished at
    /// once (if `tp` is owned).
    pub(super) fn finish_now(&self, tp: Tp, offset: i64) {
        let mut st = self.lock();
        if st.owned.contains_key(&tp) {
            st.tracker.read(tp, offset);
            st.finish(tp, offset, None);
        }
    }

    /// The commit points that moved since the last call.
    pub(super) fn take_commit_points(&self) -> Vec<CommitPoint> {
        self.take_round(None).points
    }

    /// The commit points that moved since the last call, with the staged
    /// writes below them; when none moved and `keep_alive` is given, where
    /// every owned partition stands if [`WorkerJobs::keep_alive_points`]
    /// asks for a commit (with whatever was staged below meanwhile).
    pub(super) fn take_round(&self, keep_alive: Option<Duration>) -> Round {
        let mut st = self.lock();
        let moved: Vec<(Tp, i64)> = st.to_store.drain().collect();
        let mut points: Vec<CommitPoint> = moved.into_iter().map(|(tp, c)| st.commit_point(tp, c)).collect();
        if let (true, Some(stale_after)) = (points.is_empty(), keep_alive) {
            points = keep_alive_points(&st, stale_after).unwrap_or_default();
        }
        let owned: Vec<Tp> = st.owned.keys().copied().collect();
        self.round_of(&mut st, points, owned.into_iter())
    }

    /// The round of `points`: what `tps` have to commit if their keys can
    /// be held (exactly-once mode; see `held_round`), then the staged
    /// writes below the points.
    fn round_of(
        &self,
        st: &mut WorkerState,
        points: Vec<CommitPoint>,
        tps: impl Iterator<Item = Tp>,
    ) -> Round {
        let mut round = Round {
            points,
            ..Round::default()
        };
        if let Some(naming) = &self.naming {
            for tp in tps {
                held_round::take(st, naming, tp, &mut round);
            }
        }
        let below = st.staged_below(&round.points);
        round.records.extend(below);
        round
    }

    /// A round that did not commit (its transaction aborted): its points
    /// and writes are taken again by the next one, for the partitions still
    /// owned (a point that moved on since stays where it is).
    pub(super) fn put_back(&self, round: Round) {
        let mut st = self.lock();
        for (tp, point, _) in round.points {
            if st.owned.contains_key(&tp) {
                let at = st.to_store.entry(tp).or_insert(point);
                *at = (*at).max(point);
            }
        }
        for (tp, offset, records) in round.records {
            if st.owned.contains_key(&tp) {
                st.keep_staged(tp, offset, records);
            }
        }
        held_round::put_back(&mut st, round.dirty);
    }

    /// Of records just read, those not done already: in exactly-once mode,
    /// a partition's last owner may have committed the writes of records
    /// above its commit point (see [`crate::worker::hold::progress`]);
    /// those are finished at once. `at` names a record's partition and
    /// offset.
    pub(super) fn skip_done<T>(&self, records: Vec<T>, at: impl Fn(&T) -> (Tp, i64)) -> Vec<T> {
        let mut st = self.lock();
        if st.done_above.is_empty() {
            return records;
        }
        let st = &mut *st;
        // All count as read first: one done finished alone would move the
        // commit point past the others.
        for r in &records {
            let (tp, offset) = at(r);
            if st.owned.contains_key(&tp) {
                st.tracker.read(tp, offset);
            }
        }
        records
            .into_iter()
            .filter(|r| {
                let (tp, offset) = at(r);
                let done =
                    st.owned.contains_key(&tp) && st.done_above.get(&tp).is_some_and(|d| d.contains(offset));
                if done {
                    tracing::debug!(
                        partition = tp.1,
                        offset,
                        "done by the partition's last owner: skipped"
                    );
                    st.finish(tp, offset, None);
                }
                !done
            })
            .collect()
    }

    /// Where every owned partition stands, to commit when the coordinator
    /// last answered `stale_after` ago or longer, or jobs wait for an
    /// answer (`None`: no commit is needed).
    pub(super) fn keep_alive_points(&self, stale_after: Duration) -> Option<Vec<CommitPoint>> {
        keep_alive_points(&self.lock(), stale_after)
    }

    // --- reports ---

    /// Jobs read and not started.
    pub(super) fn buffered(&self) -> usize {
        self.lock().buffered()
    }

    /// Whether no key is held (without the lock).
    pub(super) fn nothing_held(&self) -> bool {
        self.held_now.load(Ordering::Relaxed) == 0
    }

    /// Keys held now.
    pub(super) fn held(&self) -> usize {
        self.lock().holds.len()
    }

    /// Since when the longest-held key has been held (ms), if any is.
    pub(super) fn oldest_hold_ms(&self) -> Option<i64> {
        self.lock().holds.oldest_ms()
    }

    /// Records read and not yet below the commit point.
    pub(super) fn uncommitted(&self) -> u64 {
        self.lock().tracker.uncommitted()
    }

    /// Paced jobs waiting for their turn.
    pub(super) fn paced_waiting(&self) -> usize {
        self.lock().paced.holding()
    }

    /// When the next paced turn comes (ms), if a job waits for one.
    pub(super) fn next_turn(&self) -> Option<i64> {
        self.lock().paced.next_turn()
    }
}

/// See [`WorkerJobs::keep_alive_points`].
fn keep_alive_points(st: &WorkerState, stale_after: Duration) -> Option<Vec<CommitPoint>> {
    let stale = st.heard.is_none_or(|t| t.elapsed() >= stale_after);
    if !(stale || st.out_of_touch && st.buffered() > 0) {
        return None;
    }
    let points = st
        .owned
        .keys()
        .filter_map(|tp| st.tracker.commit_point(*tp).map(|c| st.commit_point(*tp, c)))
        .collect();
    Some(points)
}

#[cfg(test)]
use crate::worker::hold::{
    progress::{self, Done},
    record,
};

#[cfg(test)]
mod tests;
