//! Direct fires: every step of a job fired straight from memory.
//!
//! A job already due when it is ingested, not pending under its id and not
//! named again in its ingest batch, skips the store and the changelog: it
//! goes into the window like any due job (so it fires in run-at order with
//! the others) and is fired from there. Nothing but its schedule record holds
//! it, so the partition's committable offset stays below it until the job's
//! work-topic write is acknowledged ([`DirectOffsets`]). Its way:
//!
//! 1. [`pick`]: the apply thread takes the batch's candidates out of its changes;
//! 2. [`frontier`]: they hold back the first offset counted as handled;
//! 3. [`hold`], then [`enter`]: they hold their offsets and enter the window
//!    (a job the window has no room for goes the durable way after all);
//! 4. [`settle_batch`]: the batch's offsets may be committed up to them;
//! 5. the dispatcher takes them like any due job, and the finisher's
//!    [`fired`] lets their offsets go (no tombstone, no store delete);
//!    [`frontier_after_fires`] says how far the partition is handled then;
//! 6. [`hand_over_old`]: one still in the window after [`HOLD_AT_MOST`] (a
//!    backlog ahead of it, or its partition not read up to its run-at) is
//!    persisted like a scheduled job, so that it stops holding the
//!    partition's commit: a crash then re-fires at most that much work.

mod offsets;

use std::time::Duration;

use tracing::{debug, info};

use super::batch::{Claim, Named, PartitionBatch};
use super::persist::persist;
use super::{SchedulerError, Shared};

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::changelog;
use crate::scheduler::store::{Change, DueKey, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::scheduler::timer_wheel::TimerWheel;
use crate::wire::OwnedRecord;
pub(crate) use offsets::DirectOffsets;

/// How long a direct job may wait in the window before it is persisted.
pub(super) const HOLD_AT_MOST: Duration = Duration::from_secs(2);

/// Take out of `pb` the jobs that can fire straight from memory: due on
/// arrival, named by no other record of the batch (nor replacing a direct
/// job), not pending under their id (a replace must delete the old job
/// durably), and where the window mirrors the partition up to them (so they
/// fire in order with stored jobs).
pub(super) fn pick(shared: &Shared, p: i32, pb: &mut PartitionBatch) -> Result<(), StoreError> {
    // (index in `changes`, job id) of the candidates.
    let candidates: Vec<(usize, JobId)> = {
        let w = shared.wheel();
        pb.due_puts
            .iter()
            .filter_map(|&i| match &pb.changes[i] {
                Change::Put(s)
                    if pb
                        .ids
                        .get(&s.job.id)
                        .is_some_and(|n: &Named| n.mentions == 1 && matches!(n.claim, Claim::Held))
                        && !w.is_fair(&s.job.topic)
                        && w.may_add_direct(&DueKey::of(p, s)) =>
                {
                    Some((i, s.job.id))
                }
                _ => None,
            })
            .collect()
    };
    if candidates.is_empty() {
        return Ok(());
    }
    let ids: Vec<JobId> = candidates.iter().map(|(_, id)| *id).collect();
    let pending = shared.store.pending_ids(p, &ids)?;
    // Indexes ascending, as `due_puts`.
    let mut picked = candidates
        .into_iter()
        .filter(|(_, id)| !pending.contains(id))
        .map(|(i, _)| i)
        .peekable();
    let mut all = std::mem::take(&mut pb.changes);
    for (i, c) in all.drain(..).enumerate() {
        match c {
            Change::Put(s) if picked.next_if_eq(&i).is_some() => pb.direct.push(s),
            c => pb.changes.push(c),
        }
    }
    if pb.changes.is_empty() {
        pb.changes = all; // keep the allocation when every job went direct
    }
    Ok(())
}

/// Set each partition's first offset not handled once its batch is
/// persisted: direct jobs in flight (those of the batch too) hold it back.
pub(super) fn frontier(shared: &Shared, parts: &mut HashMap<i32, PartitionBatch>) {
    let held = shared.direct();
    for (p, pb) in parts.iter_mut() {
        if !pb.changes.is_empty() {
            // A partition with no entry yet (just assigned) still has this
            // batch's direct jobs to hold the frontier back.
            let holding = pb.direct.iter().map(|s| s.seq as i64);
            let first =
                DirectOffsets::first_unhandled_of(held.get(p), pb.last_offset, holding, &pb.released());
            debug!(
                partition = *p,
                schedule_next = first,
                last_offset = pb.last_offset,
                "schedule frontier"
            );
            pb.schedule_next = Some(first);
        }
    }
}

/// The batch's direct jobs hold their offsets, before the dispatcher can see them.
pub(super) fn hold(shared: &Shared, parts: &HashMap<i32, PartitionBatch>) {
    let mut direct = shared.direct();
    for (p, pb) in parts {
        let d = direct.entry(*p).or_default();
        for s in &pb.direct {
            d.hold(s.seq as i64);
        }
    }
}

/// Put the batch's direct jobs into the window (with its lock held, beside
/// the stored jobs the batch added); those it has no room for come back in
/// `fallback`, to be persisted.
pub(super) fn enter(
    w: &mut TimerWheel,
    parts: &mut HashMap<i32, PartitionBatch>,
    now_ms: i64,
    fallback: &mut HashMap<i32, PartitionBatch>,
) {
    for (p, pb) in parts.iter_mut() {
        for s in pb.direct.drain(..) {
            let k = DueKey::of(*p, &s);
            let (id, offset) = (s.job.id, s.seq);
            match w.add_direct(k, s, now_ms) {
                None => debug!(job_id = %id, partition = p, offset, "due on arrival: firing from memory"),
                Some(s) => fallback.entry(*p).or_default().changes.push(Change::Put(s)),
            }
        }
    }
}

/// The batch is persisted (and its fallback jobs): let its offsets be
/// committed, up to the direct jobs still in flight.
pub(super) fn settle_batch(
    shared: &Shared,
    parts: &HashMap<i32, PartitionBatch>,
    fallback: &HashMap<i32, PartitionBatch>,
) {
    let mut direct = shared.direct();
    for (p, pb) in parts {
        let d = direct.entry(*p).or_default();
        for c in fallback.get(p).map(|f| &f.changes[..]).unwrap_or(&[]) {
            if let Change::Put(s) = c {
                d.release(s.seq as i64);
            }
        }
        for offset in pb.released() {
            d.release(offset);
        }
        d.ingested(pb.last_offset);
    }
}

/// Take the direct jobs out of `done` (fired or dead-lettered): nothing is
/// stored for them, and their schedule offsets may now be committed.
/// Returns how many there were.
pub(super) fn fired(
    shared: &Shared,
    done: &mut Vec<&(DueKey, StoredJob)>,
    direct: &HashMap<DueKey, i64>,
) -> u64 {
    if direct.is_empty() {
        return 0;
    }
    let mut offsets = shared.direct();
    let before = done.len();
    done.retain(|(k, _)| {
        if !direct.contains_key(k) {
            return true;
        }
        if let Some(d) = offsets.get_mut(&k.partition) {
            d.release(k.seq as i64);
        }
        false
    });
    (before - done.len()) as u64
}

/// How far `p` is handled after a finisher round, with the direct jobs it
/// fired: a changelog record to write after the round's tombstones (so a
/// new owner skips what fired here), and the offset.
pub(super) fn frontier_after_fires(
    shared: &Shared,
    p: i32,
    changelog_topic: &str,
) -> Option<(i64, OwnedRecord)> {
    let next = shared.direct().get(&p)?.safe() + 1;
    debug!(
        partition = p,
        schedule_next = next,
        "schedule frontier after fires"
    );
    Some((next, changelog::schedule_next_record(changelog_topic, next)))
}

/// Persist the direct jobs that have waited in the window longer than
/// [`HOLD_AT_MOST`], as the apply thread persists scheduled jobs (changelog,
/// then store); they then fire as stored jobs, and stop holding their
/// partitions' commits. Runs on the apply thread, between batches, so no
/// batch changes them meanwhile (only `lane`'s partitions); their
/// partitions fire nothing until done.
pub(super) fn hand_over_old(shared: &Shared, lane: usize) -> Result<usize, SchedulerError> {
    let now_ms = shared.clock.now().timestamp_millis();
    let before = now_ms.saturating_sub(HOLD_AT_MOST.as_millis() as i64);
    let jobs = shared
        .wheel()
        .persist_direct_older(before, |p| shared.lanes.of(p) == lane);
    if jobs.is_empty() {
        return Ok(0);
    }
    let mut parts: HashMap<i32, PartitionBatch> = HashMap::default();
    for (k, s) in &jobs {
        parts
            .entry(k.partition)
            .or_default()
            .changes
            .push(Change::Put(s.clone()));
    }
    let persisted = persist(shared, &parts, &[]);
    {
        let mut w = shared.wheel();
        w.persisted(&jobs);
        if let Ok(applied) = &persisted {
            w.follow(applied);
        }
    }
    persisted?;
    {
        let mut offsets = shared.direct();
        for (k, _) in &jobs {
            if let Some(d) = offsets.get_mut(&k.partition) {
                d.release(k.seq as i64);
            }
        }
    }
    shared.wake.notify_one();
    info!(jobs = jobs.len(), partitions = parts.len(), held_at_most = ?HOLD_AT_MOST,
        "due jobs waited in memory too long: persisted, so their schedule offsets may be committed");
    Ok(jobs.len())
}
