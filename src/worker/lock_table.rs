//! The lock table: one job per entity key at a time, jobs of a key in the
//! order they were read, jobs of different keys in parallel.
//!
//! Each key with work has a FIFO of buffered jobs and a flag saying whether
//! one of its jobs is running. A key is *ready* when it has buffered jobs and
//! none running; ready keys wait in a queue in the order they became ready.
//! When a key has nothing running and nothing buffered its entry is removed:
//! memory is bounded by the jobs in flight and buffered, not by the number
//! of keys ever seen (seed 000: billions of UUID keys).

use std::collections::VecDeque;

// Keys come from the network: the hasher is seeded at random per table.
use crate::hash::HashMap;

/// Something the table schedules: it belongs to a key and a partition.
pub trait Keyed {
    /// The entity key.
    fn key(&self) -> &[u8];
    /// The partition it was read from.
    fn partition(&self) -> (usize, i32);
}

/// One key's state.
struct KeyState<T> {
    /// Whether a job of this key is running.
    running: bool,
    /// Buffered jobs, in read order.
    queue: VecDeque<T>,
}

/// The lock table.
pub struct LockTable<T> {
    keys: HashMap<Vec<u8>, KeyState<T>>,
    /// Keys with buffered jobs and none running, in the order they became ready.
    ready: VecDeque<Vec<u8>>,
    /// Jobs buffered (not running) over all keys.
    buffered: usize,
    /// Jobs running.
    running: usize,
}

impl<T: Keyed> Default for LockTable<T> {
    fn default() -> Self {
        LockTable {
            keys: HashMap::default(),
            ready: VecDeque::new(),
            buffered: 0,
            running: 0,
        }
    }
}

impl<T: Keyed> LockTable<T> {
    #[cfg(test)]
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Buffer a job behind the other jobs of its key.
    pub fn push(&mut self, item: T) {
        if !self.keys.contains_key(item.key()) {
            let state = KeyState {
                running: false,
                queue: VecDeque::new(),
            };
            self.keys.insert(item.key().to_vec(), state);
        }
        let st = self.keys.get_mut(item.key()).expect("inserted above");
        if !st.running && st.queue.is_empty() {
            self.ready.push_back(item.key().to_vec());
        }
        st.queue.push_back(item);
        self.buffered += 1;
    }

    /// Take the next job that may run now (its key has nothing running) and
    /// mark its key running.
    pub fn next_ready(&mut self) -> Option<T> {
        while let Some(key) = self.ready.pop_front() {
            let Some(st) = self.keys.get_mut(&key) else {
                continue;
            };
            if st.running {
                continue;
            }
            let Some(item) = st.queue.pop_front() else {
                continue;
            };
            st.running = true;
            self.buffered -= 1;
            self.running += 1;
            return Some(item);
        }
        None
    }

    /// The running job of `key` finished: the key's next job becomes ready,
    /// or the key is forgotten if it has none.
    pub fn complete(&mut self, key: &[u8]) {
        let Some(st) = self.keys.get_mut(key) else { return };
        if st.running {
            st.running = false;
            self.running -= 1;
        }
        if st.queue.is_empty() {
            self.keys.remove(key);
        } else {
            self.ready.push_back(key.to_vec());
        }
    }

    /// Take `key`'s buffered (not running) jobs out of the table, in order
    /// (its key became held: they are parked instead of run).
    pub fn take_buffered(&mut self, key: &[u8]) -> Vec<T> {
        let Some(st) = self.keys.get_mut(key) else {
            return Vec::new();
        };
        let taken: Vec<T> = st.queue.drain(..).collect();
        self.buffered -= taken.len();
        if !st.running {
            self.keys.remove(key);
        }
        taken
    }

    /// Drop every buffered (not running) job read from `partition`; return them.
    pub fn drop_partition(&mut self, partition: (usize, i32)) -> Vec<T> {
        let mut dropped = Vec::new();
        self.keys.retain(|_, st| {
            let before = st.queue.len();
            let (gone, keep): (VecDeque<T>, VecDeque<T>) =
                st.queue.drain(..).partition(|i| i.partition() == partition);
            st.queue = keep;
            debug_assert_eq!(before, gone.len() + st.queue.len());
            dropped.extend(gone);
            st.running || !st.queue.is_empty()
        });
        self.buffered -= dropped.len();
        dropped
    }

    /// Whether a job of `key` is running or waiting in the table.
    pub fn busy(&self, key: &[u8]) -> bool {
        self.keys.contains_key(key)
    }

    /// Jobs buffered, waiting for their key or for a free slot.
    pub fn buffered(&self) -> usize {
        self.buffered
    }

    /// Jobs running.
    pub fn running(&self) -> usize {
        self.running
    }

    #[cfg(test)]
    /// Keys the table holds state for (running or buffered).
    pub fn keys(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Item {
        key: Vec<u8>,
        part: i32,
        n: u32,
    }

    impl Keyed for Item {
        fn key(&self) -> &[u8] {
            &self.key
        }
        fn partition(&self) -> (usize, i32) {
            (0, self.part)
        }
    }

    fn item(key: &str, n: u32) -> Item {
        Item {
            key: key.as_bytes().to_vec(),
            part: 0,
            n,
        }
    }

    #[test]
    fn one_job_per_key_in_order_other_keys_in_parallel() {
        let mut t = LockTable::new();
        t.push(item("a", 1));
        t.push(item("a", 2));
        t.push(item("b", 3));
        let first = t.next_ready().unwrap();
        let second = t.next_ready().unwrap();
        assert_eq!((first.n, second.n), (1, 3), "a and b run in parallel");
        assert!(t.next_ready().is_none(), "a's second job waits for its first");
        assert!(t.busy(b"a") && t.busy(b"b") && !t.busy(b"c"));
        t.complete(b"a");
        assert_eq!(t.next_ready().unwrap().n, 2);
    }

    #[test]
    fn idle_keys_are_forgotten() {
        let mut t = LockTable::new();
        for i in 0..1000 {
            t.push(item(&format!("k{i}"), i));
        }
        while let Some(i) = t.next_ready() {
            t.complete(&i.key);
        }
        assert_eq!(t.keys(), 0);
        assert_eq!(t.buffered(), 0);
        assert_eq!(t.running(), 0);
    }

    #[test]
    fn dropping_a_partition_keeps_running_jobs_and_other_partitions() {
        let mut t = LockTable::new();
        t.push(Item {
            key: b"a".to_vec(),
            part: 0,
            n: 1,
        });
        t.push(Item {
            key: b"a".to_vec(),
            part: 0,
            n: 2,
        });
        t.push(Item {
            key: b"b".to_vec(),
            part: 1,
            n: 3,
        });
        let running = t.next_ready().unwrap();
        let dropped = t.drop_partition((0, 0));
        assert_eq!(dropped.iter().map(|i| i.n).collect::<Vec<_>>(), vec![2]);
        assert_eq!(t.buffered(), 1);
        t.complete(&running.key);
        assert_eq!(t.next_ready().unwrap().n, 3);
        assert!(t.next_ready().is_none());
    }

    #[test]
    fn a_key_s_buffered_jobs_can_be_taken_out_in_order() {
        let mut t = LockTable::new();
        for n in 1..=3 {
            t.push(item("a", n));
        }
        t.push(item("b", 9));
        let running = t.next_ready().unwrap();
        assert_eq!(running.n, 1);
        let taken: Vec<u32> = t.take_buffered(b"a").into_iter().map(|i| i.n).collect();
        assert_eq!(taken, vec![2, 3]);
        assert_eq!(t.buffered(), 1);
        t.complete(b"a");
        assert_eq!(t.next_ready().unwrap().n, 9, "a has nothing left to run");
        assert!(t.next_ready().is_none());
        assert!(t.take_buffered(b"nobody").is_empty());
    }

    proptest! {
        /// Whatever the interleaving of pushes, starts and completions, a key
        /// never has two jobs running and its jobs start in push order.
        #[test]
        fn never_two_running_per_key_and_fifo_per_key(ops in proptest::collection::vec((0u8..3, 0u8..4), 1..200)) {
            let mut t = LockTable::new();
            let mut running: Vec<Item> = Vec::new();
            let mut next_n = 0u32;
            let mut last_started: HashMap<Vec<u8>, u32> = HashMap::default();
            for (op, k) in ops {
                match op {
                    0 => { t.push(item(&format!("k{k}"), next_n)); next_n += 1; }
                    1 => if let Some(i) = t.next_ready() {
                        prop_assert!(!running.iter().any(|r| r.key == i.key), "two running for a key");
                        if let Some(prev) = last_started.insert(i.key.clone(), i.n) {
                            prop_assert!(prev < i.n, "out of order");
                        }
                        running.push(i);
                    },
                    _ => if !running.is_empty() {
                        let i = running.remove(k as usize % running.len());
                        t.complete(&i.key);
                    },
                }
                prop_assert_eq!(t.running(), running.len());
            }
        }
    }
}
