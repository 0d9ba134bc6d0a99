//! Where the in-memory window meets the store: a refill reads the jobs the
//! window asks for outside the window's lock (the dispatcher and the
//! ingest threads keep going meanwhile), then merges them in.
//!
//! It reads only the near range, below the store's cascade point; moving
//! that point is the cascader's job (the scheduler's upkeep task), so a
//! refill that finds it too close says so and the cascader is asked.

use std::sync::Mutex;

use crate::scheduler::store::{Store, StoreError};
use crate::scheduler::timer_wheel::TimerWheel;
use crate::sync::Lock;

/// What a refill did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refilled {
    /// Jobs read into the window.
    pub read: usize,
    /// A partition's cascade point held the window back (the window could
    /// not reach a span ahead): the cascader should move it on.
    pub behind_cascade: bool,
}

/// A window behind a lock, taken for each step of a refill (and released
/// while the store is read).
pub trait WindowLock {
    /// Run `f` with the window locked.
    fn with_window<R>(&self, f: impl FnOnce(&mut TimerWheel) -> R) -> R;
}

impl WindowLock for Mutex<TimerWheel> {
    fn with_window<R>(&self, f: impl FnOnce(&mut TimerWheel) -> R) -> R {
        f(&mut self.locked())
    }
}

/// Bring the window of every partition up to `now_ms` plus its span (or its
/// cascade point), reading the store with the window unlocked.
pub fn refill(window: &impl WindowLock, store: &Store, now_ms: i64) -> Result<Refilled, StoreError> {
    let (parts, span_ms) = window.with_window(|w| (w.partitions(), w.span_ms()));
    let mut done = Refilled::default();
    for p in parts {
        let cascaded_to = store.checkpoint(p)?.cascaded_to;
        if cascaded_to <= now_ms.saturating_add(span_ms) {
            done.behind_cascade = true;
        }
        let Some(read) = window.with_window(|w| w.begin_refill(p, now_ms, cascaded_to)) else {
            continue;
        };
        let got = store.scan_due(p, read.after, read.until_ms, read.room)?;
        let n = got.len();
        if window.with_window(|w| w.finish_refill(read, got)) {
            done.read += n;
        }
    }
    Ok(done)
}
