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
//! 2. `SchedulerJobs::frontier`: they hold back the first offset counted as handled;
//! 3. `SchedulerJobs::admit`: they hold their offsets and enter the window in
//!    the places reserved for them at the pick (a job whose partition was let
//!    go or taken again meanwhile goes the durable way after all);
//! 4. `SchedulerJobs::settle`: the batch's offsets may be committed up to them;
//! 5. the dispatcher takes them like any due job, and the finisher's
//!    `SchedulerJobs::release_direct` lets their offsets go (no tombstone, no store
//!    delete); `SchedulerJobs::frontier_after_fires` says how far the partition is
//!    handled then;
//! 6. [`hand_over_old`]: one still in the window after [`HOLD_AT_MOST`] (a
//!    backlog ahead of it, or its partition not read up to its run-at) is
//!    persisted like a scheduled job, so that it stops holding the
//!    partition's commit: a crash then re-fires at most that much work.

mod offsets;

use std::time::Duration;

use tracing::info;

use super::batch::PartitionBatch;
use super::persist::persist;
use super::{SchedulerError, Shared};

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::store::{Change, StoreError};
pub(crate) use offsets::DirectOffsets;

/// How long a direct job may wait in the window before it is persisted.
pub(super) const HOLD_AT_MOST: Duration = Duration::from_secs(2);

/// Take out of `pb` the jobs that can fire straight from memory: due on
/// arrival, named by no other record of the batch (nor replacing a direct
/// job), not pending under their id (a replace must delete the old job
/// durably), and where the window mirrors the partition up to them (so they
/// fire in order with stored jobs); their places in the window are reserved.
pub(super) fn pick(shared: &Shared, p: i32, pb: &mut PartitionBatch) -> Result<(), StoreError> {
    // (index in `changes`, job id) of the candidates, their places reserved.
    let candidates = shared.jobs.direct_candidates(p, pb);
    if candidates.is_empty() {
        return Ok(());
    }
    let ids: Vec<JobId> = candidates.iter().map(|(_, id)| *id).collect();
    let pending = match shared.store.pending_ids(p, &ids) {
        Ok(pending) => pending,
        Err(e) => {
            shared.jobs.unreserve(p, pb, candidates.iter().map(|(i, _)| *i));
            return Err(e);
        }
    };
    let (picked, replacing): (Vec<_>, Vec<_>) =
        candidates.into_iter().partition(|(_, id)| !pending.contains(id));
    if !replacing.is_empty() {
        shared.jobs.unreserve(p, pb, replacing.iter().map(|(i, _)| *i));
    }
    // Indexes ascending, as `due_puts`.
    let mut picked = picked.into_iter().map(|(i, _)| i).peekable();
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
        .jobs
        .take_old_direct(before, |p| shared.reads.lanes.of(p) == lane);
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
    shared
        .jobs
        .handed_over(&jobs, persisted.as_ref().ok().map(Vec::as_slice));
    persisted?;
    shared.signals.wake.notify_one();
    info!(jobs = jobs.len(), partitions = parts.len(), held_at_most = ?HOLD_AT_MOST,
        "due jobs waited in memory too long: persisted, so their schedule offsets may be committed");
    Ok(jobs.len())
}
