//! Fire batches in flight, counted per schedule partition: a partition
//! taken away waits for its fires to be finished before it is let go.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::hash::{HashMap, HashSet};
use crate::sync::{Lock, Wait};

/// Fire batches handed to librdkafka and not yet finished, per partition.
#[derive(Default)]
pub(super) struct Firing {
    batches: Mutex<HashMap<i32, usize>>,
    /// Signalled when a batch is finished.
    finished: Condvar,
}

impl Firing {
    /// A batch with jobs from `parts` (each named once) is being fired.
    pub(super) fn start(&self, parts: &HashSet<i32>) {
        let mut b = self.lock();
        for p in parts {
            *b.entry(*p).or_insert(0) += 1;
        }
    }

    /// Batches started with these partition sets are finished.
    pub(super) fn finish<'a>(&self, parts: impl IntoIterator<Item = &'a HashSet<i32>>) {
        {
            let mut b = self.lock();
            for p in parts.into_iter().flatten() {
                if let Some(n) = b.get_mut(p) {
                    *n -= 1;
                    if *n == 0 {
                        b.remove(p);
                    }
                }
            }
        }
        self.finished.notify_all();
    }

    /// Wait until no batch from `parts` is in flight; false if some still
    /// are at `deadline`.
    pub(super) fn wait_idle(&self, parts: &[i32], deadline: Instant) -> bool {
        let mut b = self.lock();
        loop {
            if !parts.iter().any(|p| b.contains_key(p)) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            b = self
                .finished
                .waiting_at_most(b, left.min(Duration::from_millis(100)));
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, usize>> {
        self.batches.locked()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_is_idle_once_each_of_its_batches_is_finished() {
        let f = Firing::default();
        let a: HashSet<i32> = [0, 1].into_iter().collect();
        let b: HashSet<i32> = [1].into_iter().collect();
        f.start(&a);
        f.start(&b);
        let now = Instant::now;
        assert!(!f.wait_idle(&[1], now()), "two batches of 1 in flight");
        assert!(f.wait_idle(&[2], now()), "nothing of 2");
        f.finish([&a]);
        assert!(f.wait_idle(&[0], now()));
        assert!(!f.wait_idle(&[1], now()), "one batch of 1 left");
        std::thread::scope(|s| {
            s.spawn(|| f.finish([&b]));
            assert!(f.wait_idle(&[0, 1], now() + Duration::from_secs(10)));
        });
    }
}
