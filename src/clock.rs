//! Time, injected: the system clock in production, a hand-driven clock in tests.

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

use crate::sync::Lock;

/// A source of the current time. Everything in Kairos that decides "is it due
/// yet" asks a `Clock`, so tests can drive time instead of sleeping.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;
}

/// The real wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that only moves when told to; for tests.
#[derive(Debug, Clone)]
pub struct ManualClock {
    /// Shared so that clones (one in the test, one inside the component) see the same time.
    now: Arc<Mutex<DateTime<Utc>>>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: DateTime<Utc>) -> Self {
        ManualClock {
            now: Arc::new(Mutex::new(start)),
        }
    }

    /// Move the clock to `t`.
    pub fn set(&self, t: DateTime<Utc>) {
        *self.now.locked() = t;
    }

    /// Move the clock forward by `d`.
    pub fn advance(&self, d: chrono::Duration) {
        let mut now = self.now.locked();
        *now += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.locked()
    }
}

/// A shared clock handle, as the components hold it.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock as a [`SharedClock`].
pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}
