//! The hand-off between the read and the apply threads: records read and
//! not yet applied, merged while the apply thread is busy.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::ingest::{ReadBatch, BATCH_BYTES};

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
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hand `batch` to the apply thread, merged with what waits; first wait
    /// while `most` records or more wait, or twice [`BATCH_BYTES`].
    pub(super) fn push(&self, batch: ReadBatch, most: usize) {
        let mut q = self.lock();
        let full = |w: &ReadBatch| w.records.len() >= most || w.bytes >= 2 * BATCH_BYTES;
        while q.waiting.as_ref().is_some_and(full) && !q.closed {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
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
            q = self
                .changed
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
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
            q = self
                .changed
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}
