//! Recurring schedules against Apache Kafka: occurrences enqueued on time
//! with their ids, definitions followed while running (pause, delete),
//! missed occurrences after downtime by each misfire policy, and each
//! occurrence fired exactly once through SIGKILLs in exactly-once mode.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, DurationRound as _, Utc};
use kairos::schedules::{occurrence_id, JobTemplate, Misfire, Schedule, Schedules};
use kairos::wire::{self, Command as Cmd, Context, Limits, RecordView};
use kairos::{Job, JobId};
use rdkafka::Message as _;

use crate::common::{read_all, wait_for};
use crate::scheduler::{set_up, spawn_scheduler, start_with_clock, SetUp};

const T: Duration = Duration::from_secs(60);

/// Every job on the work topic, as read_committed readers see it.
fn fired(cfg: &kairos::Config) -> Vec<Job> {
    read_all(&cfg.kafka.brokers, &cfg.topics.work[0], "read_committed", T)
        .iter()
        .map(
            |m| match wire::decode(&RecordView::from_message(m), Context::Work, &Limits::default()) {
                Ok(Cmd::Schedule(j)) => j,
                other => panic!("work topic holds {other:?}"),
            },
        )
        .collect()
}

fn minute(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(chrono::Duration::minutes(1)).unwrap()
}

fn every_minute(id: &str, work: &str, first: DateTime<Utc>, misfire: Misfire) -> Schedule {
    let mut s = Schedule::cron(id, "0 * * * * *", JobTemplate::new(work, format!("{id} run")));
    s.start = Some(first);
    s.misfire = misfire;
    s.max_catch_up = 2;
    s
}

/// Occurrences are enqueued `schedules_lead` before their time and fire
/// at it, once each, with their derived ids and the template's key and
/// payload (and `overlap = "skip"` as the jobs' `kairos-if-busy`); a
/// pause stops a schedule while another goes on; a delete tombstones its
/// cursor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn occurrences_fire_once_each_on_time_and_follow_their_definitions() {
    let SetUp {
        dir: _dir, cfg, work, ..
    } = set_up(|c| c.scheduler.static_membership = false).await;
    let base = Utc::now();
    let clock = kairos::ManualClock::new(base);
    let running = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&running, 3);
    let t1 = minute(base) + chrono::Duration::minutes(2);
    let schedules = Schedules::new(&cfg).unwrap();
    let mut a = every_minute("report", &work, t1, Misfire::None);
    a.job.payload = "build the report".into();
    let mut b = every_minute("cleanup", &work, t1, Misfire::None);
    b.overlap = kairos::schedules::Overlap::Skip;
    schedules.upsert(&a).await.unwrap();
    schedules.upsert(&b).await.unwrap();
    let stats = || running.handle.stats();
    wait_for("both definitions read", T, || {
        (stats().schedule_updates == 2).then_some(())
    });
    let step = |to: DateTime<Utc>| {
        clock.set(to);
        running.handle.wake();
    };
    for i in 0..2 {
        let at = t1 + chrono::Duration::minutes(i);
        step(at - chrono::Duration::seconds(1));
        let want = 2 * (i as u64 + 1);
        wait_for("the occurrences enqueued", T, || {
            (stats().occurrences == want).then_some(())
        });
        step(at + chrono::Duration::milliseconds(10));
        wait_for("the occurrences fired", T, || {
            (stats().fired == want).then_some(())
        });
    }
    // Paused: only the other one goes on.
    schedules
        .pause("report", Some("maintenance".into()))
        .await
        .unwrap();
    wait_for("the pause read", T, || {
        (stats().schedule_updates == 3).then_some(())
    });
    let t3 = t1 + chrono::Duration::minutes(2);
    step(t3 - chrono::Duration::seconds(1));
    wait_for("the unpaused occurrence enqueued", T, || {
        (stats().occurrences >= 5).then_some(())
    });
    step(t3 + chrono::Duration::milliseconds(10));
    wait_for("it fired", T, || (stats().fired == 5).then_some(()));
    assert_eq!(stats().occurrences, 5, "the paused schedule enqueued nothing");

    let jobs = fired(&cfg);
    let mut want: HashMap<JobId, (&str, DateTime<Utc>)> = HashMap::new();
    for i in 0..2 {
        let at = t1 + chrono::Duration::minutes(i);
        want.insert(occurrence_id("report", at), ("report", at));
        want.insert(occurrence_id("cleanup", at), ("cleanup", at));
    }
    want.insert(occurrence_id("cleanup", t3), ("cleanup", t3));
    assert_eq!(jobs.len(), want.len(), "each occurrence once: {jobs:?}");
    for j in &jobs {
        let (id, at) = want[&j.id];
        assert_eq!((&j.key[..], j.run_at), (id.as_bytes(), at));
        let payload = if id == "report" {
            "build the report".to_string()
        } else {
            format!("{id} run")
        };
        assert_eq!(j.payload, payload.as_bytes());
        // Through the scheduler's store, the overlap policy reaches workers.
        assert_eq!(j.skip_if_busy, id == "cleanup", "{id}");
    }
    let view = schedules.get("report").await.unwrap().expect("defined");
    let s = view.schedule.expect("valid");
    assert!(s.paused);
    assert_eq!(s.note.as_deref(), Some("maintenance"));
    assert_eq!(view.last, Some(t1 + chrono::Duration::minutes(1)));

    // Deleted: its cursor goes too (the cursors topic keeps no record of it).
    schedules.delete("cleanup").await.unwrap();
    wait_for("the cursor tombstoned", T, || {
        let recs = read_all(
            &cfg.kafka.brokers,
            &cfg.topics.schedule_cursors,
            "read_committed",
            T,
        );
        let last = recs.iter().rev().find(|m| m.key() == Some(&b"cleanup"[..]))?;
        last.payload().is_none().then_some(())
    });
    assert!(schedules.get("cleanup").await.unwrap().is_none());
    running.stop().await;
}

/// A scheduler down for an hour over per-minute schedules: the next one to
/// own them reads their cursors and applies each misfire policy, firing
/// the 60 missed occurrences, the latest one, or none, and counting what
/// it drops; down for 30 days, the policy `all` is capped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn occurrences_missed_while_no_scheduler_ran_follow_the_misfire_policy() {
    let SetUp {
        dir: _dir, cfg, work, ..
    } = set_up(|c| c.scheduler.static_membership = false).await;
    let base = Utc::now();
    let clock = kairos::ManualClock::new(base);
    let t1 = minute(base) + chrono::Duration::minutes(2);
    let schedules = Schedules::new(&cfg).unwrap();
    for (id, policy) in [
        ("all", Misfire::All),
        ("latest", Misfire::Latest),
        ("none", Misfire::None),
    ] {
        let mut s = every_minute(id, &work, t1, policy);
        s.max_catch_up = 100;
        schedules.upsert(&s).await.unwrap();
    }
    let first = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&first, 3);
    wait_for("the definitions read", T, || {
        (first.handle.stats().schedule_updates == 3).then_some(())
    });
    clock.set(t1 + chrono::Duration::milliseconds(10));
    first.handle.wake();
    wait_for("the first occurrences fired", T, || {
        (first.handle.stats().fired == 3).then_some(())
    });
    first.stop().await;

    // Down until 40 s after the 61st: 60 missed, the last one beyond the
    // 30 s misfire threshold too, all within the hour of catch-up.
    clock.set(t1 + chrono::Duration::minutes(60) + chrono::Duration::seconds(40));
    let second = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&second, 3);
    // Each partition's schedules run once it is read: wait for all three.
    wait_for("the missed occurrences handled", T, || {
        let s = second.handle.stats();
        (s.occurrences == 61 && s.occurrences_dropped == 59 + 60).then_some(())
    });
    wait_for("the late occurrences fired", T, || {
        (second.handle.stats().fired == 61).then_some(())
    });
    assert_eq!(second.handle.stats().occurrences_late, 61);
    let m = |i| t1 + chrono::Duration::minutes(i);
    let mut want: Vec<JobId> = (0..=60).map(|i| occurrence_id("all", m(i))).collect();
    want.extend([
        occurrence_id("latest", m(0)),
        occurrence_id("latest", m(60)),
        occurrence_id("none", m(0)),
    ]);
    let mut got: Vec<JobId> = fired(&cfg).iter().map(|j| j.id).collect();
    got.sort();
    want.sort();
    assert_eq!(
        got, want,
        "`all`: each of the 60; `latest`: the last; `none`: nothing"
    );
    // Each schedule's cursor counts its own misfires.
    let want = [(60, 0), (1, 59), (0, 60)];
    let deadline = std::time::Instant::now() + T;
    loop {
        let mut counts = Vec::new();
        for v in schedules.list().await.unwrap() {
            counts.push((v.late, v.dropped));
        }
        // Listed by id: all, latest, none.
        if counts == want {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "(late, dropped) of all, latest, none: {counts:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    second.stop().await;

    // Down 30 days, `all` now catching up over 30 days: capped at its
    // `max_catch_up` (the latest 100), the rest dropped and counted.
    let mut all = every_minute("all", &work, t1, Misfire::All);
    all.max_catch_up = 100;
    all.catch_up = Duration::from_secs(30 * 86_400);
    schedules.upsert(&all).await.unwrap();
    clock.set(m(60) + chrono::Duration::days(30) + chrono::Duration::seconds(40));
    let third = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&third, 3);
    let missed: i64 = 30 * 1440;
    wait_for("the 30 days handled", T, || {
        let s = third.handle.stats();
        let dropped = (missed - 100) + (missed - 1) + missed;
        (s.occurrences == 101 && s.occurrences_dropped == dropped as u64).then_some(())
    });
    wait_for("the capped occurrences fired", T, || {
        (third.handle.stats().fired == 101).then_some(())
    });
    let mut want: Vec<JobId> = (missed - 99..=missed)
        .map(|i| occurrence_id("all", m(60 + i)))
        .collect();
    want.push(occurrence_id("latest", m(60 + missed)));
    let before: std::collections::HashSet<JobId> = got.into_iter().collect();
    let mut got: Vec<JobId> = fired(&cfg)
        .iter()
        .map(|j| j.id)
        .filter(|id| !before.contains(id))
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "`all`: the latest 100 of 43,200; `latest`: the last");
    third.stop().await;
}

/// In exactly-once mode, six schedules fire every second for 45 s while a
/// scheduler process is killed with SIGKILL twice, a second one joins
/// (partitions move), and the first is paused past its session and resumed
/// (a zombie): every occurrence fires exactly once, at its time, as
/// read_committed readers see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_exactly_once_mode_each_occurrence_fires_once_through_sigkills_moves_and_a_zombie() {
    let run = through_faults(true).await;
    assert_eq!(run.twice.len(), 0, "occurrences fired twice: {:?}", run.twice);
}

/// The same faults in at-least-once mode: every occurrence fires, at its
/// time, and one fires twice only when its time is near a fault (from 5 s
/// before it to `schedules_lead` + 5 s after it ends): never without one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_at_least_once_mode_each_occurrence_fires_and_twice_only_near_a_fault() {
    let run = through_faults(false).await;
    let lead = chrono::Duration::seconds(2);
    let margin = chrono::Duration::seconds(5);
    let far: Vec<&DateTime<Utc>> = run
        .twice
        .iter()
        .filter(|at| {
            !run.faults
                .iter()
                .any(|(from, to)| **at >= *from - margin && **at <= *to + lead + margin)
        })
        .collect();
    assert!(
        far.is_empty(),
        "fired twice with no fault near: {far:?}; faults {:?}",
        run.faults
    );
}

/// What [`through_faults`] saw.
struct FaultRun {
    /// Nominal times of the occurrences fired more than once.
    twice: Vec<DateTime<Utc>>,
    /// When each fault began and ended (wall clock).
    faults: Vec<(DateTime<Utc>, DateTime<Utc>)>,
}

/// Six schedules firing every second for 45 s through two SIGKILLs, a
/// partition move and a zombie; checks that every occurrence fired at its
/// time and nothing else did.
async fn through_faults(exactly_once: bool) -> FaultRun {
    let SetUp { dir, cfg, work, .. } = set_up(|c| c.scheduler.exactly_once = exactly_once).await;
    let start =
        Utc::now().duration_trunc(chrono::Duration::seconds(1)).unwrap() + chrono::Duration::seconds(4);
    let last = 44;
    let ids: Vec<String> = (0..6).map(|i| format!("tick-{i}")).collect();
    let schedules = Schedules::new(&cfg).unwrap();
    for id in &ids {
        let mut s = Schedule::cron(id.as_str(), "* * * * * *", JobTemplate::new(&work, "tick"));
        s.start = Some(start);
        s.end = Some(start + chrono::Duration::seconds(last));
        s.misfire = Misfire::All;
        s.max_catch_up = 1000;
        schedules.upsert(&s).await.unwrap();
    }
    let fired_now = || fired(&cfg).len();
    let mut faults = Vec::new();
    let mut first = spawn_scheduler(&cfg);
    for kill in 1..=2 {
        wait_for("occurrences to fire", T, || {
            (fired_now() >= 6 * 3 * kill).then_some(())
        });
        let at = Utc::now();
        drop(first); // SIGKILL
        first = spawn_scheduler(&cfg);
        faults.push((at, Utc::now()));
    }
    wait_for("occurrences to fire", T, || (fired_now() >= 6 * 9).then_some(()));
    let mut other = cfg.clone();
    other.scheduler.data_dir = dir.path().join("b");
    let moved = Utc::now();
    let _second = spawn_scheduler(&other);
    wait_for("occurrences to fire", T, || (fired_now() >= 6 * 15).then_some(()));
    faults.push((moved, Utc::now()));
    let kill = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &first.0.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig}");
    };
    let stopped = Utc::now();
    kill("-STOP");
    let before = fired_now();
    wait_for("the other instance to take over", T, || {
        (fired_now() >= before + 6 * 3).then_some(())
    });
    // Held past its session (the fault itself), then back as a zombie.
    std::thread::sleep(cfg.scheduler.session_timeout);
    kill("-CONT");
    faults.push((stopped, Utc::now()));
    let expected: Vec<(JobId, DateTime<Utc>)> = ids
        .iter()
        .flat_map(|id| {
            (0..=last).map(move |i| {
                let at = start + chrono::Duration::seconds(i);
                (occurrence_id(id, at), at)
            })
        })
        .collect();
    let jobs = wait_for("every occurrence to fire", Duration::from_secs(120), || {
        let jobs = fired(&cfg);
        expected
            .iter()
            .all(|(id, _)| jobs.iter().any(|j| j.id == *id))
            .then_some(jobs)
    });
    let mut copies: HashMap<JobId, usize> = HashMap::new();
    for j in &jobs {
        *copies.entry(j.id).or_default() += 1;
    }
    let twice: Vec<DateTime<Utc>> = expected
        .iter()
        .filter(|(id, _)| copies.get(id).is_some_and(|n| *n > 1))
        .map(|(_, at)| *at)
        .collect();
    let aborted = read_all(&cfg.kafka.brokers, &work, "read_uncommitted", T).len() - jobs.len();
    eprintln!(
        "{} occurrences through 2 kill -9, a move and a zombie (exactly once: {exactly_once}): {} fired twice; \
         {aborted} copies aborted",
        expected.len(),
        twice.len()
    );
    let mut distinct: Vec<JobId> = copies.keys().copied().collect();
    distinct.sort();
    let mut want: Vec<JobId> = expected.iter().map(|(id, _)| *id).collect();
    want.sort();
    assert_eq!(distinct, want, "nothing else fired");
    for (id, at) in &expected {
        assert!(
            jobs.iter().filter(|j| j.id == *id).all(|j| j.run_at == *at),
            "{id} fired at its time"
        );
    }
    drop(first);
    FaultRun { twice, faults }
}

/// A backfill enqueues its range's occurrences again under their ids, once:
/// asked again, nothing; asked for an overlapping range, only what it adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_enqueues_its_range_once() {
    let SetUp {
        dir: _dir, cfg, work, ..
    } = set_up(|c| c.scheduler.static_membership = false).await;
    let base = Utc::now();
    let t1 = minute(base) - chrono::Duration::minutes(30);
    let clock = kairos::ManualClock::new(base);
    let running = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&running, 3);
    let schedules = Schedules::new(&cfg).unwrap();
    let stats = || running.handle.stats();
    let m = |i| t1 + chrono::Duration::minutes(i);
    // Paused: only the backfills enqueue its occurrences.
    let mut minutely = every_minute("minutely", &work, t1, Misfire::None);
    minutely.paused = true;
    schedules.upsert(&minutely).await.unwrap();
    wait_for("the definition read", T, || {
        (stats().schedule_updates == 1).then_some(())
    });
    schedules.backfill("minutely", m(0), m(2)).await.unwrap();
    wait_for("the backfill done", T, || (stats().backfills == 1).then_some(()));
    schedules.backfill("minutely", m(0), m(2)).await.unwrap();
    wait_for("the same backfill done", T, || {
        (stats().backfills == 2).then_some(())
    });
    schedules.backfill("minutely", m(1), m(3)).await.unwrap();
    wait_for("the overlapping backfill done", T, || {
        (stats().backfills == 3).then_some(())
    });
    assert_eq!(stats().occurrences_backfilled, 4, "three, nothing, then one");
    wait_for("the backfilled occurrences fired", T, || {
        (stats().fired == 4).then_some(())
    });
    let mut got: Vec<JobId> = fired(&cfg).iter().map(|j| j.id).collect();
    let mut want: Vec<JobId> = (0..4).map(|i| occurrence_id("minutely", m(i))).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want);
    running.stop().await;
}

/// Three pods register the same 1,000 schedules at once, as each would at
/// its start: the scheduler holds 1,000 schedules, each definition counts
/// once, and every occurrence fires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_pods_upserting_the_same_schedules_at_once_leave_each_once() {
    let SetUp {
        dir: _dir, cfg, work, ..
    } = set_up(|_| {}).await;
    let base = Utc::now();
    let clock = kairos::ManualClock::new(base);
    let running = start_with_clock(&cfg, std::sync::Arc::new(clock.clone()));
    crate::scheduler::wait_owned(&running, 3);
    let start = minute(base) + chrono::Duration::minutes(5);
    let defs: Vec<Schedule> = (0..1000)
        .map(|i| {
            let mut s = Schedule::cron(
                format!("pod-schedule-{i}"),
                "* * * * * *",
                JobTemplate::new(&work, "x"),
            );
            s.start = Some(start);
            s.end = Some(start + chrono::Duration::seconds(1));
            s
        })
        .collect();
    let pods: Vec<_> = (0..3)
        .map(|_| {
            let (cfg, defs) = (cfg.clone(), defs.clone());
            tokio::spawn(async move {
                let client = Schedules::new(&cfg).unwrap();
                for s in &defs {
                    client.upsert(s).await.unwrap();
                }
            })
        })
        .collect();
    for pod in pods {
        pod.await.unwrap();
    }
    let stats = || running.handle.stats();
    wait_for("1,000 schedules held", T, || {
        (stats().schedules == 1000).then_some(())
    });
    wait_for("every definition read", T, || {
        (stats().schedule_updates == 1000).then_some(())
    });
    // Both occurrences within the lead, then due.
    clock.set(start - chrono::Duration::seconds(1));
    running.handle.wake();
    wait_for("the occurrences enqueued", T, || {
        (stats().occurrences == 2000).then_some(())
    });
    clock.set(start + chrono::Duration::seconds(2));
    running.handle.wake();
    wait_for("the occurrences fired", Duration::from_secs(90), || {
        (stats().fired == 2000).then_some(())
    });
    let mut got: Vec<JobId> = fired(&cfg).iter().map(|j| j.id).collect();
    let mut want: Vec<JobId> = defs
        .iter()
        .flat_map(|s| (0..2).map(move |i| occurrence_id(&s.id, start + chrono::Duration::seconds(i))))
        .collect();
    got.sort();
    want.sort();
    assert_eq!(got.len(), want.len(), "each occurrence once");
    assert_eq!(got, want);
    let s = stats();
    assert_eq!(
        (s.schedules, s.schedule_updates, s.occurrences),
        (1000, 1000, 2000)
    );
    running.stop().await;
}
