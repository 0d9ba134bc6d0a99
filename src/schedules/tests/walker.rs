//! Property test: the next-occurrence function against a brute-force walk
//! of every minute, across daylight-saving changes of the zone database
//! (New York's 2025 spring-forward and fall-back, Lord Howe's 30-minute
//! shifts, São Paulo's missing midnight of 2018-11-04, Berlin). The walker
//! knows nothing of croner: it reads each minute's wall time from
//! chrono-tz and applies the rules docs/recurring-schedules.md states.

use std::str::FromStr as _;

use chrono::{DateTime, Datelike as _, LocalResult, NaiveDateTime, TimeZone as _, Timelike as _, Utc};
use proptest::prelude::*;

use super::super::{JobTemplate, Schedule};

/// A cron pattern as sets (second always 0): each field a list of values,
/// or every value.
#[derive(Clone, Debug)]
struct Pattern {
    minutes: Vec<u32>,
    hours: Vec<u32>,
    /// `None`: every day of the month.
    days: Option<Vec<u32>>,
    /// `None`: every day of the week (0 = Sunday).
    weekdays: Option<Vec<u32>>,
    /// A single minute and a single hour: runs once in a repeated hour and
    /// after a skipped one; otherwise each real instant counts.
    fixed: bool,
}

impl Pattern {
    fn cron(&self) -> String {
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let opt = |v: &Option<Vec<u32>>| v.as_deref().map_or("*".to_string(), list);
        format!(
            "0 {} {} {} * {}",
            list(&self.minutes),
            list(&self.hours),
            opt(&self.days),
            opt(&self.weekdays)
        )
    }

    fn time_matches(&self, w: &NaiveDateTime) -> bool {
        self.minutes.contains(&w.minute()) && self.hours.contains(&w.hour())
    }

    fn date_matches(&self, w: &NaiveDateTime) -> bool {
        self.days.as_ref().is_none_or(|d| d.contains(&w.day()))
            && self
                .weekdays
                .as_ref()
                .is_none_or(|d| d.contains(&w.weekday().num_days_from_sunday()))
    }
}

fn pattern() -> impl Strategy<Value = Pattern> {
    let values =
        |max: u32| prop::collection::btree_set(0..max, 1..4).prop_map(|s| s.into_iter().collect::<Vec<_>>());
    let hours = prop_oneof![
        (0u32..4).prop_map(|h| vec![h]),   // around the changes (they happen at night)
        (22u32..24).prop_map(|h| vec![h]), // São Paulo's changes are at midnight
        values(24),
        Just((0..24).collect::<Vec<_>>()),
    ];
    let minutes = prop_oneof![
        prop::sample::select(vec![0u32, 15, 30, 45]).prop_map(|m| vec![m]),
        values(60),
        Just((0..60).step_by(15).collect::<Vec<_>>()),
    ];
    let days = prop_oneof![3 => Just(None), 1 => values(28).prop_map(|d| Some(d.into_iter().map(|x| x + 1).collect()))];
    let weekdays = prop_oneof![3 => Just(None), 1 => values(7).prop_map(Some)];
    (minutes, hours, days, weekdays).prop_map(|(minutes, hours, days, weekdays)| {
        // Day of month and day of week both restricted means either one in
        // cron; keep one of them.
        let weekdays = if days.is_some() { None } else { weekdays };
        let fixed = minutes.len() == 1 && hours.len() == 1;
        Pattern {
            minutes,
            hours,
            days,
            weekdays,
            fixed,
        }
    })
}

/// Every occurrence in `(from, to]` by walking each UTC minute.
fn walk(p: &Pattern, tz: chrono_tz::Tz, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let mut out = Vec::new();
    let mut u = from + chrono::Duration::minutes(1);
    while u <= to {
        let wall = u.with_timezone(&tz).naive_local();
        let before = (u - chrono::Duration::minutes(1))
            .with_timezone(&tz)
            .naive_local();
        let mut at_u = false;
        if p.time_matches(&wall) && p.date_matches(&wall) {
            at_u = match tz.from_local_datetime(&wall) {
                // A repeated wall time: a fixed-time pattern runs at the first.
                LocalResult::Ambiguous(first, _) => !p.fixed || first.with_timezone(&Utc) == u,
                _ => true,
            };
        }
        // The first instant after skipped wall times: a fixed-time pattern
        // whose time was skipped runs here (if the day still matches).
        let skipped = wall - before > chrono::Duration::minutes(1);
        if skipped && p.fixed && p.date_matches(&wall) {
            let mut w = before + chrono::Duration::minutes(1);
            while w < wall {
                if p.time_matches(&w) {
                    at_u = true;
                }
                w += chrono::Duration::minutes(1);
            }
        }
        if at_u {
            out.push(u);
        }
        u += chrono::Duration::minutes(1);
    }
    out
}

/// Every occurrence in `(from, to]` by the recurrence under test.
fn next_all(p: &Pattern, zone: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<DateTime<Utc>> {
    let mut s = Schedule::cron("w", p.cron(), JobTemplate::new("jobs", "go"));
    s.time_zone = zone.into();
    let r = s.compile().unwrap();
    let mut out = Vec::new();
    let mut t = from;
    while let Some(n) = r.next_after(t).filter(|n| *n <= to) {
        out.push(n);
        t = n;
    }
    out
}

/// (zone, a UTC time a day before one of its changes).
const CHANGES: &[(&str, &str)] = &[
    ("America/New_York", "2025-03-08T00:00:00Z"),
    ("America/New_York", "2025-11-01T00:00:00Z"),
    ("Australia/Lord_Howe", "2025-04-04T12:00:00Z"),
    ("Australia/Lord_Howe", "2025-10-03T12:00:00Z"),
    ("America/Sao_Paulo", "2018-11-03T00:00:00Z"),
    ("America/Sao_Paulo", "2019-02-16T00:00:00Z"),
    ("Europe/Berlin", "2025-03-29T00:00:00Z"),
    ("Europe/Berlin", "2025-10-25T00:00:00Z"),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn next_occurrences_match_a_walk_of_every_minute_across_daylight_saving_changes(
        p in pattern(),
        change in 0..CHANGES.len(),
    ) {
        let (zone, start) = CHANGES[change];
        let tz = chrono_tz::Tz::from_str(zone).unwrap();
        let from: DateTime<Utc> = start.parse().unwrap();
        let to = from + chrono::Duration::days(3);
        let walked = walk(&p, tz, from, to);
        let found = next_all(&p, zone, from, to);
        prop_assert_eq!(found, walked, "pattern `{}` in {}", p.cron(), zone);
    }
}

#[test]
fn the_walker_sees_the_changes_it_is_meant_to() {
    // São Paulo, 2018-11-04: midnight does not exist; a daily job at
    // midnight runs at 01:00 local (03:00 UTC).
    let midnight = Pattern {
        minutes: vec![0],
        hours: vec![0],
        days: None,
        weekdays: None,
        fixed: true,
    };
    let tz = chrono_tz::America::Sao_Paulo;
    let from: DateTime<Utc> = "2018-11-03T12:00:00Z".parse().unwrap();
    let to = from + chrono::Duration::days(1);
    let want: DateTime<Utc> = "2018-11-04T03:00:00Z".parse().unwrap();
    assert_eq!(walk(&midnight, tz, from, to), [want]);
    assert_eq!(next_all(&midnight, "America/Sao_Paulo", from, to), [want]);
    // Lord Howe, 2025-10-05: 02:00 becomes 02:30; a job at 02:15 runs at
    // 02:30 local (15:30 UTC the day before).
    let quarter = Pattern {
        minutes: vec![15],
        hours: vec![2],
        ..midnight
    };
    let from: DateTime<Utc> = "2025-10-04T00:00:00Z".parse().unwrap();
    let to = from + chrono::Duration::days(1);
    let want: DateTime<Utc> = "2025-10-04T15:30:00Z".parse().unwrap();
    assert_eq!(walk(&quarter, chrono_tz::Australia::Lord_Howe, from, to), [want]);
    assert_eq!(next_all(&quarter, "Australia/Lord_Howe", from, to), [want]);
}
