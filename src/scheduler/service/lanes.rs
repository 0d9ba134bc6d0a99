//! The hand-off between the read and the apply threads: records read and
//! not yet applied, merged while an apply thread is busy. Each apply thread
//! has its lane, for a fixed share of the partitions: batches of different
//! lanes are persisted side by side (one waits for its changelog
//! acknowledgements while another resolves or writes the store), and a
//! partition's batches stay in order on its lane.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::batch::{ReadBatch, BATCH_BYTES};
use crate::sync::{Lock, Wait};

/// The apply threads' lanes: partition `p` is applied on lane `p % lanes`.
pub(super) struct Lanes {
    lanes: Vec<Applying>,
}

impl Lanes {
    /// `n` lanes (at least one).
    pub(super) fn new(n: usize) -> Lanes {
        Lanes {
            lanes: (0..n.max(1)).map(|_| Applying::default()).collect(),
        }
    }

    /// How many lanes (apply threads) there are.
    pub(super) fn len(&self) -> usize {
        self.lanes.len()
    }

    /// The lane partition `p` is applied on.
    pub(super) fn of(&self, p: i32) -> usize {
        p.unsigned_abs() as usize % self.lanes.len()
    }

    /// Lane `i`.
    pub(super) fn lane(&self, i: usize) -> &Applying {
        &self.lanes[i]
    }

    /// Hand each lane its batch (see [`Applying::push`]); lanes with
    /// nothing read are left alone.
    pub(super) fn push(&self, batches: Vec<ReadBatch>, most: usize) {
        for (lane, b) in self.lanes.iter().zip(batches) {
            if b.read > 0 {
                lane.push(b, most);
            }
        }
    }

    /// No more batches come, on any lane.
    pub(super) fn close(&self) {
        self.lanes.iter().for_each(Applying::close);
    }

    /// Wait until every batch read is applied on every lane, or `deadline`;
    /// whether they are.
    pub(super) fn wait_idle(&self, deadline: Instant) -> bool {
        self.lanes.iter().all(|l| l.wait_idle(deadline))
    }
}

/// What the apply thread gets from [`Applying::take_within`].
pub(super) enum Next {
    /// A batch to apply.
    Batch(ReadBatch),
    /// None came within the time given.
    Idle,
    /// No more batches come (closed and drained).
    Closed,
}

/// Records read and not yet applied, merged into one batch while the apply
/// thread is busy (so reading never waits for a batch to be persisted, and
/// a backlog is applied in larger batches). A revoked partition is let go
/// only once the records read from it are applied.
#[derive(Default)]
pub(super) struct Applying {
    pub(super) state: Mutex<Queue>,
    pub(super) changed: Condvar,
}

#[derive(Default)]
pub(super) struct Queue {
    /// Read, waiting for the apply thread.
    pub(super) waiting: Option<ReadBatch>,
    /// The apply thread is applying a batch.
    pub(super) busy: bool,
    /// No more batches come.
    pub(super) closed: bool,
}

impl Applying {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.state.locked()
    }

    /// Hand `batch` to the apply thread, merged with what waits; first wait
    /// while `most` records or more wait, or twice [`BATCH_BYTES`].
    pub(super) fn push(&self, batch: ReadBatch, most: usize) {
        let mut q = self.lock();
        let full = |w: &ReadBatch| w.records.len() >= most || w.bytes >= 2 * BATCH_BYTES;
        while q.waiting.as_ref().is_some_and(full) && !q.closed {
            q = self.changed.waiting(q);
        }
        match &mut q.waiting {
            Some(w) => w.merge(batch),
            None => q.waiting = Some(batch),
        }
        self.changed.notify_all();
    }

    /// The next batch to apply, waiting at most `wait` for one.
    pub(super) fn take_within(&self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        let mut q = self.lock();
        q.busy = false;
        self.changed.notify_all();
        loop {
            if let Some(b) = q.waiting.take() {
                q.busy = true;
                self.changed.notify_all();
                return Next::Batch(b);
            }
            if q.closed {
                return Next::Closed;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Next::Idle;
            }
            q = self.changed.waiting_at_most(q, left);
        }
    }

    /// No more batches come: the apply thread ends once it has applied the rest.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Wait until every batch read is applied, or `deadline`; whether they are.
    pub(super) fn wait_idle(&self, deadline: Instant) -> bool {
        let mut q = self.lock();
        while q.waiting.is_some() || q.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self.changed.waiting_at_most(q, left);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(n: u64) -> ReadBatch {
        ReadBatch {
            read: n,
            ..ReadBatch::default()
        }
    }

    #[test]
    fn each_partition_has_one_lane_and_only_lanes_with_records_read_get_a_batch() {
        let lanes = Lanes::new(2);
        assert_eq!((lanes.of(0), lanes.of(1), lanes.of(2), lanes.of(3)), (0, 1, 0, 1));
        assert_eq!(Lanes::new(0).len(), 1, "at least one lane");
        lanes.push(vec![read(0), read(3)], 10);
        assert!(matches!(lanes.lane(0).take_within(Duration::ZERO), Next::Idle));
        let soon = Instant::now() + Duration::from_millis(10);
        assert!(!lanes.wait_idle(soon), "lane 1 has a batch waiting");
        match lanes.lane(1).take_within(Duration::ZERO) {
            Next::Batch(b) => assert_eq!(b.read, 3),
            _ => panic!("lane 1's batch"),
        }
        assert!(!lanes.wait_idle(Instant::now()), "lane 1 is applying it");
        assert!(matches!(lanes.lane(1).take_within(Duration::ZERO), Next::Idle));
        assert!(lanes.wait_idle(Instant::now()), "both lanes idle");
        lanes.close();
        assert!(matches!(lanes.lane(0).take_within(Duration::ZERO), Next::Closed));
        assert!(matches!(lanes.lane(1).take_within(Duration::ZERO), Next::Closed));
    }
}
