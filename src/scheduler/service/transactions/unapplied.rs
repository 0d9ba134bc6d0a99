//! Changelog records committed whose effect is not yet in the store: a
//! store checkpoint never passes one (see [`Unapplied`]).

use std::sync::Mutex;

use rdkafka::producer::future_producer::Delivery;

use super::Transactions;
use crate::hash::HashMap;
use crate::sync::Lock;
use crate::wire::OwnedRecord;

/// Changelog records committed whose effect is not yet in the store, per
/// partition: the first offset of each submission's records there (a
/// multiset). Writers commit in one order and write the store in another
/// (rounds and apply lanes run side by side), and a store checkpoint past
/// a committed tombstone whose delete is not yet written would, after a
/// crash, fire that job again (the catch-up starts after its tombstone).
pub(super) type Unapplied = HashMap<i32, std::collections::BTreeMap<i64, usize>>;

/// Per changelog partition, the offset of a committed submission's first
/// record there: noted as not yet applied to the store until its
/// [`Applying`] is dropped.
pub(in crate::scheduler::service) struct Pending {
    firsts: Vec<(i32, i64)>,
}

impl Pending {
    /// A submission with no changelog record committed.
    pub(in crate::scheduler::service) fn none() -> Pending {
        Pending { firsts: Vec::new() }
    }
}

/// A committed submission whose store write is under way: holds other
/// writers' checkpoints back ([`Transactions::applicable`]) until dropped,
/// once the write is done (or given up).
pub(in crate::scheduler::service) struct Applying<'a> {
    txn: &'a Transactions,
    pending: Pending,
}

impl Applying<'_> {
    /// How far partition `p`'s checkpoint may go, for records here ending before `next`.
    pub(in crate::scheduler::service) fn applicable(&self, p: i32, next: i64) -> i64 {
        self.txn.applicable(&self.pending, p, next)
    }
}

impl Drop for Applying<'_> {
    fn drop(&mut self) {
        self.txn.applied(&self.pending);
    }
}

impl Transactions {
    /// How far partition `p`'s store checkpoint may say the changelog is
    /// applied, by the writer of `pending` whose own records end before
    /// `next`: not past the first record of another committed submission
    /// whose store write is not done.
    fn applicable(&self, pending: &Pending, p: i32, next: i64) -> i64 {
        let own = pending.firsts.iter().find(|(q, _)| *q == p).map(|(_, o)| *o);
        let u = self.unapplied.locked();
        let Some(firsts) = u.get(&p) else {
            return next;
        };
        let mut skip_own = own;
        for (first, n) in firsts {
            let others = match skip_own {
                Some(o) if o == *first => {
                    skip_own = None;
                    n - 1
                }
                _ => *n,
            };
            if others > 0 {
                return next.min(*first);
            }
        }
        next
    }

    /// A committed submission's store write begins: see [`Applying`].
    pub(in crate::scheduler::service) fn applying(&self, pending: Pending) -> Applying<'_> {
        Applying { txn: self, pending }
    }

    /// `pending`'s store write is done (or given up): its records no
    /// longer hold other writers' checkpoints back.
    fn applied(&self, pending: &Pending) {
        let u = &mut *self.unapplied.locked();
        for (p, first) in &pending.firsts {
            if let Some(firsts) = u.get_mut(p) {
                if let Some(n) = firsts.get_mut(first) {
                    *n -= 1;
                    if *n == 0 {
                        firsts.remove(first);
                    }
                }
                if firsts.is_empty() {
                    u.remove(p);
                }
            }
        }
    }
}

/// Note the changelog records of a committed submission (`records`, each
/// acknowledged as in `acks`) as not yet applied to the store.
pub(super) fn note(
    unapplied: &Mutex<Unapplied>,
    changelog: &str,
    records: &[(OwnedRecord, Option<i32>)],
    acks: &[Delivery],
) -> Pending {
    let mut firsts: Vec<(i32, i64)> = Vec::new();
    for ((r, _), d) in records.iter().zip(acks) {
        if r.topic != changelog {
            continue;
        }
        match firsts.iter_mut().find(|(p, _)| *p == d.partition) {
            Some((_, o)) => *o = (*o).min(d.offset),
            None => firsts.push((d.partition, d.offset)),
        }
    }
    let u = &mut *unapplied.locked();
    for (p, o) in &firsts {
        *u.entry(*p).or_default().entry(*o).or_default() += 1;
    }
    Pending { firsts }
}
