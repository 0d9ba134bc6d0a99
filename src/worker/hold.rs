//! Held keys: a key none of whose later jobs may start yet.
//!
//! A key is held when one of its jobs failed and will be retried on a
//! `hold_key` topic, or had to wait for its pacing turn longer than the
//! worker keeps jobs in memory. That job is the key's *blocker*; its next
//! run goes through the scheduler as usual. The key's later jobs are
//! *parked*: written to the scheduler (due no earlier than the blocker's
//! next run) and marked with a park sequence (`kairos-parked`) that numbers
//! them in the key's order, so that their offsets are committed and the
//! partition's other keys move on. A job read while the key is held is
//! parked with the next number.
//!
//! The sequence, not the scheduler, decides the order they run in: a parked
//! job that comes back runs only once every job parked before it has been
//! let into the lock table (`admitted`), and never before the blocker's next
//! run is back; one back too soon goes out again, keeping its number.
//! Jobs buffered behind the blocker when it fails go out again too, keeping
//! theirs. Once the blocker has succeeded (or was dead-lettered or released)
//! and every parked job has run (`done` reached the last number given), the
//! key is let go. A parked job back again after it ran (a duplicate) runs as
//! any duplicate does.
//!
//! The state of every held key is written to the held topic (compacted,
//! keyed by topic and key, partition = work partition) before the offset
//! that caused the change is committed, and read back when a partition is
//! assigned, before any of its jobs starts: a hold survives kill -9 and
//! rebalances. Memory: one boxed [`Hold`] per key held now (128 bytes),
//! the key, and a 24-byte table slot (up to twice as many slots as keys),
//! at most `[worker] max_held_keys`.
//!
//! This module is the decision only, pure and in memory; the worker service
//! carries it out.

pub mod claim;
pub mod progress;
pub mod record;

use serde::{Deserialize, Serialize};

use crate::job::{Job, JobId};

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
    /// Its park number, when it was a parked job (see [`Blocker::seq`];
    /// non-zero, so that the option costs no more than the number).
    #[serde(default, rename = "seq", skip_serializing_if = "Option::is_none")]
    pub park: Option<std::num::NonZeroU64>,
    /// Its next run has been read (it is buffered or running here): jobs
    /// parked behind it queue behind it instead of being parked again. Not
    /// kept in the held topic: after a restart it is read again.
    #[serde(skip)]
    pub arrived: bool,
}

impl Blocker {
    /// Its park number, when it was a parked job.
    pub fn seq(&self) -> Option<u64> {
        self.park.map(std::num::NonZeroU64::get)
    }
}

/// One held key (the held topic's record value: the fields said to be
/// kept; see [`record`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "record::Kept", into = "record::Kept")]
pub struct Hold {
    /// The job holding the key; `None` once it succeeded, was
    /// dead-lettered or released, while parked jobs are still out.
    pub blocker: Option<Blocker>,
    /// The last park sequence given.
    pub last_seq: u64,
    /// Every parked job up to this sequence has run.
    pub done_seq: u64,
    /// Parked jobs let into the lock table, in order, up to this sequence
    /// (at least `done_seq`; not kept: after a restart, `done_seq`).
    pub admitted_seq: u64,
    /// Jobs read while the last parked ones are coming back, waiting in
    /// memory to run after them (not kept: they are read again).
    pub waiting: u32,
    /// Times this key gave up waiting for a missing piece (see
    /// [`Holds::give_up_after`]; not kept).
    pub gave_up: u32,
    /// Since when jobs have been waiting in memory ([`NEVER`]: none; not
    /// kept).
    pub wait_since_ms: i64,
    /// Since when a parked job came back before a job parked ahead of it
    /// (which has not come back since), ms (not kept).
    pub gap_since_ms: i64,
    /// The last park sequence Kafka acknowledged: what the held topic may
    /// say was given (a park not written when the worker dies is read
    /// again and parked anew, so its number must not count; not kept).
    pub sent_seq: u64,
    /// The latest run-at given to a parked job, ms: later ones go no earlier.
    pub tail_at_ms: i64,
    /// When the key was held, ms since the epoch.
    pub since_ms: i64,
    /// What few holds have (a release, skipped numbers), boxed apart so
    /// that it costs the others one pointer: see [`Hold::released`] and
    /// [`Hold::skipped`].
    pub rare: Option<Box<Rare>>,
    /// The work-topic offset of the latest parked job Kafka acknowledged
    /// ([`NO_OFFSET`]: none). A job of the key read again at or below it
    /// (the partition's offsets were not committed when its owner stopped)
    /// was dealt with already: see [`Holds::read_again`].
    pub parked_to: i64,
}

/// The parts of a [`Hold`] few holds have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rare {
    /// A blocker an operator released: its next run is dead-lettered when
    /// it comes back (it no longer holds the key meanwhile).
    pub released: Option<JobId>,
    /// Park numbers the hold passes over and never gives: each time it was
    /// read back, those a previous owner of the partition may have given
    /// without writing them down (see [`Hold::loaded`]).
    pub skipped: Vec<Skip>,
    /// Read back, and no write has carried its latest [`Skip`] yet: the
    /// keeper writes the hold before the parks of any round that parks the
    /// key while this is set (not kept).
    pub skip_unwritten: bool,
}

/// Park numbers a hold passes over: `after` is followed by `upto + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skip {
    /// The last number before the skip.
    pub after: u64,
    /// The last number skipped.
    pub upto: u64,
}

impl Hold {
    /// Whether the key's jobs must wait: a blocker not yet done, or parked
    /// jobs still out.
    pub fn holds(&self) -> bool {
        self.blocker.is_some() || self.done_seq < self.last_seq
    }

    /// Whether park number `seq` is one this hold gave (not one of a hold
    /// of the same key before it, let go since: a copy parked under that
    /// one, read again after a crash, is a job like any other here; see
    /// [`first_number`]), nor one it passes over (a previous owner's park
    /// the held topic did not count: see [`Hold::loaded`]).
    pub fn gave(&self, seq: u64) -> bool {
        !self.passes_over(seq)
            && (range_of(seq) == range_of(self.last_seq) || (seq > self.done_seq && seq <= self.last_seq))
    }

    /// Whether `seq` is one of the numbers this hold passes over.
    fn passes_over(&self, seq: u64) -> bool {
        self.skip_of(seq).is_some()
    }

    /// The skip that passes over `seq`, if one does.
    fn skip_of(&self, seq: u64) -> Option<&Skip> {
        self.skipped().iter().find(|s| seq > s.after && seq <= s.upto)
    }

    /// The park number after `seq` in this hold's order.
    pub(crate) fn next_number(&self, seq: u64) -> u64 {
        // A hold of the narrow form stays in it: its last number is
        // `u32::MAX`, given again once reached, as before.
        let end = if seq <= LEGACY_END { LEGACY_END } else { u64::MAX };
        let mut n = seq.saturating_add(1).min(end);
        while let Some(s) = self.skip_of(n) {
            n = s.upto.saturating_add(1).min(end);
        }
        n
    }

    /// The blocker an operator released, if any: its next run is
    /// dead-lettered when it comes back.
    pub fn released(&self) -> Option<&JobId> {
        self.rare.as_ref()?.released.as_ref()
    }

    pub(crate) fn set_released(&mut self, id: Option<JobId>) {
        self.rare_mut().released = id;
        if self.rare.as_deref() == Some(&Rare::default()) {
            self.rare = None;
        }
    }

    /// The park numbers this hold passes over (see [`Hold::loaded`]).
    pub fn skipped(&self) -> &[Skip] {
        self.rare.as_ref().map_or(&[], |r| &r.skipped)
    }

    /// Read back, and its latest skip not written yet.
    pub fn skip_unwritten(&self) -> bool {
        self.rare.as_ref().is_some_and(|r| r.skip_unwritten)
    }

    /// Its latest skip is written.
    pub(crate) fn skip_written(&mut self) {
        if let Some(r) = &mut self.rare {
            r.skip_unwritten = false;
        }
    }

    fn rare_mut(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    /// `job`'s park number, when this hold gave it (see [`Hold::gave`]).
    pub fn park_of(&self, job: &Job) -> Option<u64> {
        job.parked.filter(|s| self.gave(*s))
    }

    /// Whether `job` (park number `own` of this hold, if any) is an earlier
    /// run of the job holding the key, already dealt with: see
    /// [`Admit::Stale`].
    fn stale_run(&self, job: &Job, own: Option<u64>) -> bool {
        self.blocker
            .as_ref()
            .is_some_and(|b| b.id == job.id && job.attempt < b.attempt)
            && own.is_none_or(|s| s <= self.admitted_seq)
    }

    /// Parked jobs not yet run.
    pub fn parked(&self) -> u64 {
        let (done, last) = (self.done_seq.min(self.last_seq), self.last_seq);
        let passed_over: u64 = self
            .skipped()
            .iter()
            .map(|s| s.upto.min(last).saturating_sub(s.after.max(done)))
            .sum();
        last - done - passed_over.min(last - done)
    }

    fn done(&self) -> bool {
        !self.holds() && self.released().is_none()
    }

    /// After a restart: nothing admitted beyond what is done, but for a
    /// blocker that was a parked job: it was let in under its number (every
    /// job parked before it had run), and its next runs, retries without a
    /// number, hold that place.
    ///
    /// The numbers after the last one written are passed over
    /// ([`LOAD_SKIP`] of them): the previous owner may have given some whose
    /// parks Kafka has but whose hold it did not write before it stopped.
    /// This owner reads those jobs again and parks them anew, but not
    /// necessarily in the same order or with the same jobs between them (a
    /// copy it takes for a job like any other, the previous owner ran as
    /// the blocker's next run): a number given twice would let a job of the
    /// previous owner's in under a place this owner gave another job. The
    /// first park past the skip waits for the skip to be written
    /// ([`Hold::skip_unwritten`]), so that a next owner passes over this
    /// owner's numbers as well.
    fn loaded(mut self) -> Self {
        let blocker_seq = self.blocker.as_ref().and_then(Blocker::seq);
        self.admitted_seq = self.done_seq.max(blocker_seq.unwrap_or(0));
        self.sent_seq = self.last_seq;
        let last = self.last_seq;
        // A skip never reaches the last number of the hold's range, so one
        // is always left to go on with (see `LOAD_SKIP`).
        let (skip, end) = if last > LEGACY_END {
            (LOAD_SKIP_WIDE, last | u64::from(u32::MAX))
        } else {
            (LOAD_SKIP, LEGACY_END)
        };
        let upto = |from: u64| from.saturating_add(skip).min(end - 1);
        let rare = self.rare_mut();
        match rare.skipped.last_mut() {
            // Nothing written since the last skip: the owner that read the
            // hold back before may have given numbers past it.
            Some(s) if s.after == last => s.upto = upto(s.upto).max(s.upto),
            _ => rare.skipped.push(Skip {
                after: last,
                upto: upto(last).max(last),
            }),
        }
        rare.skip_unwritten = true;
        self
    }

    /// The hold as the held topic gets it now: parks not yet handed to
    /// Kafka do not count.
    pub fn to_write(&self) -> Hold {
        Hold {
            last_seq: self.sent_seq.max(self.done_seq),
            ..self.clone()
        }
    }

    /// A park with sequence `seq` is acknowledged by Kafka; `fresh`: the offset
    /// of the job, when it was read as written (not a parked job back from
    /// the scheduler, whose own record's offset says nothing of the jobs
    /// read before it).
    pub fn sent(&mut self, seq: u64, fresh: Option<i64>) {
        self.sent_seq = self.sent_seq.max(seq);
        if let Some(offset) = fresh {
            self.parked_to = self.parked_to.max(offset);
        }
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
        seq: u64,
        /// Its run-at, ms.
        at_ms: i64,
    },
    /// Dead-letter it: an operator released the key it held.
    Released,
    /// Finish it without running: an earlier run of the job holding its key
    /// (a copy read again or delivered twice, with no park number of this
    /// hold or one counted already: a numbered copy not yet counted counts
    /// its number in its turn), whose failure is what holds the key; its
    /// next run carries on. Run, it would be taken for that next run, or
    /// fail over again and hold the key a second time for one failure.
    Stale,
    /// Keep it in memory: it runs once the key's parked jobs, coming back
    /// now, have run (the key is then let go).
    Wait,
}

/// A job read while its key's blocker is done, or back, and the key's
/// parked jobs are due within this, waits in memory for them instead of
/// being parked behind them (a key with a steady stream of jobs would
/// otherwise send every one through the scheduler).
pub(crate) const WAIT_MS: i64 = 2_000;

/// Jobs wait in memory for their key's parked jobs at most this long; then
/// they are parked behind them, so that a late parked job does not hold the
/// partition's committed offset back.
pub(crate) const MAX_WAIT_MS: i64 = 5_000;

/// No time: a `..._since_ms` field not set.
pub const NEVER: i64 = i64::MIN;

/// No offset: [`Hold::parked_to`] before any park was written.
pub const NO_OFFSET: i64 = -1;

/// A parked job back before its turn (the blocker's next run not back yet,
/// or a job parked before it still out) goes out again due this much later
/// (or with the blocker's next run, if that is later).
pub(crate) const BACK_TOO_SOON_MS: i64 = 1_000;

/// A parked job back before its turn goes out again no later than this
/// after the piece it waits for was due, however long that is overdue.
pub(crate) const BACK_OFF_MAX_MS: i64 = 30_000;

/// How long a key waits for a missing piece before it gives up on it and
/// goes on, unless configured (`[worker] hold_give_up`): a parked job before
/// a returning one that has not come back, or a blocker whose next run was
/// due this long ago and has not come back (a retry cancelled by hand, or a
/// piece held up by an outage). Order is kept in every other case; giving
/// up trades it, for that key, for not being held forever (logged).
pub(crate) const GIVE_UP_MS: i64 = 300_000;

/// How many park numbers a hold whose numbers are of the old, narrow form
/// (at most `u32::MAX`: written before park numbers were widened) passes
/// over when it is read back (see [`Hold::loaded`]): more than a worker
/// gives one key between two writes of its hold (a keeper round).
pub(crate) const LOAD_SKIP: u64 = 1 << 16;

/// How many park numbers a hold passes over when it is read back (see
/// [`Hold::loaded`]): more than a worker gives one key between two writes
/// of its hold (a keeper round writes every hold it changed). A hold has
/// 2^32 numbers: it can be read back 4,095 times before its skips stop
/// short of its last number, and numbers given from there on may be given
/// twice, as when a hold runs out of numbers.
pub(crate) const LOAD_SKIP_WIDE: u64 = 1 << 20;

/// The last park number of the old, narrow form.
const LEGACY_END: u64 = u32::MAX as u64;

/// The low bits of a narrow park number that count a hold's parks; the
/// high ones told a hold from the key's holds before it.
const LEGACY_NUMBER_BITS: u32 = 22;

/// Which hold of its key a park number belongs to: its top 32 bits (the
/// hold's identity, see [`first_number`]), or, for a number of the old,
/// narrow form, its top 10 bits, told apart from any identity.
fn range_of(seq: u64) -> u64 {
    if seq > LEGACY_END {
        seq >> 32
    } else {
        (1 << 32) | (seq >> LEGACY_NUMBER_BITS)
    }
}

/// The number a hold that began at `since_ms` counts its parks from (its
/// first park is one more): `identity << 32`, with a 30-bit identity drawn
/// from `since_ms`, never 0, so that the numbers of a key's successive
/// holds differ (but for one pair in about a billion, or two holds begun
/// in the same millisecond) and a park of an earlier hold, read again
/// after a crash or still coming back, is not taken for one of the current
/// hold. A hold counts 2^32 parks; the identity stays below 2^30 so that a
/// park number fits the bits [`crate::job::JobId::for_park`] mixes it into.
/// 0 at `since_ms` 0 (tests: numbers 1, 2, 3, ...).
pub(crate) fn first_number(since_ms: i64) -> u64 {
    if since_ms == 0 {
        return 0;
    }
    let mixed = (since_ms as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let identity = 1 + (mixed >> 34) % ((1 << 30) - 1);
    identity << 32
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
pub enum HoldWrite {
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
    Write(HoldWrite),
    /// The key should be held, but `max_held_keys` are: it is not.
    Overflow,
}

mod holds;
pub use holds::Holds;

#[cfg(test)]
mod tests;
