//! Refills, planned by the window and read by the caller: the window says
//! what to read ([`TimerWheel::begin_refill`]), the caller reads the store
//! without the window's lock, and the window merges what was read with the
//! changes it followed meanwhile ([`TimerWheel::finish_refill`]).

use super::{Horizon, TimerWheel};

use crate::scheduler::store::{Applied, DueKey};
use crate::scheduler::stored::StoredJob;

/// A refill under way: the changes the window followed for its partition
/// while the store was read.
pub(super) struct Refilling {
    pub(super) partition: i32,
    pub(super) ticket: u64,
    pub(super) log: Vec<Applied>,
}

/// A read of the store a refill asks for ([`TimerWheel::begin_refill`]):
/// `partition`'s pending jobs after `after` and due at or before
/// `until_ms`, at most `room` of them, in key order.
#[derive(Debug)]
pub struct RefillRead {
    /// The schedule partition.
    pub partition: i32,
    /// Read after this key (`None`: from the start).
    pub after: Option<DueKey>,
    /// Read up to this run-at, inclusive.
    pub until_ms: i64,
    /// Read at most this many jobs.
    pub room: usize,
    /// The partition's horizon when the read was planned.
    horizon: Option<Horizon>,
    ticket: u64,
}

impl TimerWheel {
    /// Start a refill of `partition` at `now_ms`: the read of the store that
    /// brings its window up to `now_ms` + span, or up to just before the
    /// store's cascade point `cascaded_to` if that comes first (jobs at or
    /// after it are not in the near range yet); `None` when the window
    /// already reaches that far or is full. The read is done outside the
    /// window's lock; changes the window follows meanwhile are kept and
    /// applied over what was read in [`TimerWheel::finish_refill`].
    pub fn begin_refill(&mut self, partition: i32, now_ms: i64, cascaded_to: i64) -> Option<RefillRead> {
        let horizon = *self.horizons.get(&partition)?;
        let until_ms = now_ms
            .saturating_add(self.span_ms)
            .min(cascaded_to.saturating_sub(1));
        if matches!(horizon, Some(h) if h.run_at_ms >= until_ms) {
            return None;
        }
        let room = self.capacity.saturating_sub(self.entries.len());
        if room == 0 {
            return None;
        }
        self.next_ticket += 1;
        self.refilling = Some(Refilling {
            partition,
            ticket: self.next_ticket,
            log: Vec::new(),
        });
        Some(RefillRead {
            partition,
            after: horizon.map(|h| h.as_key(partition)),
            until_ms,
            room,
            horizon,
            ticket: self.next_ticket,
        })
    }

    /// Finish a refill with what the store returned for `read` (in key
    /// order); false if it was dropped: the partition was let go or taken
    /// again, or its horizon was pulled back to make room meanwhile (a later
    /// refill reads again).
    pub fn finish_refill(&mut self, read: RefillRead, got: Vec<(DueKey, StoredJob)>) -> bool {
        let Some(refilling) = self.refilling.take_if(|r| r.ticket == read.ticket) else {
            return false;
        };
        if self.horizons.get(&read.partition) != Some(&read.horizon) {
            return false;
        }
        let full = got.len() >= read.room;
        let last = got.last().map(|(k, _)| *k);
        // Jobs of the topics kept out wait elsewhere, not here.
        let mut got = got;
        if !self.kept_out.is_empty() {
            got.retain(|(_, j)| !self.keeps_out(&j.job.topic));
        }
        if got.len() >= self.entries.len() {
            // Merging costs the size of both maps, and builds the scanned
            // (sorted) jobs in one pass: cheaper than inserting them one by
            // one when they are the larger part.
            self.entries.append(&mut got.into_iter().collect());
        } else {
            self.entries.extend(got);
        }
        let new_h = match (full, last) {
            (true, Some(k)) => Horizon {
                run_at_ms: k.run_at_ms,
                seq: k.seq,
            },
            _ => Horizon {
                run_at_ms: read.until_ms,
                seq: u64::MAX,
            },
        };
        self.horizons.insert(read.partition, Some(new_h));
        // Changes applied to the store while it was read, beyond the old
        // horizon (the window followed the others as they came): the read
        // may have missed them, and applying them again is harmless.
        let fresh = |k: &DueKey| new_h.covers(k) && !read.horizon.is_some_and(|h| h.covers(k));
        for a in refilling.log {
            match a {
                Applied::Added(k, job) if fresh(&k) && !self.keeps_out(&job.job.topic) => {
                    self.entries.insert(k, job);
                }
                Applied::Removed(k, _) if fresh(&k) => {
                    self.entries.remove(&k);
                }
                _ => {}
            }
        }
        self.shrink();
        true
    }

    /// Drop the refill of `partition` under way, if any.
    pub(super) fn forget_refill(&mut self, partition: i32) {
        self.refilling.take_if(|r| r.partition == partition);
    }
}
