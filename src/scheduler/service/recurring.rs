//! Recurring schedules (thread `kairos-schedules`): the schedules of the
//! owned partitions, read from the schedules and cursors topics into
//! [`state`], and their occurrences enqueued on time.
//!
//! When schedule partition N is assigned (after its changelog catch-up),
//! partition N of both topics is read from its start up to its end as of
//! then, transactions still open included (a previous owner may be
//! committing an occurrence and its cursor right now); only then do its
//! schedules run. After that the schedules topic is followed: an upsert
//! or delete applies within a poll.
//!
//! Each turn takes the schedules whose next occurrence is due within
//! `scheduler.schedules_lead`, plans them ([`crate::schedules::plan`]) and
//! writes their occurrences (as jobs, to the schedule topic) and their
//! cursors: in one transaction in exactly-once mode, else the jobs first
//! and the cursors once the jobs are acknowledged. A revocation waits for
//! the turn in progress.

mod reading;
mod state;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use tracing::{debug, info, warn};

use super::Shared;
use crate::schedules::{self, occurrence_job, plan, Backfill, Cursor, PlanInput, Schedule};
use crate::sync::Lock;
use crate::wire::{self, OwnedRecord};
use state::{at, State};

/// The most schedules one turn enqueues for.
const MOST_PER_TURN: usize = 500;

/// Past this many records a turn takes no further schedule.
const MOST_RECORDS: usize = 5_000;

/// The longest wait between turns (assignments and revocations are picked
/// up within it).
const IDLE: Duration = Duration::from_millis(200);

/// The recurring schedules' side of the scheduler: which partitions run
/// here, and counters.
#[derive(Default)]
pub(super) struct Recurring {
    control: Mutex<Control>,
    /// Occurrences enqueued.
    pub(super) occurrences: AtomicU64,
    /// Of those, occurrences enqueued after they were missed.
    pub(super) late: AtomicU64,
    /// Occurrences missed and dropped.
    pub(super) dropped: AtomicU64,
    /// Definitions that changed a schedule (new, new version, deleted, refused).
    pub(super) updates: AtomicU64,
    /// Backfill requests carried out.
    pub(super) backfills: AtomicU64,
    /// Schedules held (defined, in owned partitions).
    pub(super) held: std::sync::Arc<AtomicU64>,
    /// Occurrences enqueued by backfills.
    pub(super) backfilled: AtomicU64,
}

#[derive(Default)]
struct Control {
    /// Owned partitions: catching up (the ends to reach in the schedules
    /// and cursors topics) or running (`None`).
    owned: BTreeMap<i32, Option<[i64; 2]>>,
    /// Assigned, not yet read from.
    assigned: Vec<i32>,
    /// Revoked, still to stop reading.
    revoked: Vec<i32>,
}

impl Recurring {
    /// Partitions `parts` are owned now.
    pub(super) fn assign(&self, parts: &[i32]) {
        let c = &mut *self.control.locked();
        // A revocation not yet taken stays: the partition is let go of
        // first, then read anew.
        for p in parts {
            c.owned.remove(p);
            c.assigned.push(*p);
        }
    }

    /// Partitions `parts` go: returns once no occurrence of theirs is
    /// being written (none is after).
    pub(super) fn revoke(&self, parts: &[i32]) {
        let c = &mut *self.control.locked();
        for p in parts {
            c.owned.remove(p);
            c.assigned.retain(|q| q != p);
            c.revoked.push(*p);
        }
    }
}

/// What `GET /schedules` answers: up to `most` schedules of the partitions
/// that run here (read and running), by partition then id, with their
/// next and last occurrences and misfire counts; `held` counts them all.
pub(super) fn view(shared: &Shared, most: usize) -> Result<serde_json::Value, String> {
    let running: Vec<i32> = {
        let c = shared.schedules.control.locked();
        c.owned
            .iter()
            .filter(|(_, r)| r.is_none())
            .map(|(p, _)| *p)
            .collect()
    };
    let tree = shared.store.side_tree("schedules").map_err(|e| e.to_string())?;
    let listed = state::listing(&tree, &running, most).map_err(|e| e.to_string())?;
    let time = |ms: Option<i64>| ms.map(|ms| wire::format_time(at(ms)));
    let rows: Vec<serde_json::Value> = listed
        .into_iter()
        .filter_map(|l| {
            let (s, _) = Schedule::from_json(&l.kept.value).ok()?;
            let every = s.every.map(|d| humantime::format_duration(d).to_string());
            Some(serde_json::json!({
                "id": l.id, "partition": l.partition, "cron": s.cron, "every": every,
                "time_zone": s.time_zone, "paused": s.paused, "note": s.note,
                "misfire": s.misfire, "overlap": s.overlap, "topic": s.job.topic,
                "next": time(l.kept.next_ms), "last": time(l.cursor.last_ms),
                "late": l.cursor.late, "dropped": l.cursor.dropped,
            }))
        })
        .collect();
    Ok(serde_json::json!({
        "held": shared.schedules.held.load(Ordering::Relaxed),
        "partitions": running,
        "shown": rows.len(),
        "schedules": rows,
    }))
}

/// Run until the scheduler stops.
pub(super) fn run(shared: &Shared) {
    // The topics may be missing (not created yet) or the cluster slow to
    // answer: the engine waits for them, saying so once a minute; the
    // partitions assigned meanwhile wait in `Control`.
    let mut said: Option<std::time::Instant> = None;
    let mut engine = loop {
        match Engine::open(shared) {
            Ok(e) => break e,
            Err(why) => {
                if said.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                    warn!(reason = %why, "recurring schedules wait: no schedule runs on this instance until then");
                    said = Some(std::time::Instant::now());
                }
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if shared.signals.stop.is_cancelled() {
                return;
            }
            std::thread::sleep(IDLE);
        }
    };
    while !shared.signals.stop.is_cancelled() {
        let wait = engine.turn().unwrap_or_else(|e| {
            warn!(error = %e, "recurring schedules: turn failed; trying again");
            Duration::from_secs(1)
        });
        engine.read(wait);
    }
}

struct Engine<'a> {
    shared: &'a Shared,
    state: State,
    /// Reads the schedules and cursors topics (read_committed).
    reader: BaseConsumer,
    /// Asks for their ends, open transactions included.
    ends: BaseConsumer,
    topics: [String; 2],
}

impl<'a> Engine<'a> {
    fn open(shared: &'a Shared) -> Result<Engine<'a>, String> {
        let cfg = &shared.cfg;
        let topics = [cfg.topics.schedules.clone(), cfg.topics.schedule_cursors.clone()];
        let mut c = crate::kafka::base_config(&cfg.kafka, "kairos-schedules");
        c.set("group.id", format!("{}-schedules", cfg.scheduler.group_id))
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed");
        let reader: BaseConsumer = c.create().map_err(|e| e.to_string())?;
        let ends: BaseConsumer = c
            .set("isolation.level", "read_uncommitted")
            .create()
            .map_err(|e| e.to_string())?;
        for t in &topics {
            let meta = reader
                .fetch_metadata(Some(t), Duration::from_secs(10))
                .map_err(|e| format!("looking up `{t}`: {e}"))?;
            let n = meta.topics().first().map_or(0, |m| m.partitions().len());
            if n == 0 {
                return Err(format!("topic `{t}` does not exist (run `kairos topics init`)"));
            }
            if n as i32 != cfg.topics.schedule_partitions {
                return Err(format!(
                    "topic `{t}` has {n} partitions, the schedule topic {}: they must match",
                    cfg.topics.schedule_partitions
                ));
            }
        }
        let tree = shared.store.side_tree("schedules").map_err(|e| e.to_string())?;
        Ok(Engine {
            shared,
            state: State::new(tree, shared.schedules.held.clone()).map_err(|e| e.to_string())?,
            reader,
            ends,
            topics,
        })
    }

    /// Take partition moves, then enqueue what is due; returns how long
    /// to wait for the next turn.
    fn turn(&mut self) -> Result<Duration, String> {
        let mut c = self.shared.schedules.control.locked();
        while let Some(p) = c.revoked.first().copied() {
            self.stop_reading(p);
            self.state.clear(p).map_err(|e| e.to_string())?;
            c.revoked.remove(0);
        }
        // A partition whose reading cannot start stays assigned for the
        // next turn.
        while let Some(p) = c.assigned.first().copied() {
            let ends = self.start_reading(p)?;
            c.assigned.remove(0);
            c.owned.insert(p, Some(ends));
        }
        self.check_caught_up(&mut c.owned);
        let ready: Vec<i32> = c
            .owned
            .iter()
            .filter(|(_, catching_up)| catching_up.is_none())
            .map(|(p, _)| *p)
            .collect();
        let err = |e: sled::Error| e.to_string();
        // Backfills first, in a write of their own: the cursors the
        // regular turn writes then carry their ranges.
        let mut backfills = Turn::default();
        for p in &ready {
            for (id, b) in self.state.backfills(*p, MOST_PER_TURN).map_err(err)? {
                self.plan_backfill(*p, &id, b, &mut backfills).map_err(err)?;
            }
        }
        self.finish(backfills)?;
        let cfg = &self.shared.cfg.scheduler;
        let lead = chrono::Duration::from_std(cfg.schedules_lead).unwrap_or_default();
        let now = self.shared.clock.now();
        let mut turn = Turn::default();
        for p in &ready {
            for id in self.state.gone(*p, MOST_PER_TURN).map_err(err)? {
                turn.records
                    .push((schedules::cursor_record(&self.topics[1], &id, None), Some(*p)));
                turn.forgotten.push((*p, id));
            }
            let due = self
                .state
                .due(*p, (now + lead).timestamp_millis(), MOST_PER_TURN)
                .map_err(err)?;
            for id in due {
                // The rest wait for the next turn: one transaction stays small.
                if turn.records.len() >= MOST_RECORDS {
                    break;
                }
                self.plan_one(*p, &id, now, &mut turn).map_err(err)?;
            }
        }
        self.finish(turn)?;
        // Sleep until the next occurrence is due to be enqueued.
        let mut wait = IDLE;
        for (p, catching_up) in &c.owned {
            if catching_up.is_some() {
                wait = wait.min(Duration::from_millis(20));
            } else if let Some(next) = self.state.earliest(*p).map_err(|e| e.to_string())? {
                let left = (at(next) - lead - self.shared.clock.now())
                    .to_std()
                    .unwrap_or_default();
                wait = wait.min(left);
            }
        }
        Ok(wait)
    }

    /// Write a turn's records, then keep what they did.
    fn finish(&self, turn: Turn) -> Result<(), String> {
        if turn.records.is_empty() && turn.done.is_empty() {
            return Ok(());
        }
        if !turn.records.is_empty() {
            write(self.shared, turn.records)?;
        }
        // Written: a cursor kept behind would write them again.
        let err = |e: sled::Error| {
            let why = format!("recurring schedules: written but not kept on disk: {e}");
            self.shared.fail(why.clone());
            why
        };
        for (p, id, c) in &turn.cursors {
            self.state.merge_cursor(*p, id, c).map_err(err)?;
        }
        for (p, id) in &turn.forgotten {
            self.state.forgotten(*p, id).map_err(err)?;
        }
        for (p, id) in &turn.done {
            self.state.backfilled(*p, id).map_err(err)?;
        }
        let s = &self.shared.schedules;
        s.occurrences.fetch_add(turn.occurrences, Ordering::Relaxed);
        s.late.fetch_add(turn.late, Ordering::Relaxed);
        s.dropped.fetch_add(turn.dropped, Ordering::Relaxed);
        s.backfilled.fetch_add(turn.backfilled, Ordering::Relaxed);
        s.backfills.fetch_add(turn.done.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Plan the backfill asked for schedule `id` of partition `p`: the
    /// occurrences in its range not backfilled before, and the cursor
    /// with the range added.
    fn plan_backfill(&self, p: i32, id: &str, b: Backfill, turn: &mut Turn) -> sled::Result<()> {
        turn.done.push((p, id.to_string()));
        let parsed = self.state.kept(p, id)?.map(|k| Schedule::from_json(&k.value));
        let Some(Ok((schedule, recurrence))) = parsed else {
            warn!(
                schedule = id,
                partition = p,
                "backfill of a schedule not defined: nothing to do"
            );
            return Ok(());
        };
        let cursor = self.state.full_cursor(p, id)?.unwrap_or_default();
        let (times, range) = schedules::backfill(&recurrence, b.from, b.to, &cursor.backfilled, 10_000);
        info!(schedule = id, partition = p, from = %b.from, to = %b.to, occurrences = times.len(),
            "recurring schedule: backfill");
        for nominal in &times {
            let job = occurrence_job(&schedule, *nominal);
            turn.records
                .push((wire::encode(&job, &self.shared.cfg.topics.schedule), None));
        }
        let added = Cursor {
            backfilled: vec![range],
            ..Cursor::default()
        };
        let c = cursor.merged(&added);
        turn.records
            .push((schedules::cursor_record(&self.topics[1], id, Some(&c)), Some(p)));
        turn.cursors.push((p, id.to_string(), c));
        turn.backfilled += times.len() as u64;
        Ok(())
    }

    /// Plan schedule `id` of partition `p` into `turn`.
    fn plan_one(
        &self,
        p: i32,
        id: &str,
        now: chrono::DateTime<chrono::Utc>,
        turn: &mut Turn,
    ) -> sled::Result<()> {
        let Some(kept) = self.state.kept(p, id)? else {
            return Ok(());
        };
        let Ok((schedule, recurrence)) = Schedule::from_json(&kept.value) else {
            return Ok(());
        };
        let cfg = &self.shared.cfg.scheduler;
        let after = self.state.after(p, id, &schedule, &kept)?;
        let plan = plan(PlanInput {
            schedule: &schedule,
            recurrence: &recurrence,
            after,
            now,
            lead: cfg.schedules_lead,
            late_after: cfg.schedules_misfire_after,
        });
        if plan.dropped > 0 {
            warn!(schedule = id, partition = p, dropped = plan.dropped, misfire = ?schedule.misfire,
                after = %after, "recurring schedule: missed occurrences dropped");
        }
        for nominal in &plan.enqueue {
            let job = occurrence_job(&schedule, *nominal);
            debug!(schedule = id, partition = p, job_id = %job.id, nominal = %nominal, run_at = %job.run_at,
                "occurrence enqueued");
            turn.records
                .push((wire::encode(&job, &self.shared.cfg.topics.schedule), None));
        }
        if let Some(last) = plan.cursor {
            let mut c = self.state.full_cursor(p, id)?.unwrap_or_default();
            c.last_ms = Some(last.timestamp_millis());
            c.late += plan.late;
            c.dropped += plan.dropped;
            turn.records
                .push((schedules::cursor_record(&self.topics[1], id, Some(&c)), Some(p)));
            turn.cursors.push((p, id.to_string(), c));
        }
        turn.occurrences += plan.enqueue.len() as u64;
        turn.late += plan.late;
        turn.dropped += plan.dropped;
        Ok(())
    }
}

/// One turn's writes and what they do once written.
#[derive(Default)]
struct Turn {
    records: Vec<(OwnedRecord, Option<i32>)>,
    /// Cursors to keep once written: (partition, schedule, cursor).
    cursors: Vec<(i32, String, Cursor)>,
    /// Deleted schedules whose cursor tombstone is in `records`.
    forgotten: Vec<(i32, String)>,
    /// Backfill requests carried out.
    done: Vec<(i32, String)>,
    occurrences: u64,
    late: u64,
    dropped: u64,
    backfilled: u64,
}

/// Write `records`: in one transaction in exactly-once mode; else in
/// order, each acknowledged (cursors come last, so a crash in between
/// enqueues an occurrence again under its id, never skips one).
fn write(shared: &Shared, records: Vec<(OwnedRecord, Option<i32>)>) -> Result<(), String> {
    if let Some(t) = &shared.kafka.txn {
        return match t.submit(records).wait_blocking() {
            Ok(_) => Ok(()),
            Err(e) if e.fatal => {
                shared.fail(format!("recurring schedules: {e}"));
                Err(e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
    }
    let p = &shared.kafka.producer;
    let (jobs, cursors): (Vec<_>, Vec<_>) = records
        .iter()
        .map(|(r, part)| (r, *part))
        .partition(|(r, _)| r.topic != shared.cfg.topics.schedule_cursors);
    for batch in [jobs, cursors] {
        let acks = futures::executor::block_on(crate::kafka::enqueue_all(p, &batch));
        for a in futures::executor::block_on(futures::future::join_all(acks)) {
            a.map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
