//! Offsets of direct jobs: nothing but its schedule record holds such a
//! job, so that record's offset may be committed only once the job's
//! work-topic write was acknowledged (or the job was persisted after all).
//! [`DirectOffsets`] tracks, per schedule partition, the offsets of direct
//! jobs still in flight and says how far the partition may be committed.

use std::collections::BTreeSet;

/// One schedule partition's ingested offsets and the direct jobs among them
/// not yet fired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectOffsets {
    /// The last offset ingested (persisted, or held as a direct job).
    ingested: i64,
    /// Offsets of direct jobs not yet acknowledged by their work topic.
    in_flight: BTreeSet<i64>,
    /// The last offset handed to the consumer to commit.
    stored: i64,
}

impl Default for DirectOffsets {
    fn default() -> Self {
        DirectOffsets {
            ingested: -1,
            in_flight: BTreeSet::new(),
            stored: -1,
        }
    }
}

impl DirectOffsets {
    /// Records up to `last` are persisted or held as direct jobs.
    pub fn ingested(&mut self, last: i64) {
        self.ingested = self.ingested.max(last);
    }

    /// The record at `offset` is a direct job about to enter the window.
    pub fn hold(&mut self, offset: i64) {
        self.in_flight.insert(offset);
    }

    /// The direct job at `offset` no longer holds the commit back: it was
    /// fired or dead-lettered, or it went the durable way after all (the
    /// window had no room for it) and its record is persisted.
    pub fn release(&mut self, offset: i64) {
        self.in_flight.remove(&offset);
    }

    /// The last offset that may be committed: every record up to it is
    /// persisted or fired.
    pub fn safe(&self) -> i64 {
        match self.in_flight.first() {
            Some(first) => (first - 1).min(self.ingested),
            None => self.ingested,
        }
    }

    /// The first offset not yet handled once the records up to `last` are
    /// persisted, with the direct jobs at `holding` added and those at
    /// `releasing` let go (a cancel or replace of them is in the same batch).
    pub fn first_unhandled(
        &self,
        last: i64,
        holding: impl IntoIterator<Item = i64>,
        releasing: &[i64],
    ) -> i64 {
        let held = self.in_flight.iter().copied().find(|o| !releasing.contains(o));
        held.into_iter()
            .chain(holding)
            .fold(last.max(self.ingested) + 1, i64::min)
    }

    /// The first offset not yet handled once the direct jobs at `releasing`
    /// (sorted) are fired: those below it may be fired in one transaction
    /// with a record saying so; the others wait for a direct job below them.
    pub fn first_unhandled_releasing(&self, releasing: &[i64]) -> i64 {
        let held = self
            .in_flight
            .iter()
            .copied()
            .find(|o| releasing.binary_search(o).is_err());
        held.map_or(self.ingested + 1, |h| h.min(self.ingested + 1))
    }

    /// [`first_unhandled`](Self::first_unhandled) for a partition that may
    /// have no entry yet (`None`: no direct job held, as right after its
    /// assignment): the batch's own direct jobs at `holding` still hold the
    /// frontier back, or a new owner would skip them unfired.
    pub fn first_unhandled_of(
        d: Option<&DirectOffsets>,
        last: i64,
        holding: impl IntoIterator<Item = i64>,
        releasing: &[i64],
    ) -> i64 {
        match d {
            Some(d) => d.first_unhandled(last, holding, releasing),
            None => DirectOffsets::default().first_unhandled(last, holding, releasing),
        }
    }

    /// The offset to store for commit, if it moved since the last call.
    pub fn offset_to_store(&mut self) -> Option<i64> {
        let safe = self.safe();
        (safe > self.stored).then(|| {
            self.stored = safe;
            safe
        })
    }

    /// Direct jobs not yet fired.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_stop_below_the_first_direct_job_in_flight() {
        let mut d = DirectOffsets::default();
        assert_eq!(d.offset_to_store(), None, "nothing ingested");
        d.hold(3);
        d.hold(7);
        d.ingested(9);
        assert_eq!(d.safe(), 2);
        assert_eq!(d.offset_to_store(), Some(2));
        assert_eq!(d.offset_to_store(), None, "unchanged");
        d.release(7);
        assert_eq!(d.offset_to_store(), None, "3 still holds it");
        d.release(3);
        assert_eq!(d.offset_to_store(), Some(9));
        d.hold(10);
        d.ingested(12);
        assert_eq!(d.offset_to_store(), None, "10 in flight: 9 stays the last");
        d.release(10);
        assert_eq!(d.offset_to_store(), Some(12));
        assert_eq!(d.in_flight(), 0);
    }

    #[test]
    fn the_first_unhandled_offset_once_fired_stops_at_the_first_direct_job_left() {
        let mut d = DirectOffsets::default();
        for o in [2, 3, 6] {
            d.hold(o);
        }
        d.ingested(9);
        assert_eq!(d.first_unhandled_releasing(&[]), 2);
        assert_eq!(d.first_unhandled_releasing(&[2, 3]), 6, "6 still in flight");
        assert_eq!(d.first_unhandled_releasing(&[3, 6]), 2, "2 left: nothing covered");
        assert_eq!(
            d.first_unhandled_releasing(&[2, 3, 6]),
            10,
            "all fired: past the last ingested"
        );
    }

    #[test]
    fn the_first_unhandled_offset_counts_new_holds_and_skips_releases() {
        let mut d = DirectOffsets::default();
        assert_eq!(d.first_unhandled(9, [], &[]), 10);
        assert_eq!(d.first_unhandled(9, [4, 6], &[]), 4);
        d.hold(2);
        d.hold(3);
        d.ingested(5);
        assert_eq!(d.first_unhandled(9, [], &[]), 2);
        assert_eq!(d.first_unhandled(9, [], &[2]), 3);
        assert_eq!(d.first_unhandled(9, [7], &[2, 3]), 7);
    }

    #[test]
    fn a_new_partitions_first_batch_is_held_back_by_its_own_direct_jobs() {
        // A partition just assigned has no entry: its first batch's direct
        // jobs (not fired yet) must not be counted as handled.
        assert_eq!(DirectOffsets::first_unhandled_of(None, 9, [4, 6], &[]), 4);
        assert_eq!(DirectOffsets::first_unhandled_of(None, 9, [], &[]), 10);
        let mut d = DirectOffsets::default();
        d.hold(2);
        d.ingested(3);
        assert_eq!(DirectOffsets::first_unhandled_of(Some(&d), 9, [4], &[]), 2);
    }

    #[test]
    fn a_direct_job_at_offset_zero_holds_everything() {
        let mut d = DirectOffsets::default();
        d.hold(0);
        d.ingested(5);
        assert_eq!(d.safe(), -1);
        assert_eq!(d.offset_to_store(), None);
        d.release(0);
        assert_eq!(d.offset_to_store(), Some(5));
    }
}
