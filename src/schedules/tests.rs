//! Recurrences, daylight-saving changes, plans and definitions: pure logic,
//! no broker.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::*;

mod walker;

fn t(s: &str) -> DateTime<Utc> {
    s.parse().unwrap()
}

fn cron_in(pattern: &str, zone: &str) -> Recurrence {
    let mut s = Schedule::cron("s", pattern, JobTemplate::new("jobs", "go"));
    s.time_zone = zone.into();
    s.compile().unwrap()
}

fn occurrences(r: &Recurrence, after: &str, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut at = t(after);
    for _ in 0..n {
        at = r.next_after(at).unwrap();
        out.push(at.to_rfc3339());
    }
    out
}

#[test]
fn a_fixed_time_skipped_by_spring_forward_occurs_at_the_first_instant_after_the_gap() {
    // New York, 8 March 2026: 02:00 EST becomes 03:00 EDT.
    let r = cron_in("30 2 * * *", "America/New_York");
    assert_eq!(
        occurrences(&r, "2026-03-07T12:00:00Z", 3),
        [
            "2026-03-08T07:00:00+00:00", // 03:00 EDT, the gap's end
            "2026-03-09T06:30:00+00:00", // 02:30 EDT
            "2026-03-10T06:30:00+00:00",
        ]
    );
}

#[test]
fn a_fixed_time_repeated_by_fall_back_occurs_once() {
    // New York, 1 November 2026: 01:00-02:00 happens twice (EDT, then EST).
    let r = cron_in("30 1 * * *", "America/New_York");
    assert_eq!(
        occurrences(&r, "2026-10-31T12:00:00Z", 3),
        [
            "2026-11-01T05:30:00+00:00", // 01:30 EDT, the first one
            "2026-11-02T06:30:00+00:00", // 01:30 EST the next day
            "2026-11-03T06:30:00+00:00",
        ]
    );
}

#[test]
fn an_hourly_pattern_counts_each_real_hour_through_fall_back() {
    let r = cron_in("0 * * * *", "America/New_York");
    assert_eq!(
        occurrences(&r, "2026-11-01T03:30:00Z", 4),
        [
            "2026-11-01T04:00:00+00:00", // 00:00 EDT
            "2026-11-01T05:00:00+00:00", // 01:00 EDT
            "2026-11-01T06:00:00+00:00", // 01:00 EST
            "2026-11-01T07:00:00+00:00", // 02:00 EST
        ]
    );
}

#[test]
fn cron_patterns_take_seconds_and_the_last_day_of_the_month() {
    let every_ten = cron_in("*/10 * * * * *", "UTC");
    assert_eq!(
        occurrences(&every_ten, "2026-01-01T00:00:05Z", 2),
        ["2026-01-01T00:00:10+00:00", "2026-01-01T00:00:20+00:00"]
    );
    let last_day = cron_in("0 0 9 L * *", "Europe/Berlin");
    assert_eq!(
        occurrences(&last_day, "2026-02-01T00:00:00Z", 2),
        ["2026-02-28T08:00:00+00:00", "2026-03-31T07:00:00+00:00"]
    );
}

#[test]
fn an_interval_counts_real_time_from_its_start_and_stops_at_its_end() {
    let mut s = Schedule::every("s", Duration::from_secs(90 * 60), JobTemplate::new("jobs", "go"));
    s.time_zone = "America/New_York".into();
    s.start = Some(t("2026-11-01T04:15:00Z"));
    s.end = Some(t("2026-11-01T08:00:00Z"));
    let r = s.compile().unwrap();
    // Before the start: the start itself.
    assert_eq!(
        r.next_after(t("2026-10-01T00:00:00Z")),
        Some(t("2026-11-01T04:15:00Z"))
    );
    assert_eq!(
        occurrences(&r, "2026-11-01T04:15:00Z", 2),
        ["2026-11-01T05:45:00+00:00", "2026-11-01T07:15:00+00:00"]
    );
    assert_eq!(r.next_after(t("2026-11-01T07:15:00Z")), None, "past the end");
    assert_eq!(
        r.count_between(t("2026-11-01T04:00:00Z"), t("2026-11-01T07:15:00Z"), 100),
        3
    );
}

fn hourly(misfire: Misfire) -> (Schedule, Recurrence) {
    let mut s = Schedule::cron("h", "0 * * * *", JobTemplate::new("jobs", "go"));
    s.misfire = misfire;
    s.catch_up = Duration::from_secs(5 * 3600);
    s.max_catch_up = 2;
    let r = s.compile().unwrap();
    (s, r)
}

fn plan_at(s: &Schedule, r: &Recurrence, after: &str, now: &str) -> Plan {
    plan(PlanInput {
        schedule: s,
        recurrence: r,
        after: t(after),
        now: t(now),
        lead: Duration::from_secs(2),
        late_after: Duration::from_secs(30),
    })
}

#[test]
fn missed_occurrences_follow_the_misfire_policy_within_the_catch_up_window() {
    // Down from 00:30 to 10:20: 10 hourly occurrences missed, 5 of them
    // (06:00..10:00) within the 5 h window.
    for (policy, enqueued, dropped) in [
        (Misfire::All, vec!["09:00", "10:00"], 8),
        (Misfire::Latest, vec!["10:00"], 9),
        (Misfire::None, vec![], 10),
    ] {
        let (s, r) = hourly(policy);
        let p = plan_at(&s, &r, "2026-05-01T00:30:00Z", "2026-05-01T10:20:00Z");
        let got: Vec<String> = p.enqueue.iter().map(|t| t.format("%H:%M").to_string()).collect();
        assert_eq!(got, enqueued, "{policy:?}");
        assert_eq!(p.dropped, dropped, "{policy:?}");
        assert_eq!(p.late, enqueued.len() as u64, "{policy:?}");
        assert_eq!(p.cursor, Some(t("2026-05-01T10:00:00Z")), "{policy:?}");
        assert_eq!(p.next, Some(t("2026-05-01T11:00:00Z")), "{policy:?}");
    }
}

#[test]
fn an_occurrence_within_the_lead_is_enqueued_on_time_and_nothing_before_it() {
    let (s, r) = hourly(Misfire::All);
    let p = plan_at(&s, &r, "2026-05-01T10:00:00Z", "2026-05-01T10:59:59Z");
    assert_eq!(p.enqueue, [t("2026-05-01T11:00:00Z")]);
    assert_eq!((p.late, p.dropped), (0, 0));
    let early = plan_at(&s, &r, "2026-05-01T10:00:00Z", "2026-05-01T10:59:57Z");
    assert_eq!(
        early,
        Plan {
            next: Some(t("2026-05-01T11:00:00Z")),
            ..Plan::default()
        }
    );
}

#[test]
fn a_late_occurrence_within_the_misfire_threshold_is_not_missed() {
    let (s, r) = hourly(Misfire::None);
    let p = plan_at(&s, &r, "2026-05-01T10:00:00Z", "2026-05-01T11:00:20Z");
    assert_eq!(p.enqueue, [t("2026-05-01T11:00:00Z")]);
    assert_eq!((p.late, p.dropped), (0, 0));
}

#[test]
fn a_long_outage_is_counted_without_enqueuing_beyond_the_window() {
    let mut s = Schedule::cron("sec", "* * * * * *", JobTemplate::new("jobs", "go"));
    s.misfire = Misfire::All;
    s.catch_up = Duration::from_secs(60);
    s.max_catch_up = 1000;
    let r = s.compile().unwrap();
    let p = plan_at(&s, &r, "2026-05-01T00:00:00Z", "2026-05-01T01:00:00Z");
    // 3,600 s down: 3,540 up to 00:59:00 beyond the window; 00:59:01 to
    // 00:59:29 missed (older than 30 s) but within it, enqueued late;
    // 00:59:30 to 01:00:00 and the 2 s of lead on time.
    assert_eq!(p.dropped, 3540);
    assert_eq!(p.late, 29);
    assert_eq!(p.enqueue.len(), 29 + 31 + 2);
    assert_eq!(p.cursor, Some(t("2026-05-01T01:00:02Z")));
}

#[test]
fn an_occurrence_id_is_the_same_for_the_same_occurrence_only() {
    let a = occurrence_id("nightly", t("2026-05-01T02:30:00Z"));
    assert_eq!(a, occurrence_id("nightly", t("2026-05-01T02:30:00Z")));
    assert_ne!(a, occurrence_id("nightly", t("2026-05-02T02:30:00Z")));
    assert_ne!(a, occurrence_id("weekly", t("2026-05-01T02:30:00Z")));
    // uuid5(namespace, "nightly@<ms>"), computable by any client.
    let name = format!("nightly@{}", t("2026-05-01T02:30:00Z").timestamp_millis());
    assert_eq!(
        a.uuid(),
        uuid::Uuid::new_v5(&OCCURRENCE_NAMESPACE, name.as_bytes())
    );
}

#[test]
fn an_occurrence_job_carries_the_template_and_a_stable_jitter() {
    let mut job = JobTemplate::new("jobs", "report");
    job.tenant = Some("acme".into());
    job.headers.insert("source".into(), "cron".into());
    let mut s = Schedule::cron("nightly", "0 0 2 * * *", job);
    s.jitter = Duration::from_secs(60);
    let nominal = t("2026-05-01T02:00:00Z");
    let j = occurrence_job(&s, nominal);
    assert_eq!(
        (j.topic.as_str(), &j.key[..], &j.payload[..]),
        ("jobs", &b"nightly"[..], &b"report"[..])
    );
    assert_eq!(j.tenant.as_deref(), Some("acme"));
    assert_eq!(j.headers, vec![("source".to_string(), Some(b"cron".to_vec()))]);
    assert!(j.run_at >= nominal && j.run_at < nominal + chrono::Duration::seconds(60));
    assert_eq!(
        j.run_at,
        occurrence_job(&s, nominal).run_at,
        "same delay every time"
    );
    assert!(!j.skip_if_busy, "queued by default");
    s.overlap = Overlap::Skip;
    let skipping = occurrence_job(&s, nominal);
    assert_eq!(
        (&skipping.key[..], skipping.skip_if_busy),
        (&b"nightly"[..], true)
    );
    s.overlap = Overlap::Parallel;
    let k = String::from_utf8(occurrence_job(&s, nominal).key).unwrap();
    assert_eq!(k, format!("nightly@{}", nominal.timestamp_millis()));
}

#[test]
fn definitions_round_trip_and_bad_ones_say_why() {
    let json = br#"{"id":"nightly","cron":"0 30 2 * * *","time_zone":"Europe/Berlin",
        "misfire":"all","catch_up":"6h","job":{"topic":"jobs","payload":"go"}}"#;
    let (s, _) = Schedule::from_json(json).unwrap();
    assert_eq!(s.misfire, Misfire::All);
    assert_eq!(s.catch_up, Duration::from_secs(6 * 3600));
    let (again, _) = Schedule::from_json(&s.to_json()).unwrap();
    assert_eq!(again, s);
    assert_eq!(again.version(), s.version());
    let mut paused = s.clone();
    paused.paused = true;
    assert_ne!(paused.version(), s.version());

    let bad = |json: &str| Schedule::from_json(json.as_bytes()).unwrap_err().to_string();
    assert!(
        bad(r#"{"id":"x","cron":"0 * * * *","every":"1m","job":{"topic":"j","payload":"p"}}"#)
            .contains("exactly one")
    );
    assert!(
        bad(r#"{"id":"x","cron":"61 * * * *","job":{"topic":"j","payload":"p"}}"#).contains("cron pattern")
    );
    assert!(bad(
        r#"{"id":"x","cron":"0 * * * *","time_zone":"Mars/Olympus","job":{"topic":"j","payload":"p"}}"#
    )
    .contains("unknown time zone"));
    assert!(bad(r#"{"id":"x","every":"100ms","job":{"topic":"j","payload":"p"}}"#).contains("at least 1s"));
    assert!(
        bad(r#"{"id":"x","every":"1m","job":{"topic":"j","payload":"p"},"cronn":"x"}"#)
            .contains("unknown field")
    );
    assert!(bad(r#"{"id":"","every":"1m","job":{"topic":"j","payload":"p"}}"#).contains("schedule id"));
    assert!(
        bad(r#"{"id":"x","every":"1m","job":{"topic":"j","payload":"p","headers":{"kairos-id":"1"}}}"#)
            .contains("Kairos's own")
    );
    assert!(bad("not json").contains("not a schedule definition"));
    assert!(bad(r#"{"id":"x","every":"1m","job":{"topic":"j"}}"#).contains("missing field `payload`"));
    assert!(bad(r#"{"id":"x","every":"1m","job":{"topic":"j","payload":""}}"#).contains("payload"));
}

#[test]
fn the_documented_definition_is_a_valid_one() {
    let section = include_str!("../../docs/recurring-schedules.md");
    let start = section.find("```json\n").expect("a JSON block") + 8;
    let end = start + section[start..].find("```").expect("its end");
    let (s, _) = Schedule::from_json(&section.as_bytes()[start..end]).unwrap();
    assert_eq!(
        (s.id.as_str(), s.time_zone.as_str()),
        ("nightly-report", "Europe/Berlin")
    );
}

#[test]
fn a_backfill_takes_what_its_range_holds_less_what_was_backfilled_before() {
    let (_, r) = hourly(Misfire::None);
    let h = |x: u32| t(&format!("2026-05-01T{x:02}:00:00Z"));
    let ms = |x: u32| h(x).timestamp_millis();
    let (all, range) = backfill(&r, h(2), h(5), &[], 100);
    assert_eq!((all, range), (vec![h(2), h(3), h(4), h(5)], [ms(2), ms(5)]));
    let (rest, _) = backfill(&r, h(2), h(5), &[[ms(3), ms(4)]], 100);
    assert_eq!(rest, [h(2), h(5)]);
    let (again, _) = backfill(&r, h(2), h(5), &[[ms(1), ms(6)]], 100);
    assert!(again.is_empty(), "the same range twice: nothing");
    // Cut short: the range covered ends at the last occurrence taken.
    let (two, cut) = backfill(&r, h(2), h(5), &[], 2);
    assert_eq!((two, cut), (vec![h(2), h(3)], [ms(2), ms(3)]));
}

#[test]
fn cursors_merge_their_backfilled_ranges_and_keep_the_later_last_occurrence() {
    let a = Cursor {
        last_ms: Some(10),
        backfilled: vec![[0, 5], [20, 30]],
        late: 3,
        dropped: 0,
    };
    let b = Cursor {
        last_ms: Some(7),
        backfilled: vec![[6, 8], [25, 40], [50, 60]],
        late: 1,
        dropped: 2,
    };
    let m = a.merged(&b);
    assert_eq!(m.last_ms, Some(10));
    assert_eq!(m.backfilled, vec![[0, 8], [20, 40], [50, 60]]);
    assert_eq!((m.late, m.dropped), (3, 2), "counts only grow");
    assert_eq!(decode_cursor(&serde_json::to_vec(&m).unwrap()), Some(m));
}

#[test]
fn the_occurrence_before_a_time_respects_start_and_end() {
    let mut s = Schedule::every("s", Duration::from_secs(600), JobTemplate::new("jobs", "go"));
    s.start = Some(t("2026-05-01T00:05:00Z"));
    s.end = Some(t("2026-05-01T01:00:00Z"));
    let r = s.compile().unwrap();
    assert_eq!(
        r.prev_before(t("2026-05-01T00:25:00Z")),
        Some(t("2026-05-01T00:15:00Z"))
    );
    assert_eq!(
        r.prev_before(t("2026-05-01T00:25:00.001Z")),
        Some(t("2026-05-01T00:25:00Z"))
    );
    assert_eq!(
        r.prev_before(t("2026-05-01T09:00:00Z")),
        Some(t("2026-05-01T00:55:00Z")),
        "the end"
    );
    assert_eq!(r.prev_before(t("2026-05-01T00:05:00Z")), None, "the start");
    let c = cron_in("30 1 * * *", "America/New_York");
    assert_eq!(
        c.prev_before(t("2026-11-02T06:30:00Z")),
        Some(t("2026-11-01T05:30:00Z"))
    );
}

#[test]
fn durations_and_sizes_beyond_their_bounds_are_refused() {
    let bad = |json: &str| Schedule::from_json(json.as_bytes()).unwrap_err().to_string();
    let job = r#""job":{"topic":"j","payload":"p"}"#;
    assert!(bad(&format!(
        r#"{{"id":"x","every":"1m","catch_up":"300000y",{job}}}"#
    ))
    .contains("catch_up"));
    assert!(bad(&format!(r#"{{"id":"x","every":"1m","jitter":"2d",{job}}}"#)).contains("jitter"));
    assert!(bad(&format!(r#"{{"id":"x","every":"1m","max_catch_up":5000,{job}}}"#)).contains("max_catch_up"));
    let big = "p".repeat(MAX_PAYLOAD_BYTES + 1);
    assert!(bad(&format!(
        r#"{{"id":"x","every":"1m","job":{{"topic":"j","payload":"{big}"}}}}"#
    ))
    .contains("payload"));
}

#[test]
fn a_thirty_day_outage_is_capped_and_counted() {
    let mut s = Schedule::cron("m", "0 * * * * *", JobTemplate::new("jobs", "go"));
    s.misfire = Misfire::All;
    s.catch_up = Duration::from_secs(40 * 24 * 3600);
    s.max_catch_up = 1000;
    let r = s.compile().unwrap();
    let p = plan_at(&s, &r, "2026-05-01T00:00:00Z", "2026-05-31T00:00:00Z");
    // 43,199 minutes missed (the 43,200th, at the end, is on time): the
    // latest 1,000 run, the rest are counted.
    assert_eq!((p.late, p.dropped), (1000, 43_199 - 1000));
    assert_eq!(p.enqueue.len(), 1001);
    assert_eq!(p.enqueue.first(), Some(&t("2026-05-30T07:20:00Z")));
    assert_eq!(p.cursor, Some(t("2026-05-31T00:00:00Z")));
}
