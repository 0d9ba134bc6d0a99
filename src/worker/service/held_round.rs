//! Exactly once on partitions whose keys can be held (see
//! [`crate::worker::hold::progress`]): a held key's state is committed in
//! the next transaction with the writes of every job it counts, so each
//! transaction takes, per such partition, every finished job's writes,
//! above the commit point too, the holds changed since the last one, and
//! the partition's progress (which offsets above the commit point are done,
//! for the next owner to skip).
//!
//! A hold changes, and the job that changed it finishes, under one state
//! lock (parks are staged and finished as they are given their numbers;
//! a settled job's hold changes as its offset finishes): a transaction
//! never commits a hold without the writes of what it counts.

use super::round::Round;
use super::{Tp, WorkerState};

use crate::worker::hold::progress::{self, Done};
use crate::worker::hold::{record, HoldWrite};

/// The names held-topic records are written under.
pub(super) struct Naming {
    /// The held topic.
    pub(super) held: String,
    /// The work topics, by index.
    pub(super) topics: Vec<String>,
}

/// Take into `round` what `tp` has to commit, if its keys can be held:
/// every finished job's writes, the records of the holds changed, and its
/// progress, with its commit point. Nothing when nothing of it changed.
pub(super) fn take(st: &mut WorkerState, naming: &Naming, tp: Tp, round: &mut Round) {
    let Some(claim) = st.owned.get(&tp).and_then(|o| o.claim) else {
        return;
    };
    let Some(point) = st.tracker.commit_point(tp) else {
        return;
    };
    if st.done_above.get(&tp).is_some_and(|d| point >= d.to) {
        // Everything its last owner had done is below the commit point.
        st.done_above.remove(&tp);
    }
    let mut taken = Vec::new();
    if let Some(by_offset) = st.staged.get_mut(&tp) {
        let finished: Vec<i64> = by_offset
            .keys()
            .copied()
            .filter(|o| !st.tracker.is_open(tp, *o))
            .collect();
        for offset in finished {
            if let Some(records) = by_offset.remove(&offset) {
                taken.push((tp, offset, records));
            }
        }
        if by_offset.is_empty() {
            st.staged.remove(&tp);
        }
    }
    let keys = st.dirty.remove(&tp).unwrap_or_default();
    if taken.is_empty() && keys.is_empty() {
        return;
    }
    // (`commit_point` answered: the partition is tracked.)
    let (point, next, open) = st.tracker.progress(tp).unwrap_or((point, point, Vec::new()));
    let topic = &naming.topics[tp.0];
    for key in &keys {
        let change = match st.holds.get(tp, key) {
            Some(h) => HoldWrite::Put(h.to_write()),
            None => HoldWrite::Let,
        };
        let rec = record::record(&naming.held, Some(claim), topic, key, &change);
        round.pinned.push((tp.1, rec));
    }
    let mut done = Done { to: next, open };
    if let Some(before) = st.done_above.get(&tp).filter(|d| d.to > next) {
        // What the last owner did beyond what this one read so far still
        // counts.
        done.open.extend(before.open.iter().filter(|o| **o >= next));
        done.to = before.to;
    }
    round
        .pinned
        .push((tp.1, progress::record(&naming.held, claim, topic, &done)));
    round.records.extend(taken);
    round.dirty.extend(keys.into_iter().map(|k| (tp, k)));
    match round.points.iter_mut().find(|(p, ..)| *p == tp) {
        Some(at) => at.1 = point,
        None => round.points.push((tp, point, Some(claim))),
    }
}

/// A round that did not commit: its held keys count as changed again (for
/// the partitions still owned).
pub(super) fn put_back(st: &mut WorkerState, dirty: Vec<(Tp, Vec<u8>)>) {
    for (tp, key) in dirty {
        if st.owned.contains_key(&tp) {
            st.dirty.entry(tp).or_default().insert(key);
        }
    }
}
