//! Which occurrences of a schedule to enqueue now, and which were missed
//! beyond its misfire policy (pure: no clock, no Kafka).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{Misfire, Recurrence, Schedule};

/// The most occurrences one plan looks at one by one (beyond the catch-up
/// window they are only counted, up to the same number).
const MOST_LOOKED_AT: u64 = 100_000;

/// What a plan starts from.
#[derive(Clone, Copy, Debug)]
pub struct PlanInput<'a> {
    /// The definition (misfire policy, catch-up window).
    pub schedule: &'a Schedule,
    /// Its occurrences.
    pub recurrence: &'a Recurrence,
    /// Occurrences at or before this time were handled (the cursor).
    pub after: DateTime<Utc>,
    /// The scheduler's time.
    pub now: DateTime<Utc>,
    /// Occurrences due up to this long after `now` are enqueued now.
    pub lead: Duration,
    /// An occurrence not enqueued within this long after its time was missed.
    pub late_after: Duration,
}

/// The plan: what to enqueue, what was dropped, where the cursor goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Nominal times of the occurrences to enqueue, in order.
    pub enqueue: Vec<DateTime<Utc>>,
    /// Of those, how many were missed (enqueued after `late_after`).
    pub late: u64,
    /// Missed occurrences dropped by the policy or the catch-up window (at
    /// most 100,000 are counted).
    pub dropped: u64,
    /// The new cursor: every occurrence up to it is enqueued or dropped;
    /// `None` when the plan handled none.
    pub cursor: Option<DateTime<Utc>>,
    /// The first occurrence after the cursor, if any.
    pub next: Option<DateTime<Utc>>,
}

/// Plan a schedule's occurrences up to `now + lead` (see [`Plan`]). The
/// work is bounded whatever the downtime: the missed occurrences kept are
/// found walking back from the misfire threshold, the others only counted
/// (up to 100,000).
pub fn plan(input: PlanInput<'_>) -> Plan {
    let PlanInput {
        schedule,
        recurrence,
        after,
        now,
        lead,
        late_after,
    } = input;
    let dur = |d: Duration| chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX);
    let earlier =
        |t: DateTime<Utc>, d: Duration| t.checked_sub_signed(dur(d)).unwrap_or(DateTime::<Utc>::MIN_UTC);
    let horizon = now
        .checked_add_signed(dur(lead))
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    let missed_before = earlier(now, late_after);
    let window = earlier(now, schedule.catch_up);
    let mut out = Plan::default();
    let mut from = after;
    // Beyond the catch-up window: counted, never enqueued.
    if from < window {
        let n = recurrence.count_between(from, window, MOST_LOOKED_AT);
        if n > 0 {
            out.dropped += n;
            out.cursor = Some(window);
        }
        from = window;
    }
    // Missed within the window: the latest `keep` run, the rest are counted.
    let keep = match schedule.misfire {
        Misfire::All => schedule.max_catch_up as usize,
        Misfire::Latest => 1,
        Misfire::None => 0,
    };
    if let Some(last) = recurrence.prev_before(missed_before).filter(|t| *t > from) {
        let mut kept = Vec::new();
        let mut t = missed_before;
        while kept.len() < keep {
            match recurrence.prev_before(t).filter(|p| *p > from) {
                Some(p) => {
                    kept.push(p);
                    t = p;
                }
                None => break,
            }
        }
        kept.reverse();
        let dropped_until = kept.first().map_or(Some(last), |f| {
            f.checked_sub_signed(chrono::Duration::milliseconds(1))
        });
        if let Some(until) = dropped_until.filter(|u| *u > from) {
            out.dropped += recurrence.count_between(from, until, MOST_LOOKED_AT);
        }
        out.late = kept.len() as u64;
        out.enqueue = kept;
        out.cursor = Some(last);
        from = last;
    }
    // On time: everything up to the horizon.
    let mut t = from;
    let mut looked = 0;
    while looked < MOST_LOOKED_AT {
        let Some(next) = recurrence.next_after(t).filter(|n| *n <= horizon) else {
            break;
        };
        looked += 1;
        out.enqueue.push(next);
        out.cursor = Some(next);
        t = next;
    }
    out.next = recurrence.next_after(out.cursor.unwrap_or(after).max(after));
    out
}

/// The occurrences from `from` to `to` (both included) not in `done`'s
/// ranges (epoch ms, both ends included), at most `most` of them; and the
/// range this backfill covers (up to the last occurrence looked at when
/// `most` cut it short).
pub fn backfill(
    recurrence: &Recurrence,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    done: &[[i64; 2]],
    most: usize,
) -> (Vec<DateTime<Utc>>, [i64; 2]) {
    let covered = |t: DateTime<Utc>| {
        let ms = t.timestamp_millis();
        done.iter().any(|[a, b]| *a <= ms && ms <= *b)
    };
    let mut out = Vec::new();
    let mut t = from - chrono::Duration::milliseconds(1);
    let mut end = to;
    let mut looked = 0;
    while let Some(next) = recurrence.next_after(t) {
        if next > to {
            break;
        }
        if out.len() >= most.max(1) || looked == MOST_LOOKED_AT {
            end = t;
            break;
        }
        looked += 1;
        if !covered(next) {
            out.push(next);
        }
        t = next;
    }
    (out, [from.timestamp_millis(), end.timestamp_millis()])
}
