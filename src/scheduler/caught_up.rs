//! How far each owned schedule partition has been read, in time: the rule
//! that a cancel or reschedule acknowledged before a job's run-at wins.
//!
//! A job due at `R` may fire only once every schedule record written
//! before `R` has been read, so that a cancel, reschedule or replace
//! waiting in the partition (after a restart, a take-over, or while ingest
//! lags) takes effect first. A record counts as read once ingest holds back
//! the job it names until its change is applied (see the window's
//! `changing`), so firing does not wait for the batch to be persisted. For
//! each partition this module keeps `until`: every record written before
//! that instant is read. Two signals move it:
//!
//! - **Probes** (exact): the scheduler notes the time `t`, asks the broker
//!   for the partition's end offset `e` (every record acknowledged before `t`
//!   sits below `e`), and once ingest has read every record below `e`,
//!   `until` moves to `t`. A probe is asked for only while due jobs wait.
//! - **Record timestamps** (fast): a record the broker appended at `c` (the
//!   schedule topic's `message.timestamp.type=LogAppendTime`) was appended
//!   after every record acknowledged before `c`; once it is read, `until`
//!   moves to `c - max_clock_skew` (the broker's clock against this
//!   scheduler's). This keeps a backlog firing while ingest works through
//!   it. A producer's own time (CreateTime) is never used: any producer can
//!   set it, and one record stamped ahead would let due jobs fire before
//!   cancels not yet read.
//!
//! The state is a few numbers per owned partition; nothing per job.

use std::collections::VecDeque;

use crate::hash::HashMap;

/// Most answered probes kept per partition while ingest catches up with
/// them; when full, the newest replaces the last one kept. Probes follow
/// each other about every millisecond while jobs wait, and ingest reaches
/// their ends a fetch at a time: each probe dropped is a job that waits for
/// a later fetch.
const MOST_PROBES_WAITING: usize = 16;

/// One probe: started at `at_ms`, when the partition ended at `end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Probe {
    at_ms: i64,
    end: i64,
}

/// One owned partition.
#[derive(Debug)]
struct Part {
    /// Every record below this offset is read.
    next: i64,
    /// Records below this offset were handled before (and their offsets not
    /// committed): reading them again changes nothing.
    skip_below: i64,
    /// Every record written before this instant (ms) is read.
    until_ms: i64,
    /// Probes answered, waiting for ingest to reach their end (oldest first,
    /// ends rising, at most [`MOST_PROBES_WAITING`]).
    answered: VecDeque<Probe>,
    /// Start of the newest probe asked for (in flight or answered).
    asked_ms: Option<i64>,
    /// Due jobs up to this run-at wait for a probe not yet asked.
    wanted_ms: Option<i64>,
}

/// How far ingest has read a partition ([`CaughtUp::progress`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The next offset ingest reads.
    pub read_to: i64,
    /// The end offset of the newest probe not reached yet.
    pub probed_end: Option<i64>,
}

/// Per owned schedule partition, how far it has been read (see the module doc).
#[derive(Debug)]
pub struct CaughtUp {
    parts: HashMap<i32, Part>,
    skew_ms: i64,
}

impl CaughtUp {
    /// Nothing owned; record timestamps are trusted up to `skew_ms`.
    pub fn new(skew_ms: i64) -> Self {
        CaughtUp {
            parts: HashMap::default(),
            skew_ms: skew_ms.max(0),
        }
    }

    /// `partition` is now owned: ingest reads it from `next`; records below
    /// `skip_below` were handled already.
    pub fn assign(&mut self, partition: i32, next: i64, skip_below: i64) {
        self.parts.insert(
            partition,
            Part {
                next: next.max(skip_below),
                skip_below,
                until_ms: i64::MIN,
                answered: VecDeque::new(),
                asked_ms: None,
                wanted_ms: None,
            },
        );
    }

    /// `partition` is no longer owned.
    pub fn revoke(&mut self, partition: i32) {
        self.parts.remove(&partition);
    }

    /// Per owned partition, the offset below which records were handled
    /// before (reading them again changes nothing).
    pub fn handled_below(&self) -> HashMap<i32, i64> {
        self.parts.iter().map(|(k, p)| (*k, p.skip_below)).collect()
    }

    /// Every record of `partition` below `next` is read; the latest
    /// creation time among them is `created_ms`. Returns whether `until` moved.
    pub fn ingested(&mut self, partition: i32, next: i64, created_ms: Option<i64>) -> bool {
        let skew = self.skew_ms;
        let Some(p) = self.parts.get_mut(&partition) else {
            return false;
        };
        p.next = p.next.max(next);
        let before = p.until_ms;
        if let Some(c) = created_ms {
            p.until_ms = p.until_ms.max(c.saturating_sub(skew));
        }
        while let Some(probe) = p.answered.front().copied() {
            if p.next < probe.end {
                break;
            }
            p.until_ms = p.until_ms.max(probe.at_ms);
            p.answered.pop_front();
        }
        p.until_ms > before
    }

    /// A probe of `partition` started at `at_ms` found its end at `end`.
    /// Returns whether `until` moved.
    pub fn probed(&mut self, partition: i32, at_ms: i64, end: i64) -> bool {
        let Some(p) = self.parts.get_mut(&partition) else {
            return false;
        };
        if p.next >= end {
            let moved = at_ms > p.until_ms;
            p.until_ms = p.until_ms.max(at_ms);
            // Older probes have lower ends: they are met too.
            p.answered.retain(|q| q.end > p.next);
            return moved;
        }
        match p.answered.back_mut() {
            // Nothing written since: the newer probe says more.
            Some(last) if last.end >= end => last.at_ms = last.at_ms.max(at_ms),
            _ => {
                if p.answered.len() >= MOST_PROBES_WAITING {
                    p.answered.pop_back();
                }
                p.answered.push_back(Probe { at_ms, end });
            }
        }
        false
    }

    /// A probe asked for `partitions` could not be answered: ask again.
    pub fn probe_failed(&mut self, partitions: &[i32], at_ms: i64) {
        for p in partitions {
            if let Some(part) = self.parts.get_mut(p) {
                if part.asked_ms == Some(at_ms) {
                    part.asked_ms = None;
                }
                part.wanted_ms = Some(part.wanted_ms.unwrap_or(at_ms).max(at_ms));
            }
        }
    }

    #[cfg(test)]
    /// Until when `partition`'s jobs may fire (`i64::MIN` when not owned).
    pub fn until_ms(&self, partition: i32) -> i64 {
        self.parts.get(&partition).map_or(i64::MIN, |p| p.until_ms)
    }

    /// Every owned partition's `until`.
    pub fn snapshot(&self) -> HashMap<i32, i64> {
        self.parts.iter().map(|(k, p)| (*k, p.until_ms)).collect()
    }

    /// Jobs of `partition` due at `due_ms` wait for it to catch up. Returns
    /// whether a new probe is needed (none asked since `due_ms`).
    pub fn want(&mut self, partition: i32, due_ms: i64) -> bool {
        let Some(p) = self.parts.get_mut(&partition) else {
            return false;
        };
        if p.until_ms >= due_ms || p.asked_ms.is_some_and(|a| a >= due_ms) {
            return false;
        }
        p.wanted_ms = Some(p.wanted_ms.map_or(due_ms, |w| w.max(due_ms)));
        true
    }

    /// Take the partitions waiting for a probe that starts at `now_ms`.
    pub fn take_wanted(&mut self, now_ms: i64) -> Vec<i32> {
        let mut out: Vec<i32> = self
            .parts
            .iter_mut()
            .filter_map(|(k, p)| {
                p.wanted_ms.take()?;
                p.asked_ms = Some(now_ms);
                Some(*k)
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Where ingest stands in `partition` and the end of its newest probe
    /// not yet reached, for logs.
    pub fn progress(&self, partition: i32) -> Option<Progress> {
        self.parts.get(&partition).map(|p| Progress {
            read_to: p.next,
            probed_end: p.answered.back().map(|q| q.end),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_counts_once_ingest_reaches_its_end() {
        let mut c = CaughtUp::new(0);
        c.assign(0, 10, 0);
        assert_eq!(c.until_ms(0), i64::MIN, "nothing known at first");
        assert!(c.want(0, 1_000));
        assert!(!c.want(1, 1_000), "not owned");
        assert_eq!(c.take_wanted(1_500), vec![0]);
        assert!(!c.want(0, 1_000), "a probe started after 1000 is in flight");
        assert!(!c.probed(0, 1_500, 14), "ingest is at 10, the end at 14");
        assert_eq!(c.until_ms(0), i64::MIN);
        assert!(!c.ingested(0, 12, None));
        assert!(c.ingested(0, 14, None), "end reached");
        assert_eq!(c.until_ms(0), 1_500);
    }

    #[test]
    fn a_probe_at_the_end_counts_at_once_and_until_never_goes_back() {
        let mut c = CaughtUp::new(0);
        c.assign(3, 7, 0);
        assert!(c.probed(3, 2_000, 7));
        assert!(!c.probed(3, 1_000, 7), "an older probe changes nothing");
        assert_eq!(c.until_ms(3), 2_000);
        assert!(!c.want(3, 2_000), "already caught up to 2000");
        assert!(c.want(3, 2_001));
    }

    #[test]
    fn record_times_move_until_less_the_allowed_skew() {
        let mut c = CaughtUp::new(100);
        c.assign(0, 0, 0);
        assert!(c.ingested(0, 5, Some(10_000)));
        assert_eq!(c.until_ms(0), 9_900);
        assert!(!c.ingested(0, 6, Some(9_000)), "an older time changes nothing");
        assert_eq!(c.until_ms(0), 9_900);
    }

    #[test]
    fn every_unmet_probe_counts_in_its_turn_up_to_the_most_kept() {
        let mut c = CaughtUp::new(0);
        c.assign(0, 0, 0);
        c.probed(0, 100, 10);
        c.probed(0, 200, 20);
        c.probed(0, 300, 30);
        c.ingested(0, 10, None);
        assert_eq!(c.until_ms(0), 100);
        c.ingested(0, 25, None);
        assert_eq!(c.until_ms(0), 200, "the probe ending at 20 is met");
        c.ingested(0, 30, None);
        assert_eq!(c.until_ms(0), 300);

        // A probe finding the same end replaces the one before it.
        c.probed(0, 400, 40);
        c.probed(0, 450, 40);
        c.ingested(0, 40, None);
        assert_eq!(c.until_ms(0), 450);

        // Past the most kept, the newest takes the last place.
        let n = MOST_PROBES_WAITING as i64;
        for i in 1..=n + 5 {
            c.probed(0, 1_000 + i, 100 + i);
        }
        c.ingested(0, 100 + n - 1, None);
        assert_eq!(c.until_ms(0), 1_000 + n - 1, "the first n - 1 are kept");
        c.ingested(0, 100 + n, None);
        assert_eq!(c.until_ms(0), 1_000 + n - 1, "the n-th was replaced");
        c.ingested(0, 100 + n + 5, None);
        assert_eq!(c.until_ms(0), 1_000 + n + 5);
    }

    #[test]
    fn records_handled_before_are_skipped_and_count_as_read() {
        let mut c = CaughtUp::new(0);
        c.assign(0, 4, 9);
        assert_eq!(c.handled_below(), [(0, 9)].into_iter().collect());
        assert!(c.probed(0, 50, 9), "everything below 9 is handled");
        c.revoke(0);
        assert!(c.handled_below().is_empty());
        assert_eq!(c.until_ms(0), i64::MIN);
    }

    #[test]
    fn a_failed_probe_is_asked_again() {
        let mut c = CaughtUp::new(0);
        c.assign(0, 0, 0);
        assert!(c.want(0, 10));
        assert_eq!(c.take_wanted(20), vec![0]);
        assert!(c.take_wanted(21).is_empty());
        c.probe_failed(&[0], 20);
        assert_eq!(c.take_wanted(30), vec![0]);
    }
}
