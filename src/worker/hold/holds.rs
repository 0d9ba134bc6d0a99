//! The table of held keys and its decisions: which job runs, waits or is
//! parked, and what each settlement changes (the types are the parent's).

use super::{
    first_number, Admit, Blocker, Hold, HoldUpdate, HoldWrite, Settlement, BACK_OFF_MAX_MS, BACK_TOO_SOON_MS,
    GIVE_UP_MS, MAX_WAIT_MS, NEVER, NO_OFFSET, WAIT_MS,
};
use crate::hash::HashMap;
use crate::job::{Job, JobId};

/// The held keys of the partitions a worker owns (see the module doc).
#[derive(Debug)]
pub struct Holds<P> {
    /// Per partition, per key (looked up by borrowed key, no allocation).
    /// Each hold is boxed: a table slot is then a key and a pointer, and
    /// the slots a table keeps free as it grows cost 24 bytes each, not
    /// the hold's size.
    keys: HashMap<P, HashMap<Box<[u8]>, Box<Hold>>>,
    /// Keys held, over all partitions.
    len: usize,
    /// The same, readable without the lock this table is kept under.
    shared_len: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    max: usize,
    /// How long a key waits for a missing piece before it goes on without
    /// it, ms ([`GIVE_UP_MS`] unless set).
    give_up_ms: i64,
}

impl<P: Copy + Eq + std::hash::Hash> Default for Holds<P> {
    fn default() -> Self {
        Holds::new(usize::MAX)
    }
}

impl<P: Copy + Eq + std::hash::Hash> Holds<P> {
    /// No key held; at most `max` at once.
    pub fn new(max: usize) -> Self {
        Holds {
            keys: HashMap::default(),
            len: 0,
            shared_len: Default::default(),
            max: max.max(1),
            give_up_ms: GIVE_UP_MS,
        }
    }

    /// Keys give up waiting for a missing piece after `ms` (see
    /// [`GIVE_UP_MS`], the default).
    pub fn give_up_after(mut self, ms: i64) -> Self {
        self.give_up_ms = ms.max(1);
        self
    }

    /// How long a key waits for a missing piece before it goes on, ms.
    pub fn give_up_ms(&self) -> i64 {
        self.give_up_ms
    }

    /// The number of keys held, kept up to date, readable without the lock
    /// this table is kept under.
    pub fn counter(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        self.shared_len.clone()
    }

    fn set_len(&mut self, len: usize) {
        self.len = len;
        self.shared_len.store(len, std::sync::atomic::Ordering::Relaxed);
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is held.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// When the longest-held key was held, ms.
    pub fn oldest_ms(&self) -> Option<i64> {
        self.keys
            .values()
            .flat_map(|m| m.values())
            .map(|h| h.since_ms)
            .min()
    }

    /// The hold of `key` in `partition`, mutable.
    pub fn get_mut(&mut self, partition: P, key: &[u8]) -> Option<&mut Hold> {
        self.keys.get_mut(&partition)?.get_mut(key).map(|h| &mut **h)
    }

    /// The hold of `key` in `partition`, if any.
    pub fn get(&self, partition: P, key: &[u8]) -> Option<&Hold> {
        self.keys.get(&partition)?.get(key).map(|h| &**h)
    }

    fn insert(&mut self, partition: P, key: &[u8], h: Hold) -> &mut Hold {
        if self.get(partition, key).is_none() {
            self.set_len(self.len + 1);
        }
        let part = self.keys.entry(partition).or_default();
        part.entry(Box::from(key)).or_insert_with(|| Box::new(h))
    }

    fn remove(&mut self, partition: P, key: &[u8]) {
        if let Some(part) = self.keys.get_mut(&partition) {
            let removed = part.remove(key).is_some();
            if part.is_empty() {
                self.keys.remove(&partition);
            }
            if removed {
                self.set_len(self.len - 1);
            }
        }
    }

    /// A hold read back from the held topic (`None`: a tombstone).
    pub fn load(&mut self, partition: P, key: &[u8], hold: Option<Hold>) {
        self.remove(partition, key);
        if let Some(h) = hold {
            self.insert(partition, key, h.loaded());
        }
    }

    /// Forget the holds of a partition let go (its next owner reads them).
    pub fn drop_partition(&mut self, partition: P) {
        if let Some(part) = self.keys.remove(&partition) {
            self.set_len(self.len - part.len());
        }
    }

    /// Whether `job`, read from `partition` at `offset`, was dealt with
    /// already by its key's hold and is only read again (the partition's
    /// offsets were not committed when its previous owner stopped): a job
    /// at or below the last parked one handed to Kafka, neither a parked
    /// job back from the scheduler nor the blocker's next run. Such a job
    /// was parked (it comes back with its number), ran before the key was
    /// held, or is an earlier run of the blocker (its failure is what holds
    /// the key). Parking it again would give it a second number: it would
    /// run twice, and, were the first park lost, the key would wait for a
    /// number that never comes back.
    pub fn read_again(&self, partition: P, job: &Job, offset: i64) -> bool {
        // A job that may start early is read as it comes: it may have
        // started, or gone to the scheduler, rather than been parked.
        if self.len == 0 || job.early.is_some() {
            return false;
        }
        let Some(h) = self.get(partition, &job.key) else {
            return false;
        };
        if h.park_of(job).is_some() {
            return false;
        }
        // A released blocker's next run must reach the dead-letter topic,
        // and its earlier runs cannot be told from it by the hold: while a
        // release is pending the key's jobs are read as they come.
        if offset > h.parked_to || h.released().is_some() {
            return false;
        }
        match &h.blocker {
            Some(b) if b.id == job.id => job.attempt < b.attempt,
            _ => true,
        }
    }

    /// What to do with `job`, just read from `partition`, at `now_ms`.
    pub fn admit(&mut self, partition: P, job: &Job, now_ms: i64) -> Admit {
        if self.len == 0 {
            return Admit::Run;
        }
        let give_up_ms = self.give_up_ms;
        let Some(h) = self.get_mut(partition, &job.key) else {
            return Admit::Run;
        };
        if h.released() == Some(&job.id) {
            return Admit::Released;
        }
        let own = h.park_of(job);
        if h.stale_run(job, own) {
            return Admit::Stale;
        }
        if h.blocker.as_ref().is_some_and(|b| b.id == job.id) {
            return blockers_next_run(h, own, now_ms + BACK_TOO_SOON_MS);
        }
        let blocker_out = match &h.blocker {
            Some(b) => (!b.arrived).then_some(b.due_ms),
            None => None,
        };
        let Some(seq) = own else {
            return if !h.holds() {
                Admit::Run
            } else if h.waiting > 0 || (blocker_out.is_none() && h.tail_at_ms <= now_ms + WAIT_MS) {
                h.waiting += 1;
                if h.wait_since_ms == NEVER {
                    h.wait_since_ms = now_ms;
                }
                Admit::Wait
            } else {
                park_fresh(h, job)
            };
        };
        if seq <= h.admitted_seq {
            // Let in (or run) already: a duplicate.
            return Admit::Run;
        }
        match blocker_out {
            Some(due) if due >= now_ms - give_up_ms => {
                return out_again(h, seq, due.max(again_at(now_ms, due)));
            }
            Some(_) => {
                // Its next run seems lost: the key goes on without it.
                if let Some(b) = h.blocker.take() {
                    h.gave_up += 1;
                    if let Some(s) = b.seq().filter(|s| *s > h.done_seq) {
                        h.done_seq = s;
                        h.admitted_seq = h.admitted_seq.max(s);
                    }
                }
            }
            None => {}
        }
        if seq == h.next_number(h.admitted_seq) {
            h.admitted_seq = seq;
            h.gap_since_ms = NEVER;
            return Admit::Run;
        }
        // A job parked before it is still out.
        if h.gap_since_ms == NEVER {
            h.gap_since_ms = now_ms;
        }
        let since = h.gap_since_ms;
        if now_ms - since >= give_up_ms {
            h.gave_up += 1;
            h.gap_since_ms = NEVER;
            h.admitted_seq = seq;
            return Admit::Run;
        }
        out_again(h, seq, again_at(now_ms, since))
    }

    /// Whether `key`'s buffered jobs must leave the lock table: its blocker
    /// is out, waiting for its next run.
    pub fn parks_buffered(&self, partition: P, key: &[u8]) -> bool {
        self.get(partition, key)
            .and_then(|h| h.blocker.as_ref())
            .is_some_and(|b| !b.arrived)
    }

    /// Park `job`, buffered behind its key's blocker when that failed (in
    /// the lock table's order), keeping its park sequence if it has one:
    /// its sequence and run-at (`None` when the key is not held). The
    /// blocker's own next run, already read (a retry due at once goes
    /// straight to the work topic), stays: `Run`.
    pub fn park_buffered(&mut self, partition: P, job: &Job) -> Option<Admit> {
        let h = self.get_mut(partition, &job.key)?;
        let due = h.blocker.as_ref().map_or(h.tail_at_ms, |b| b.due_ms);
        let own = h.park_of(job);
        if h.stale_run(job, own) {
            return Some(Admit::Stale);
        }
        if h.blocker.as_ref().is_some_and(|b| b.id == job.id) {
            return Some(blockers_next_run(h, own, due));
        }
        Some(match own {
            Some(seq) => out_again(h, seq, due),
            None => {
                let at = job.run_at.timestamp_millis().max(due);
                park_new(h, at)
            }
        })
    }

    /// Park the jobs that waited in memory for `key`'s parked jobs (its
    /// blocker failed again, too many wait, or they waited too long), in
    /// their order, with new sequences.
    pub fn park_waiting(&mut self, partition: P, jobs: &[&Job]) -> Vec<Admit> {
        let Some(h) = self.get_mut(partition, jobs.first().map_or(&[][..], |j| &j.key[..])) else {
            return Vec::new();
        };
        h.waiting = 0;
        h.wait_since_ms = NEVER;
        jobs.iter().map(|j| park_fresh(h, j)).collect()
    }

    /// Keys whose jobs have waited in memory for [`MAX_WAIT_MS`] (the parked
    /// jobs they wait for are late): their waiting jobs are to be parked
    /// behind those ([`Holds::park_waiting`]), so that they no longer hold
    /// the partition's committed offset back. The key's order holds; a
    /// parked job that never comes back is given up on when the jobs after
    /// it come back (see [`Holds::give_up_after`]).
    pub fn overdue_waiting(&self, now_ms: i64) -> Vec<(P, Box<[u8]>)> {
        self.keys
            .iter()
            .flat_map(|(p, m)| m.iter().map(move |(k, h)| (p, k, h)))
            .filter(|(_, _, h)| h.wait_since_ms != NEVER && now_ms - h.wait_since_ms >= MAX_WAIT_MS)
            .map(|(p, k, _)| (*p, k.clone()))
            .collect()
    }

    /// `job`'s run is over and its outcome written: what changes for its key.
    pub fn settled(&mut self, partition: P, job: &Job, how: Settlement, now_ms: i64) -> HoldUpdate {
        match how {
            Settlement::Again {
                attempt,
                due_ms,
                cause,
            } => {
                if self.get(partition, &job.key).is_none() && self.len >= self.max {
                    return HoldUpdate::Overflow;
                }
                let first = first_number(now_ms);
                let fresh = Hold {
                    blocker: None,
                    last_seq: first,
                    done_seq: first,
                    admitted_seq: first,
                    waiting: 0,
                    sent_seq: first,
                    gap_since_ms: NEVER,
                    wait_since_ms: NEVER,
                    gave_up: 0,
                    tail_at_ms: i64::MIN,
                    since_ms: now_ms,
                    rare: None,
                    parked_to: NO_OFFSET,
                };
                let h = self.insert(partition, &job.key, fresh);
                if h.released() == Some(&job.id) {
                    // Released while it ran: its next run is dead-lettered.
                    return HoldUpdate::Unchanged;
                }
                if h.park_of(job).is_some_and(|s| s <= h.done_seq) {
                    // A second run of a parked job that ran to its end
                    // (delivered twice): its place was kept and is behind
                    // the key; its retry is a job like any other.
                    return HoldUpdate::Unchanged;
                }
                // A parked job failing keeps its place: the jobs after it
                // are let in again only behind its next run.
                let seq = h.park_of(job).or_else(|| {
                    h.blocker
                        .as_ref()
                        .filter(|b| b.id == job.id)
                        .and_then(Blocker::seq)
                });
                h.admitted_seq = seq.unwrap_or(h.done_seq).max(h.done_seq);
                h.blocker = Some(Blocker {
                    id: job.id,
                    attempt,
                    due_ms,
                    cause,
                    park: seq.and_then(std::num::NonZeroU64::new),
                    arrived: false,
                });
                HoldUpdate::Write(HoldWrite::Put(h.clone()))
            }
            Settlement::Finished => {
                if self.len == 0 {
                    return HoldUpdate::Unchanged;
                }
                let Some(h) = self.get_mut(partition, &job.key) else {
                    return HoldUpdate::Unchanged;
                };
                let mut changed = false;
                if h.released() == Some(&job.id) {
                    h.set_released(None);
                    changed = true;
                }
                let mut seq = h.park_of(job);
                if let Some(b) = h.blocker.take_if(|b| b.id == job.id) {
                    seq = seq.or(b.seq());
                    changed = true;
                }
                if let Some(s) = seq.filter(|s| *s > h.done_seq && *s <= h.admitted_seq) {
                    // Jobs run in their order: every one before it has run.
                    h.done_seq = s;
                    changed = true;
                }
                if h.done() {
                    self.remove(partition, &job.key);
                    HoldUpdate::Write(HoldWrite::Let)
                } else if changed {
                    HoldUpdate::Write(HoldWrite::Put(h.clone()))
                } else {
                    HoldUpdate::Unchanged
                }
            }
        }
    }

    /// An operator released `key`, held by job `id`: the key's jobs no
    /// longer wait for it, and its next run is dead-lettered when it comes
    /// back. `None` when `id` does not hold `key` here.
    pub fn release(&mut self, partition: P, key: &[u8], id: JobId) -> Option<HoldWrite> {
        let h = self.get_mut(partition, key)?;
        let b = h.blocker.take_if(|b| b.id == id)?;
        if let Some(s) = b.seq().filter(|s| *s > h.done_seq) {
            // Its place counts as done: the jobs after it run.
            h.done_seq = s;
            h.admitted_seq = h.admitted_seq.max(s);
        }
        h.set_released(Some(id));
        Some(HoldWrite::Put(h.clone()))
    }
}

/// Park a job read while its key is held, with the next sequence: behind
/// the blocker's next run (a millisecond after it) and the last job parked.
fn park_fresh(h: &mut Hold, job: &Job) -> Admit {
    let after_blocker = h
        .blocker
        .as_ref()
        .map_or(i64::MIN, |b| b.due_ms.saturating_add(1));
    let at = job.run_at.timestamp_millis().max(after_blocker).max(h.tail_at_ms);
    park_new(h, at)
}

/// The next park sequence, due at `at_ms`.
fn park_new(h: &mut Hold, at_ms: i64) -> Admit {
    h.last_seq = h.next_number(h.last_seq);
    h.tail_at_ms = h.tail_at_ms.max(at_ms);
    Admit::Park {
        seq: h.last_seq,
        at_ms,
    }
}

/// The next run of `h`'s blocker, read: it runs. A parked copy of it
/// (parked under a number of its own before its key was held by it again,
/// after a crash) counts its number like any parked job: taken in its
/// turn, or out again due at `again_ms` while jobs parked before it are out
/// (the blocker's own retry, always written before its hold, runs
/// meanwhile).
fn blockers_next_run(h: &mut Hold, parked: Option<u64>, again_ms: i64) -> Admit {
    match parked {
        Some(seq) if seq > h.next_number(h.admitted_seq) => return out_again(h, seq, again_ms),
        Some(seq) if seq == h.next_number(h.admitted_seq) => h.admitted_seq = seq,
        _ => {}
    }
    if let Some(b) = &mut h.blocker {
        b.arrived = true;
    }
    Admit::Run
}

/// When a parked job back before its turn goes out again, at `now_ms`, when
/// what it waits for was due (or missed) since `since_ms`: a second later,
/// or, the longer that is overdue, half as long again (at most
/// [`BACK_OFF_MAX_MS`]): a key waiting out an outage does not send its parked
/// jobs round every second.
fn again_at(now_ms: i64, since_ms: i64) -> i64 {
    let overdue = now_ms.saturating_sub(since_ms).max(0);
    now_ms.saturating_add((overdue / 2).clamp(BACK_TOO_SOON_MS, BACK_OFF_MAX_MS))
}

/// A parked job out again, keeping its sequence, due at `at_ms`.
fn out_again(h: &mut Hold, seq: u64, at_ms: i64) -> Admit {
    h.tail_at_ms = h.tail_at_ms.max(at_ms);
    Admit::Park { seq, at_ms }
}
