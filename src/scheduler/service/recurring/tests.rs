//! The recurring schedules' state on disk (a real sled tree), without a
//! broker: definitions, versions, pauses, cursors, deletes and refusals.

use super::state::{at, Defined, Kept, State};
use crate::schedules::{JobTemplate, Schedule};

fn state() -> (tempfile::TempDir, State) {
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    (
        dir,
        State::new(db.open_tree("schedules").unwrap(), Default::default()).unwrap(),
    )
}

fn every_minute(id: &str) -> Schedule {
    Schedule::cron(id, "0 * * * * *", JobTemplate::new("jobs", "go"))
}

const MIN: i64 = 60_000;

#[test]
fn a_definition_is_indexed_by_its_next_occurrence_and_the_same_one_again_changes_nothing() {
    let (_d, s) = state();
    let def = every_minute("a").to_json();
    assert_eq!(
        s.define(1, "a", Some(&def), 10 * MIN + 5).unwrap(),
        Defined::Changed
    );
    assert_eq!(s.earliest(1).unwrap(), Some(11 * MIN));
    assert_eq!(s.due(1, 11 * MIN - 1, 10).unwrap(), Vec::<String>::new());
    assert_eq!(s.due(1, 11 * MIN, 10).unwrap(), ["a"]);
    // Written again later (pods registering at start): same version, and
    // the time it was first seen stays.
    assert_eq!(
        s.define(1, "a", Some(&def), 20 * MIN).unwrap(),
        Defined::Unchanged
    );
    assert_eq!(s.kept(1, "a").unwrap().unwrap().since_ms, 10 * MIN + 5);
    assert_eq!(s.earliest(1).unwrap(), Some(11 * MIN));
    assert_eq!(s.earliest(2).unwrap(), None, "partitions apart");
}

#[test]
fn a_cursor_moves_the_index_forward_only() {
    let (_d, s) = state();
    s.define(1, "a", Some(&every_minute("a").to_json()), 10 * MIN)
        .unwrap();
    s.advance(1, "a", 13 * MIN).unwrap();
    assert_eq!(s.earliest(1).unwrap(), Some(14 * MIN));
    s.advance(1, "a", 12 * MIN).unwrap();
    assert_eq!(
        s.cursor(1, "a").unwrap(),
        Some(13 * MIN),
        "an older cursor read later"
    );
    assert_eq!(s.earliest(1).unwrap(), Some(14 * MIN));
    // A cursor read before its definition still counts.
    s.advance(1, "b", 30 * MIN).unwrap();
    s.define(1, "b", Some(&every_minute("b").to_json()), 10 * MIN)
        .unwrap();
    assert_eq!(s.due(1, 31 * MIN, 10).unwrap(), ["a", "b"]);
    let kept = s.kept(1, "b").unwrap().unwrap();
    assert_eq!(s.after(1, "b", &every_minute("b"), &kept).unwrap(), at(30 * MIN));
}

#[test]
fn a_paused_schedule_leaves_the_index_and_a_resumed_one_skips_what_it_missed() {
    let (_d, s) = state();
    let mut def = every_minute("a");
    s.define(1, "a", Some(&def.to_json()), 10 * MIN).unwrap();
    def.paused = true;
    assert_eq!(
        s.define(1, "a", Some(&def.to_json()), 12 * MIN).unwrap(),
        Defined::Changed
    );
    assert_eq!(s.earliest(1).unwrap(), None);
    def.paused = false;
    def.resumed_at = Some(at(40 * MIN + 1));
    s.define(1, "a", Some(&def.to_json()), 40 * MIN).unwrap();
    assert_eq!(s.earliest(1).unwrap(), Some(41 * MIN));
}

#[test]
fn a_delete_or_a_refused_definition_stops_the_schedule_and_its_cursor_is_tombstoned() {
    let (_d, s) = state();
    s.define(1, "a", Some(&every_minute("a").to_json()), 10 * MIN)
        .unwrap();
    s.define(1, "b", Some(&every_minute("b").to_json()), 10 * MIN)
        .unwrap();
    s.advance(1, "a", 11 * MIN).unwrap();
    assert_eq!(s.define(1, "a", None, 12 * MIN).unwrap(), Defined::Deleted);
    assert!(matches!(
        s.define(1, "b", Some(b"{\"id\":\"b\"}"), 12 * MIN).unwrap(),
        Defined::Invalid(why) if why.contains("missing field")
    ));
    assert_eq!(s.earliest(1).unwrap(), None);
    // Only `a` had a cursor to tombstone.
    assert_eq!(s.gone(1, 10).unwrap(), ["a"]);
    s.forgotten(1, "a").unwrap();
    assert_eq!(
        (s.gone(1, 10).unwrap().len(), s.cursor(1, "a").unwrap()),
        (0, None)
    );
    assert_eq!(s.define(1, "a", None, 13 * MIN).unwrap(), Defined::Unchanged);
}

#[test]
fn clearing_a_partition_forgets_only_it() {
    let (_d, s) = state();
    for p in [1, 2] {
        s.define(p, "a", Some(&every_minute("a").to_json()), 10 * MIN)
            .unwrap();
        s.advance(p, "a", 11 * MIN).unwrap();
    }
    s.clear(1).unwrap();
    assert_eq!(
        (s.kept(1, "a").unwrap().is_none(), s.cursor(1, "a").unwrap()),
        (true, None)
    );
    assert_eq!(s.earliest(1).unwrap(), None);
    assert_eq!(s.earliest(2).unwrap(), Some(12 * MIN));
}

#[test]
fn a_backfill_asked_for_waits_in_its_partition_until_done_and_cursors_keep_their_ranges() {
    let (_d, s) = state();
    let body = br#"{"from":"2026-05-01T02:00:00Z","to":"2026-05-01T05:00:00Z"}"#;
    assert!(s.ask_backfill(1, "a", Some(body)).unwrap());
    assert!(!s.ask_backfill(1, "a", Some(b"not a backfill")).unwrap());
    let asked = s.backfills(1, 10).unwrap();
    assert_eq!(asked.len(), 1);
    assert_eq!(
        (asked[0].0.as_str(), asked[0].1.from.to_rfc3339()),
        ("a", "2026-05-01T02:00:00+00:00".into())
    );
    s.backfilled(1, "a").unwrap();
    assert!(s.backfills(1, 10).unwrap().is_empty());
    let c = crate::schedules::decode_cursor(br#"{"last_ms":600000,"backfilled":[[1,2]]}"#).unwrap();
    s.merge_cursor(1, "a", &c).unwrap();
    s.advance(1, "a", 900_000).unwrap();
    let kept = s.full_cursor(1, "a").unwrap().unwrap();
    assert_eq!((kept.last_ms, kept.backfilled), (Some(900_000), vec![[1, 2]]));
    s.ask_backfill(1, "a", Some(body)).unwrap();
    s.clear(1).unwrap();
    assert!(
        s.backfills(1, 10).unwrap().is_empty(),
        "cleared with its partition"
    );
}

#[test]
fn a_definition_under_another_key_is_refused() {
    let (_d, s) = state();
    let did = s
        .define(1, "copy", Some(&every_minute("a").to_json()), 10 * MIN)
        .unwrap();
    assert!(matches!(did, Defined::Invalid(why) if why.contains("not its record's key")));
    assert_eq!(s.earliest(1).unwrap(), None);
}

#[test]
fn unpaused_by_a_new_definition_it_skips_what_it_missed_while_paused() {
    let (_d, s) = state();
    let mut def = every_minute("a");
    s.define(1, "a", Some(&def.to_json()), 10 * MIN).unwrap();
    s.advance(1, "a", 11 * MIN).unwrap();
    def.paused = true;
    s.define(1, "a", Some(&def.to_json()), 12 * MIN).unwrap();
    def.paused = false;
    s.define(1, "a", Some(&def.to_json()), 50 * MIN + 1).unwrap();
    assert_eq!(s.earliest(1).unwrap(), Some(51 * MIN));
}

#[test]
fn a_cursor_tombstone_or_a_cursor_without_its_schedule_goes() {
    let (_d, s) = state();
    s.define(1, "a", Some(&every_minute("a").to_json()), 10 * MIN)
        .unwrap();
    s.advance(1, "a", 20 * MIN).unwrap();
    s.uncursor(1, "a").unwrap();
    assert_eq!(s.cursor(1, "a").unwrap(), None);
    assert_eq!(
        s.earliest(1).unwrap(),
        Some(21 * MIN),
        "the index moves on read-back only"
    );
    // A cursor read after its schedule's delete: found once the partition is read.
    s.advance(1, "gone", 5 * MIN).unwrap();
    assert_eq!(s.orphans(1).unwrap(), 1);
    assert_eq!(s.gone(1, 10).unwrap(), ["gone"]);
}

#[test]
fn the_count_of_schedules_held_follows_defines_deletes_and_clears() {
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    let held = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s = State::new(db.open_tree("schedules").unwrap(), held.clone()).unwrap();
    let n = || held.load(std::sync::atomic::Ordering::Relaxed);
    for (p, id) in [(1, "a"), (1, "b"), (2, "a")] {
        s.define(p, id, Some(&every_minute(id).to_json()), 10 * MIN)
            .unwrap();
    }
    s.define(1, "a", Some(&every_minute("a").to_json()), 11 * MIN)
        .unwrap();
    assert_eq!(n(), 3, "the same definition again is not a new schedule");
    s.define(1, "b", None, 12 * MIN).unwrap();
    assert_eq!(n(), 2);
    s.clear(2).unwrap();
    assert_eq!(n(), 1);
    // A restart starts empty: partitions are read anew when assigned.
    drop(s);
    let again = State::new(db.open_tree("schedules").unwrap(), held.clone()).unwrap();
    assert_eq!((n(), again.earliest(1).unwrap()), (0, None));
}

#[test]
fn a_kept_definition_round_trips_and_a_short_one_is_refused() {
    let value = every_minute("a").to_json();
    for (floor_ms, next_ms) in [
        (None, None),
        (Some(-5), None),
        (None, Some(7)),
        (Some(1), Some(i64::MAX)),
    ] {
        let kept = Kept {
            value: value.clone(),
            version: u64::MAX - 1,
            since_ms: -3,
            floor_ms,
            next_ms,
        };
        let bytes = kept.encode();
        assert_eq!(Kept::decode(&bytes), Some(kept.clone()));
        let fixed = bytes.len() - value.len();
        for n in 0..fixed {
            assert_eq!(Kept::decode(&bytes[..n]), None, "cut to {n} bytes");
        }
    }
}
