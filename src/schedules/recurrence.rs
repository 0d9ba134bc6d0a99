//! When a schedule's occurrences are: a cron pattern read in a time zone,
//! or a fixed interval in real time, within the schedule's start and end.

use std::str::FromStr as _;

use chrono::{DateTime, TimeZone as _, Utc};
use croner::parser::{CronParser, Seconds};
use croner::Cron;

use super::{Schedule, ScheduleError};

/// A schedule's occurrences, parsed ([`Schedule::compile`]).
#[derive(Clone, Debug)]
pub struct Recurrence {
    kind: Kind,
    start: Option<DateTime<Utc>>,
    end: Option<DateTime<Utc>>,
}

#[derive(Clone, Debug)]
enum Kind {
    Cron(Box<Cron>, chrono_tz::Tz),
    Every { period_ms: i64, anchor_ms: i64 },
}

impl Recurrence {
    pub(super) fn new(s: &Schedule) -> Result<Recurrence, ScheduleError> {
        let kind = match (&s.cron, s.every) {
            (Some(pattern), None) => {
                let tz = chrono_tz::Tz::from_str(&s.time_zone)
                    .map_err(|_| ScheduleError::TimeZone(s.time_zone.clone()))?;
                let cron = CronParser::builder()
                    .seconds(Seconds::Optional)
                    .build()
                    .parse(pattern)
                    .map_err(|e| ScheduleError::Cron {
                        pattern: pattern.clone(),
                        reason: e.to_string(),
                    })?;
                Kind::Cron(Box::new(cron), tz)
            }
            (None, Some(every)) => {
                if every < std::time::Duration::from_secs(1) {
                    return Err(ScheduleError::Every);
                }
                let period_ms = i64::try_from(every.as_millis()).map_err(|_| ScheduleError::Every)?;
                let anchor_ms = s.start.map_or(0, |t| t.timestamp_millis());
                Kind::Every { period_ms, anchor_ms }
            }
            _ => return Err(ScheduleError::Recurrence),
        };
        Ok(Recurrence {
            kind,
            start: s.start,
            end: s.end,
        })
    }

    /// The first occurrence strictly after `t` (within start and end), or
    /// `None` when there is none.
    ///
    /// A cron time that a daylight-saving change skips (spring forward)
    /// occurs at the first instant after the gap; a cron time that occurs
    /// twice (fall back) occurs once, the first time, unless the pattern
    /// names every hour or finer (then each real hour counts).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        // Before the start: the first occurrence at or after it.
        let from = match self.start {
            Some(s) if t < s => s - chrono::Duration::milliseconds(1),
            _ => t,
        };
        let next = match &self.kind {
            Kind::Every { period_ms, anchor_ms } => {
                let since = from.timestamp_millis().checked_sub(*anchor_ms)?;
                let k = since.div_euclid(*period_ms).checked_add(1)?;
                at_ms(k.checked_mul(*period_ms)?.checked_add(*anchor_ms)?)?
            }
            Kind::Cron(cron, tz) => {
                let local = from.with_timezone(tz);
                cron.find_next_occurrence(&local, false).ok()?.with_timezone(&Utc)
            }
        };
        match self.end {
            Some(e) if next > e => None,
            _ => Some(next),
        }
    }

    /// The last occurrence strictly before `t` (within start and end), or
    /// `None` when there is none.
    pub fn prev_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let t = match self.end {
            Some(e) if t > e => e.checked_add_signed(chrono::Duration::milliseconds(1))?,
            _ => t,
        };
        let prev = match &self.kind {
            Kind::Every { period_ms, anchor_ms } => {
                let since = t.timestamp_millis().checked_sub(*anchor_ms)?.checked_sub(1)?;
                let k = since.div_euclid(*period_ms);
                at_ms(k.checked_mul(*period_ms)?.checked_add(*anchor_ms)?)?
            }
            Kind::Cron(cron, tz) => {
                let local = t.with_timezone(tz);
                cron.find_previous_occurrence(&local, false)
                    .ok()?
                    .with_timezone(&Utc)
            }
        };
        match self.start {
            Some(s) if prev < s => None,
            _ => Some(prev),
        }
    }

    /// How many occurrences fall in `(after, until]`, counting at most
    /// `cap` (then `cap` is returned).
    pub fn count_between(&self, after: DateTime<Utc>, until: DateTime<Utc>, cap: u64) -> u64 {
        if let Kind::Every { period_ms, anchor_ms } = &self.kind {
            if self.start.is_none_or(|s| s <= after) && self.end.is_none_or(|e| e >= until) {
                let k = |t: DateTime<Utc>| {
                    t.timestamp_millis()
                        .saturating_sub(*anchor_ms)
                        .div_euclid(*period_ms)
                };
                return u64::try_from(k(until).saturating_sub(k(after)))
                    .unwrap_or(0)
                    .min(cap);
            }
        }
        let mut n = 0;
        let mut t = after;
        while n < cap {
            match self.next_after(t) {
                Some(next) if next <= until => {
                    n += 1;
                    t = next;
                }
                _ => break,
            }
        }
        n
    }
}

fn at_ms(ms: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_millis_opt(ms).single()
}
