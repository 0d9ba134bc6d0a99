//! The scheduler's jobs in memory, with one owner: [`SchedulerJobs`] keeps the
//! window (the near future, the owned partitions, which jobs are being
//! fired or changed), the fair topics' lanes beside it (see [`fair`]), the
//! schedule offsets that direct jobs hold back, and the fire rounds in
//! flight per partition. The service's threads and tasks change them only
//! through the transitions below.
//!
//! Each of the four has its own lock, so that the offsets' bookkeeping
//! (ingest storing offsets, the finisher releasing direct jobs) does not
//! wait behind a dispatcher's round, and a fair release's store reads do
//! not hold the window: they hold the fair lanes, which the transitions
//! that follow the store (admit, follow, finished) and the partitions'
//! moves also take, first, when fair topics are configured. Locks taken
//! together go in one order: fair lanes, window, rounds
//! ([`SchedulerJobs::take_round`] counts its round under the window's;
//! [`SchedulerJobs::release_fair`] takes all three at its end). None reads
//! Kafka under a lock, nor the store but a fair release, whose reads are
//! bounded (a read per partition, and per lane refilled).
//!
//! A job's way through them:
//!
//! 1. ingest: [`SchedulerJobs::claim`] what a read batch names (held unfired, or
//!    marked as being fired);
//! 2. apply: [`SchedulerJobs::take_named`] the direct jobs the batch changes,
//!    [`SchedulerJobs::direct_candidates`], [`SchedulerJobs::frontier`], then, once the
//!    batch is persisted, [`SchedulerJobs::admit`] it (stored and direct jobs enter
//!    the window together) and [`SchedulerJobs::settle`] its offsets;
//! 3. dispatch: [`SchedulerJobs::take_round`] what is due in the window, then
//!    [`SchedulerJobs::release_fair`] what fair topics may release;
//! 4. finish: [`SchedulerJobs::release_direct`], [`SchedulerJobs::put_again`],
//!    [`SchedulerJobs::frontier_after_fires`], [`SchedulerJobs::finished`], then
//!    [`SchedulerJobs::rounds_done`];
//! 5. partitions: [`SchedulerJobs::assign`], [`SchedulerJobs::revoke`], [`SchedulerJobs::wait_idle`],
//!    [`SchedulerJobs::let_go`].
//!
//! The transitions that touch only the direct offsets are in [`offsets`].

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::debug;

use super::batch::{Claim, Claimed, PartitionBatch, ReadBatch};
use super::direct::DirectOffsets;

use crate::hash::{HashMap, HashSet};
use crate::job::JobId;
use crate::scheduler::fair::FairWindow;
use crate::scheduler::refill::WindowLock;
use crate::scheduler::store::{Applied, Change, DueKey};
use crate::scheduler::stored::StoredJob;
use crate::scheduler::timer_wheel::{Due, TimerWheel};
use crate::sync::{Lock, Wait};
use crate::wire::Command;

/// The scheduler's jobs in memory (see the module doc).
pub(super) struct SchedulerJobs {
    /// The near future in memory; also the owned partitions, and which
    /// jobs are being fired or changed.
    window: Mutex<TimerWheel>,
    /// Per schedule partition: how far it may be committed, with the direct
    /// jobs still in flight.
    direct: Mutex<HashMap<i32, DirectOffsets>>,
    /// Fire rounds taken and not yet finished, per partition.
    firing: Mutex<HashMap<i32, usize>>,
    /// The fair topics' lanes (`None`: no fair topics).
    fair: Option<Mutex<FairJobs>>,
    /// The fair topics (set at start).
    fair_topics: HashSet<String>,
    /// How far ahead of now the window reaches, in ms.
    span_ms: i64,
    /// Signalled when fire rounds are finished.
    round_finished: Condvar,
}

/// What [`SchedulerJobs::take_round`] took.
pub(super) struct Taken {
    /// Jobs due, in run-at order; those of fair topics from `fair_from`.
    pub(super) due: Vec<(DueKey, StoredJob)>,
    /// Which of `due` are direct jobs, with when each entered the window.
    pub(super) direct: HashMap<DueKey, i64>,
    /// The partitions of `due`, counted as firing until [`SchedulerJobs::rounds_done`].
    pub(super) parts: HashSet<i32>,
    /// Per partition, the latest run-at of due jobs held because the
    /// partition is not read up to it.
    pub(super) held: HashMap<i32, i64>,
    /// Where the jobs of fair topics start in `due`.
    pub(super) fair_from: usize,
    /// Fair topics have more due jobs than the round took.
    pub(super) fair_more: bool,
    /// When the next job in the window comes due.
    pub(super) next_ms: Option<i64>,
    /// When the window next wants a refill.
    pub(super) refill_ms: Option<i64>,
}

impl SchedulerJobs {
    /// Nothing in flight, over `window`, and over `fair`'s lanes for the
    /// fair topics (their jobs are kept out of the window).
    pub(super) fn new(mut window: TimerWheel, fair: Option<FairWindow>) -> SchedulerJobs {
        let fair_topics: HashSet<String> = fair.iter().flat_map(|f| f.topics().map(str::to_string)).collect();
        window.keep_out(&fair_topics.iter().cloned().collect::<Vec<_>>());
        SchedulerJobs {
            span_ms: window.span_ms(),
            window: Mutex::new(window),
            direct: Mutex::new(HashMap::default()),
            firing: Mutex::new(HashMap::default()),
            fair: fair.map(|f| Mutex::new(FairJobs::new(f))),
            fair_topics,
            round_finished: Condvar::new(),
        }
    }

    /// Whether some topics are dispatched fairly.
    pub(super) fn has_fair(&self) -> bool {
        self.fair.is_some()
    }

    /// Whether `topic` is dispatched fairly.
    fn is_fair(&self, topic: &str) -> bool {
        !self.fair_topics.is_empty() && self.fair_topics.contains(topic)
    }

    fn fair_lanes(&self) -> Option<MutexGuard<'_, FairJobs>> {
        self.fair.as_ref().map(Lock::locked)
    }

    fn window(&self) -> MutexGuard<'_, TimerWheel> {
        self.window.locked()
    }

    fn direct(&self) -> MutexGuard<'_, HashMap<i32, DirectOffsets>> {
        self.direct.locked()
    }

    fn firing(&self) -> MutexGuard<'_, HashMap<i32, usize>> {
        self.firing.locked()
    }

    // --- ingest and apply ---

    /// Claim in the window the jobs each read batch names: one being fired
    /// is marked so (a cancel or reschedule of it comes too late); any
    /// other is held unfired until the batch is applied ([`SchedulerJobs::admit`]).
    pub(super) fn claim(&self, batches: &mut [ReadBatch]) {
        let w = &mut *self.window();
        for b in batches {
            for r in &b.records {
                let id = super::batch::id_of(&r.command);
                if matches!(r.command, Command::Schedule(_)) {
                    w.put_again(r.partition, id, r.offset as u64);
                }
                if let std::collections::hash_map::Entry::Vacant(v) = b.named.entry((r.partition, id)) {
                    let firing = w.is_firing(r.partition, &id);
                    if !firing {
                        w.changing(r.partition, id);
                    }
                    v.insert(Claimed {
                        firing,
                        marks: u32::from(!firing),
                    });
                }
            }
        }
    }

    /// How each job a batch names stands as the batch is applied: being
    /// fired, a direct job (taken out of the window: the batch replaces or
    /// cancels it), or held.
    pub(super) fn take_named(&self, named: &HashMap<(i32, JobId), Claimed>) -> Vec<((i32, JobId), Claim)> {
        let w = &mut *self.window();
        named
            .iter()
            .map(|(&(p, id), c)| {
                let claim = if c.firing {
                    Claim::Firing
                } else if let Some((_, s)) = w.take_direct_job(p, &id) {
                    Claim::Direct(Box::new(s))
                } else {
                    Claim::Held
                };
                ((p, id), claim)
            })
            .collect()
    }

    /// The puts of `pb` (of partition `p`) that may fire straight from
    /// memory, as far as the window can tell (index in `changes`, job id),
    /// with their places in the window reserved: due on arrival, named once
    /// by the batch and held, not of a fair topic, and where the window
    /// mirrors the partition up to them. Each enters at
    /// [`SchedulerJobs::admit`], or its place is let go
    /// ([`SchedulerJobs::unreserve`]).
    pub(super) fn direct_candidates(&self, p: i32, pb: &PartitionBatch) -> Vec<(usize, JobId)> {
        let w = &mut *self.window();
        pb.due_puts
            .iter()
            .filter_map(|&i| match &pb.changes[i] {
                Change::Put(s)
                    if pb
                        .ids
                        .get(&s.job.stored_id())
                        .is_some_and(|n| n.mentions == 1 && matches!(n.claim, Claim::Held))
                        && !self.is_fair(&s.job.topic)
                        && w.reserve_direct(DueKey::of(p, s)) =>
                {
                    Some((i, s.job.stored_id()))
                }
                _ => None,
            })
            .collect()
    }

    /// Let go of the places [`SchedulerJobs::direct_candidates`] reserved
    /// for the puts at `changes` of `pb` (of partition `p`) that do not
    /// fire from memory after all.
    pub(super) fn unreserve(&self, p: i32, pb: &PartitionBatch, changes: impl IntoIterator<Item = usize>) {
        let w = &mut *self.window();
        for i in changes {
            if let Change::Put(s) = &pb.changes[i] {
                w.unreserve(&DueKey::of(p, s));
            }
        }
    }

    /// A persisted batch enters: the store's `applied` changes are followed,
    /// the batch's direct jobs hold their offsets and enter the window
    /// beside them (one run-at order for the dispatcher) in the places
    /// reserved for them, and the jobs the batch held may be fired again.
    /// Direct jobs of a partition let go or taken again since they were
    /// picked come back, per partition, to be persisted.
    pub(super) fn admit(
        &self,
        applied: &[Applied],
        parts: &mut HashMap<i32, PartitionBatch>,
        now_ms: i64,
        named: &HashMap<(i32, JobId), Claimed>,
    ) -> HashMap<i32, PartitionBatch> {
        // The fair lanes follow the store before the window lets the jobs
        // the batch changed go (a lane must not release a job cancelled).
        if let Some(mut f) = self.fair_lanes() {
            f.follow(applied);
        }
        // The direct jobs hold their offsets before the dispatcher can see
        // them (the direct lock, then the window's, never both at once).
        {
            let mut direct = self.direct();
            for (p, pb) in parts.iter() {
                let d = direct.entry(*p).or_default();
                for s in &pb.direct {
                    d.hold(s.seq as i64);
                }
            }
        }
        let window = &mut *self.window();
        let mut fallback: HashMap<i32, PartitionBatch> = HashMap::default();
        window.follow(applied);
        for (p, pb) in parts.iter_mut() {
            for s in pb.direct.drain(..) {
                let k = DueKey::of(*p, &s);
                let (id, offset) = (s.job.id, s.seq);
                match window.add_direct(k, s, now_ms) {
                    None => debug!(job_id = %id, partition = p, offset, "due on arrival: firing from memory"),
                    Some(s) => fallback.entry(*p).or_default().changes.push(Change::Put(s)),
                }
            }
        }
        window.changed(
            named
                .iter()
                .flat_map(|(k, c)| std::iter::repeat_n(*k, c.marks as usize)),
        );
        fallback
    }

    /// Stored changes the window follows (jobs persisted outside a batch's
    /// [`SchedulerJobs::admit`]).
    pub(super) fn follow(&self, applied: &[Applied]) {
        if let Some(mut f) = self.fair_lanes() {
            f.follow(applied);
        }
        self.window().follow(applied);
    }

    /// The direct jobs of the partitions `lane` picks that entered the
    /// window before `before_ms`, copied; their partitions fire nothing
    /// until [`SchedulerJobs::handed_over`].
    pub(super) fn take_old_direct(
        &self,
        before_ms: i64,
        lane: impl Fn(i32) -> bool,
    ) -> Vec<(DueKey, StoredJob)> {
        self.window().persist_direct_older(before_ms, lane)
    }

    /// The jobs of [`SchedulerJobs::take_old_direct`] were written to the store
    /// (`applied`; `None`: the write failed): their partitions fire again,
    /// and once stored they are stored jobs and stop holding offsets.
    pub(super) fn handed_over(&self, jobs: &[(DueKey, StoredJob)], applied: Option<&[Applied]>) {
        {
            let mut w = self.window();
            w.persisted(jobs);
            if let Some(applied) = applied {
                w.follow(applied);
            }
        }
        if applied.is_some() {
            let mut direct = self.direct();
            for (k, _) in jobs {
                if let Some(d) = direct.get_mut(&k.partition) {
                    d.release(k.seq as i64);
                }
            }
        }
    }

    // --- dispatch and finish ---

    /// Take what is due in the window at `now_ms` (at most `max`), holding
    /// back a partition's jobs due after `until` (how far it has been read).
    /// The round's partitions count as firing until
    /// [`SchedulerJobs::rounds_done`]; [`SchedulerJobs::release_fair`] may
    /// add fair jobs to it.
    pub(super) fn take_round(&self, now_ms: i64, max: usize, until: &HashMap<i32, i64>) -> Taken {
        let mut w = self.window();
        let w = &mut *w;
        let Due { jobs: due, held } = w.take_due(now_ms, max, until);
        let direct = w.take_direct(&due);
        let fair_from = due.len();
        let (next_ms, refill_ms) = (w.next_after_ms(now_ms), w.refill_due_ms());
        let parts: HashSet<i32> = due.iter().map(|(k, _)| k.partition).collect();
        // Under the window's lock: a revocation that takes a partition out
        // of the window next then waits for this round.
        let mut firing = self.firing();
        for p in &parts {
            *firing.entry(*p).or_insert(0) += 1;
        }
        Taken {
            due,
            direct,
            parts,
            held,
            fair_from,
            fair_more: false,
            next_ms,
            refill_ms,
        }
    }

    /// Which of `done` were put again under their id since they were taken
    /// (the changelog keeps the new put: no tombstone for them).
    pub(super) fn put_again(&self, done: &[&(DueKey, StoredJob)]) -> HashSet<(i32, JobId)> {
        let w = &*self.window();
        done.iter()
            .filter(|(k, s)| w.was_put_again(k.partition, &s.job.stored_id(), k.seq))
            .map(|(k, s)| (k.partition, s.job.stored_id()))
            .collect()
    }

    /// A finisher round is written: the window follows the store's
    /// `applied` deletes, `due`'s fires are over, and `retry` (their write
    /// failed) goes back into the window, direct ones as direct.
    pub(super) fn finished(
        &self,
        applied: &[Applied],
        due: &[(DueKey, StoredJob)],
        mut retry: Vec<(DueKey, StoredJob)>,
        direct: &HashMap<DueKey, i64>,
    ) {
        if let Some(mut f) = self.fair_lanes() {
            f.follow(applied);
            f.finished(due, &mut retry);
        }
        // Deleted from the store and the window together: a change read
        // from now on finds the job gone, not being fired.
        let w = &mut *self.window();
        w.follow(applied);
        w.fired(due);
        w.put_back(retry, direct);
    }

    /// The rounds taken with these partition sets are finished (or given up).
    pub(super) fn rounds_done<'a>(&self, parts: impl IntoIterator<Item = &'a HashSet<i32>>) {
        {
            let firing = &mut *self.firing();
            for p in parts.into_iter().flatten() {
                if let Some(n) = firing.get_mut(p) {
                    *n -= 1;
                    if *n == 0 {
                        firing.remove(p);
                    }
                }
            }
        }
        self.round_finished.notify_all();
    }

    // --- partitions ---

    /// Own `partition` (after it caught up with its changelog): its jobs
    /// load on the next refill.
    pub(super) fn assign(&self, partition: i32) {
        if let Some(mut f) = self.fair_lanes() {
            f.lanes.add_partition(partition);
        }
        self.window().add_partition(partition);
    }

    /// Stop firing from `parts`: they leave the window (their jobs in
    /// memory are dropped).
    pub(super) fn revoke(&self, parts: &[i32]) {
        if let Some(mut f) = self.fair_lanes() {
            for p in parts {
                f.lanes.remove_partition(*p);
            }
        }
        let w = &mut *self.window();
        for p in parts {
            w.remove_partition(*p);
        }
    }

    /// Wait until no round taken from `parts` is in flight; false if some
    /// still are at `deadline`.
    pub(super) fn wait_idle(&self, parts: &[i32], deadline: Instant) -> bool {
        let mut firing = self.firing();
        loop {
            if !parts.iter().any(|p| firing.contains_key(p)) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            firing = self
                .round_finished
                .waiting_at_most(firing, left.min(Duration::from_millis(100)));
        }
    }

    // --- upkeep and reports ---

    /// The partitions owned, in order.
    pub(super) fn partitions(&self) -> Vec<i32> {
        self.window().partitions()
    }

    /// The partitions owned and the jobs in memory.
    pub(super) fn owned_and_in_memory(&self) -> (Vec<i32>, usize) {
        let w = &*self.window();
        (w.partitions(), w.len())
    }
}

impl WindowLock for SchedulerJobs {
    fn with_window<R>(&self, f: impl FnOnce(&mut TimerWheel) -> R) -> R {
        f(&mut self.window())
    }
}

mod fair;
mod offsets;

use fair::FairJobs;

#[cfg(test)]
mod tests;
