//! Locks that outlive a panic. A thread that panics while holding a lock
//! poisons it; Kairos's threads and tasks keep no invariant across a panic
//! that a later holder could trip on (a panicking handler is caught before
//! it touches shared state, and a panic elsewhere stops the service), so a
//! poisoned lock is taken as it stands. Every lock is taken through these
//! traits, but for one reading that asks whether a lock is poisoned: a
//! scheduler whose first-error slot is poisoned is not ready (its
//! `/readyz`).

use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// [`Mutex::lock`], a poisoned lock taken as it stands.
pub(crate) trait Lock<T> {
    /// The guard, whether or not a holder panicked.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Lock<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// [`RwLock::read`] and [`RwLock::write`], a poisoned lock taken as it
/// stands.
pub(crate) trait ReadWrite<T> {
    /// A read guard, whether or not a holder panicked.
    fn reading(&self) -> RwLockReadGuard<'_, T>;
    /// A write guard, whether or not a holder panicked.
    fn writing(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T> ReadWrite<T> for RwLock<T> {
    fn reading(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(|e| e.into_inner())
    }

    fn writing(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// [`Condvar::wait`] and [`Condvar::wait_timeout`], a poisoned lock taken
/// as it stands.
pub(crate) trait Wait {
    /// Wait for a notification.
    fn waiting<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T>;
    /// Wait for a notification or `timeout` (the caller checks which).
    fn waiting_at_most<'a, T>(&self, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T>;
}

impl Wait for Condvar {
    fn waiting<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        self.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    fn waiting_at_most<'a, T>(&self, guard: MutexGuard<'a, T>, timeout: Duration) -> MutexGuard<'a, T> {
        self.wait_timeout(guard, timeout)
            .unwrap_or_else(|e| e.into_inner())
            .0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_poisoned_by_a_panic_is_taken_as_it_stands() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let rw = std::sync::Arc::new(RwLock::new(1));
        let (m2, rw2) = (m.clone(), rw.clone());
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            let _w = rw2.write().unwrap();
            panic!("poison both");
        })
        .join();
        assert!(m.is_poisoned() && rw.is_poisoned());
        *m.locked() += 1;
        *rw.writing() += 1;
        assert_eq!((*m.locked(), *rw.reading()), (2, 2));
        let cv = Condvar::new();
        let g = cv.waiting_at_most(m.locked(), Duration::from_millis(1));
        assert_eq!(*g, 2);
    }
}
