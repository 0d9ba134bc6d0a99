//! Held keys: a key none of whose later jobs may start yet.
//!
//! A key is held when one of its jobs failed and will be retried on a
//! `hold_key` topic, or had to wait for its pacing turn longer than the
//! worker keeps jobs in memory. That job is the key's *blocker*; its next
//! run goes through the scheduler as usual. The key's later jobs are
//! *parked*: written to the scheduler, in order, due no earlier than the
//! blocker, marked with a park sequence (`kairos-parked`), so that their
//! offsets are committed and the partition's other keys move on. When the
//! blocker's next run comes back it starts first; parked jobs that come back
//! behind it queue behind it; once it has succeeded or been dead-lettered
//! they run, in order; once the last one parked has run, the key is let go.
//! A later job that arrives while parked jobs are still out is parked
//! behind them.
//!
//! The state of every held key is written to the held topic (compacted,
//! keyed by topic and key, partition = work partition) before the offset
//! that caused the change is committed, and read back when a partition is
//! assigned, before any of its jobs starts: a hold survives kill -9 and
//! rebalances. Memory: one [`Hold`] per key held now (about 150 bytes plus
//! the key), at most `[worker] max_held_keys`.
//!
//! This module is the decision only, pure and in memory; the worker service
//! carries it out.

pub mod record;

use std::collections::hash_map::Entry;

use serde::{Deserialize, Serialize};

use crate::hash::HashMap;
use crate::job::{Job, JobId};

/// A parked job that comes back before the job holding its key (its run was
/// moved later, or it never came back) is parked again this much later.
pub(crate) const REPARK_AFTER_MS: i64 = 1_000;

/// Why a key is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Its job failed and will be retried (`on_failure = "hold_key"`).
    Failed,
    /// Its job waits for its pacing turn, or was rate limited.
    Paced,
}

/// The job holding a key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Blocker {
    /// Its id.
    pub id: JobId,
    /// The attempt its next run is.
    pub attempt: u32,
    /// When its next run is due, ms since the epoch.
    pub due_ms: i64,
    /// Why it holds the key.
    pub cause: Cause,
    /// Its next run has been read (it is buffered or running here): jobs
    /// parked behind it queue behind it instead of being parked again. Not
    /// kept in the held topic: after a restart it is read again.
    #[serde(skip)]
    pub arrived: bool,
}

/// One held key (the held topic's record value).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    /// The job holding the key; `None` once it succeeded, was
    /// dead-lettered or released, while parked jobs are still out.
    pub blocker: Option<Blocker>,
    /// Park sequence of the last job parked (0: none yet).
    pub tail: u32,
    /// Latest run-at given to a parked job, ms: later ones go no earlier.
    pub tail_at_ms: i64,
    /// When the key was held, ms since the epoch.
    pub since_ms: i64,
    /// A blocker an operator released: its next run is dead-lettered when
    /// it comes back (it no longer holds the key meanwhile).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released: Option<JobId>,
}

impl Hold {
    /// Whether the key's jobs must wait: a blocker not yet done, or parked
    /// jobs still out.
    pub fn holds(&self) -> bool {
        self.blocker.is_some() || self.tail > 0
    }

    fn done(&self) -> bool {
        self.blocker.is_none() && self.tail == 0 && self.released.is_none()
    }
}

/// What to do with a job read from a partition whose keys can be held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Run it (buffer it in the lock table).
    Run,
    /// Park it: write it to the scheduler due at `at_ms`, marked `seq`.
    Park {
        /// Its park sequence.
        seq: u32,
        /// Its run-at, ms.
        at_ms: i64,
    },
    /// Dead-letter it: an operator released the key it held.
    Released,
}

/// How a job of a holdable key settled, as far as its key is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// It succeeded or was dead-lettered.
    Finished,
    /// Its next run goes through the scheduler, due at `due_ms`; the key
    /// waits for it.
    Again {
        /// The attempt of its next run.
        attempt: u32,
        /// When that run is due, ms.
        due_ms: i64,
        /// Why.
        cause: Cause,
    },
}

/// A change to write to the held topic before the offsets behind it are
/// committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// The key's hold as it is now.
    Put(Hold),
    /// The key is let go (a tombstone).
    Let,
}

/// What [`Holds::settled`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HoldUpdate {
    /// Nothing to write.
    Unchanged,
    /// Write this.
    Write(Change),
    /// The key should be held, but `max_held_keys` are: it is not.
    Overflow,
}

/// The held keys of the partitions a worker owns (see the module doc).
#[derive(Debug)]
pub struct Holds<P> {
    keys: HashMap<(P, Box<[u8]>), Hold>,
    max: usize,
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
            max: max.max(1),
        }
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is held.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// When the longest-held key was held, ms.
    pub fn oldest_ms(&self) -> Option<i64> {
        self.keys.values().map(|h| h.since_ms).min()
    }

    /// The hold of `key` in `partition`, if any.
    pub fn get(&self, partition: P, key: &[u8]) -> Option<&Hold> {
        self.keys.get(&(partition, Box::from(key)))
    }

    /// A hold read back from the held topic (`None`: a tombstone).
    pub fn load(&mut self, partition: P, key: &[u8], hold: Option<Hold>) {
        match hold {
            Some(h) => {
                self.keys.insert((partition, Box::from(key)), h);
            }
            None => {
                self.keys.remove(&(partition, Box::from(key)));
            }
        }
    }

    /// Forget the holds of a partition let go (its next owner reads them).
    pub fn drop_partition(&mut self, partition: P) {
        self.keys.retain(|(p, _), _| *p != partition);
    }

    /// What to do with `job`, just read from `partition`, at `now_ms`.
    pub fn admit(&mut self, partition: P, job: &Job, now_ms: i64) -> Admit {
        let Some(h) = self.keys.get_mut(&(partition, Box::from(job.key.as_slice()))) else {
            return Admit::Run;
        };
        if h.released == Some(job.id) {
            return Admit::Released;
        }
        let waiting = match &mut h.blocker {
            Some(b) if b.id == job.id => {
                b.arrived = true;
                return Admit::Run;
            }
            Some(b) => !b.arrived,
            None => false,
        };
        match (job.parked.is_some(), waiting) {
            // Parked behind a blocker that is back (or done): queue in order.
            (true, false) => Admit::Run,
            // Back before its blocker: out again, a little later.
            (true, true) => park(h, job, now_ms + REPARK_AFTER_MS),
            (false, _) if h.holds() => park(h, job, i64::MIN),
            (false, _) => Admit::Run,
        }
    }

    /// Whether `key`'s buffered jobs must leave the lock table: its blocker
    /// is out, waiting for its next run.
    pub fn parks_buffered(&self, partition: P, key: &[u8]) -> bool {
        self.get(partition, key)
            .and_then(|h| h.blocker.as_ref())
            .is_some_and(|b| !b.arrived)
    }

    /// Park `job`, buffered behind a key that became held: its sequence and
    /// run-at (`None` when the key is not held).
    pub fn park_buffered(&mut self, partition: P, job: &Job) -> Option<Admit> {
        let h = self.keys.get_mut(&(partition, Box::from(job.key.as_slice())))?;
        Some(park(h, job, i64::MIN))
    }

    /// `job`'s run is over and its outcome written: what changes for its key.
    pub fn settled(&mut self, partition: P, job: &Job, how: Settlement, now_ms: i64) -> HoldUpdate {
        let len = self.keys.len();
        let entry = self.keys.entry((partition, Box::from(job.key.as_slice())));
        match how {
            Settlement::Again {
                attempt,
                due_ms,
                cause,
            } => {
                let h = match entry {
                    Entry::Occupied(o) => o.into_mut(),
                    Entry::Vacant(_) if len >= self.max => return HoldUpdate::Overflow,
                    Entry::Vacant(v) => v.insert(Hold {
                        blocker: None,
                        tail: 0,
                        tail_at_ms: i64::MIN,
                        since_ms: now_ms,
                        released: None,
                    }),
                };
                if h.released == Some(job.id) {
                    // Released while it ran: its next run is dead-lettered.
                    return HoldUpdate::Unchanged;
                }
                h.blocker = Some(Blocker {
                    id: job.id,
                    attempt,
                    due_ms,
                    cause,
                    arrived: false,
                });
                HoldUpdate::Write(Change::Put(h.clone()))
            }
            Settlement::Finished => {
                let Entry::Occupied(mut o) = entry else {
                    return HoldUpdate::Unchanged;
                };
                let h = o.get_mut();
                let mut changed = false;
                if h.released == Some(job.id) {
                    h.released = None;
                    changed = true;
                }
                if h.blocker.as_ref().is_some_and(|b| b.id == job.id) {
                    h.blocker = None;
                    changed = true;
                }
                if h.blocker.is_none() && h.tail > 0 && job.parked.is_some_and(|s| s >= h.tail) {
                    // The last job parked has run.
                    h.tail = 0;
                    changed = true;
                }
                if h.done() {
                    o.remove();
                    HoldUpdate::Write(Change::Let)
                } else if changed {
                    HoldUpdate::Write(Change::Put(h.clone()))
                } else {
                    HoldUpdate::Unchanged
                }
            }
        }
    }

    /// An operator released `key`, held by job `id`: the key's jobs no
    /// longer wait for it, and its next run is dead-lettered when it comes
    /// back. `None` when `id` does not hold `key` here.
    pub fn release(&mut self, partition: P, key: &[u8], id: JobId) -> Option<Change> {
        let h = self.keys.get_mut(&(partition, Box::from(key)))?;
        if h.blocker.as_ref().is_none_or(|b| b.id != id) {
            return None;
        }
        h.blocker = None;
        h.released = Some(id);
        Some(Change::Put(h.clone()))
    }
}

/// Give `job` the next park sequence of `h`, due no earlier than the job's
/// own run-at, `not_before`, the blocker's next run and the last park.
fn park(h: &mut Hold, job: &Job, not_before: i64) -> Admit {
    let due = h.blocker.as_ref().map_or(i64::MIN, |b| b.due_ms);
    let at_ms = job
        .run_at
        .timestamp_millis()
        .max(not_before)
        .max(due)
        .max(h.tail_at_ms);
    h.tail = h.tail.saturating_add(1);
    h.tail_at_ms = at_ms;
    Admit::Park { seq: h.tail, at_ms }
}

#[cfg(test)]
mod tests;
