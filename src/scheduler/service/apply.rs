//! The apply threads, one per lane of partitions: each resolves every
//! change of a batch read against the batch, the window's direct jobs and
//! the store; persists; puts the jobs into the window; then lets the
//! batch's offsets be committed.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::{debug, info, warn};

use super::batch::{Claim, Named, PartitionBatch, ReadBatch};
use super::direct;
use super::lanes::Next;
use super::persist::persist;
use super::{SchedulerError, Shared};

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::store::{Change, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::wire::{self, Command};

/// Apply the batches read on `lane`, in order, and between them hand the
/// lane's direct jobs held too long over to the store. After a failure (the
/// scheduler is then stopping) the rest are only taken off.
///
/// Runs on thread `kairos-lane-N`; the work runs on a thread of its own,
/// `kairos-apply-N`, that ends once the lane has been quiet for
/// [`QUIET_TAKES`] waits, and this one starts the next. The
/// allocator (mimalloc) gives back what a thread freed only when that thread
/// allocates again, and a lane goes quiet once a flood is in: a thread that
/// ends hands its memory back instead of holding it for the next flood.
pub(super) fn apply_loop(shared: &Arc<Shared>, lane: usize) {
    let mut state = LaneState {
        failed: false,
        handed_over: Instant::now(),
    };
    loop {
        let spell = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name(format!("kairos-apply-{lane}"))
                .spawn_scoped(s, || apply_spell(shared, lane, &mut state))
                .map(|h| h.join())
        });
        let ended = match spell {
            Ok(Ok(ended)) => ended,
            Ok(Err(panic)) => {
                // The scheduler stops; the lane's next thread takes the rest
                // off, so the read thread never waits on a full lane.
                let what = crate::worker::panic_message(&*panic).unwrap_or_default();
                shared.fail(format!("apply thread of lane {lane} panicked: {what}"));
                state.failed = true;
                Spell::Quiet
            }
            Err(e) => {
                // No thread to be had now: apply here until quiet, then try again.
                warn!(lane, error = %e, "cannot start an apply thread; applying on the lane's own");
                apply_spell(shared, lane, &mut state)
            }
        };
        if matches!(ended, Spell::Closed) {
            break;
        }
    }
}

/// Waits of [`direct::HOLD_AT_MOST`] / 4 with nothing to apply after which
/// an apply thread ends (see [`apply_loop`]).
const QUIET_TAKES: u32 = 2;

/// What carries over from one apply thread of a lane to the next.
struct LaneState {
    /// A batch failed: the scheduler is stopping, the rest are taken off.
    failed: bool,
    /// When the lane's direct jobs were last looked at.
    handed_over: Instant,
}

/// How an apply thread ended.
enum Spell {
    /// No more batches come.
    Closed,
    /// Nothing came for [`QUIET_TAKES`] waits in a row.
    Quiet,
}

/// Apply `lane`'s batches until it is closed or nothing came for
/// [`QUIET_TAKES`] waits in a row.
fn apply_spell(shared: &Arc<Shared>, lane: usize, state: &mut LaneState) -> Spell {
    let mut spare: Vec<PartitionBatch> = Vec::new();
    let every = direct::HOLD_AT_MOST / 4;
    let mut idle = 0;
    loop {
        let next = shared.reads.lanes.lane(lane).take_within(every);
        if matches!(next, Next::Idle) {
            idle += 1;
        } else {
            idle = 0;
        }
        let result = match next {
            Next::Closed => return Spell::Closed,
            Next::Batch(_) | Next::Idle if state.failed => Ok(()),
            Next::Batch(batch) => apply_batch(shared, batch, &mut spare),
            Next::Idle => Ok(()),
        };
        let result = result.and_then(|()| {
            if !state.failed && state.handed_over.elapsed() >= every {
                state.handed_over = Instant::now();
                direct::hand_over_old(shared, lane)?;
            }
            Ok(())
        });
        if let Err(e) = result {
            shared.fail(e.to_string());
            state.failed = true;
        }
        if idle >= QUIET_TAKES {
            return Spell::Quiet;
        }
    }
}

/// The job `id` of partition `p` as it stands: this batch's changes first,
/// then a direct job the batch took out of the window, then the store.
pub(super) fn current(
    shared: &Shared,
    p: i32,
    id: &JobId,
    pb: &PartitionBatch,
) -> Result<Option<StoredJob>, StoreError> {
    match pb.ids.get(id) {
        Some(Named { now: Some(o), .. }) => {
            return Ok(o.and_then(|i| match &pb.changes[i] {
                Change::Put(s) => Some(s.clone()),
                _ => None,
            }))
        }
        Some(Named {
            claim: Claim::Direct(s),
            ..
        }) => return Ok(Some(StoredJob::clone(s))),
        _ => {}
    }
    shared.store.current(p, id)
}

/// A change that met its job being fired: the job fires as it was.
pub(super) fn too_late(shared: &Shared, what: &str, p: i32, offset: i64, id: &JobId) {
    shared.stats.too_late.fetch_add(1, Ordering::Relaxed);
    info!(job_id = %id, partition = p, offset, change = what, "too late: the job is being fired");
}

/// Apply a batch read: resolve each change against the batch itself, the
/// window's direct jobs and the store; write the changelog and the store;
/// put the jobs into the window; and only then let the batch's offsets be
/// committed.
pub(super) fn apply_batch(
    shared: &Arc<Shared>,
    b: ReadBatch,
    spare: &mut Vec<PartitionBatch>,
) -> Result<(), SchedulerError> {
    let now = shared.clock.now();
    let mut parts: HashMap<i32, PartitionBatch> = HashMap::default();
    for (p, last) in &b.last {
        let pb = parts.entry(*p).or_insert_with(|| spare.pop().unwrap_or_default());
        pb.last_offset = *last;
    }
    // Direct jobs the batch names come out of the window (held there since
    // the batch was read).
    for ((p, id), claim) in shared.jobs.take_named(&b.named) {
        let pb = parts.get_mut(&p).expect("every partition read has a batch");
        pb.ids.insert(
            id,
            Named {
                claim,
                ..Named::default()
            },
        );
    }
    for r in b.records {
        let (p, offset) = (r.partition, r.offset);
        let pb = parts.get_mut(&p).expect("every partition read has a batch");
        match r.command {
            // A job put again while it is being fired (a worker's retry of
            // it, or a re-send) is a new job: it replaces the one in the
            // store, and fires in its turn.
            Command::Schedule(job) => {
                debug!(job_id = %job.id, park = ?job.parked,
                    key = %job.key_lossy(), partition = p, offset, run_at = %wire::format_time(job.run_at), "scheduled");
                let sj = StoredJob {
                    job,
                    seq: offset as u64,
                };
                let at = pb.changes.len();
                pb.named(sj.job.stored_id()).now = Some(Some(at));
                if sj.job.run_at <= now {
                    pb.due_puts.push(at);
                }
                pb.changes.push(Change::Put(sj));
            }
            Command::Cancel(id) => {
                if pb.too_late(&id) {
                    too_late(shared, "cancel", p, offset, &id);
                    continue;
                }
                pb.named(id);
                if current(shared, p, &id, pb)?.is_some() {
                    debug!(job_id = %id, partition = p, offset, "cancelled");
                    shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                    pb.now_is(id, None);
                    pb.changes.push(Change::Delete(id));
                }
            }
            Command::Reschedule { id, run_at } => {
                if pb.too_late(&id) {
                    too_late(shared, "reschedule", p, offset, &id);
                    continue;
                }
                pb.named(id);
                if let Some(mut sj) = current(shared, p, &id, pb)? {
                    debug!(job_id = %id, partition = p, offset, run_at = %wire::format_time(run_at), "rescheduled");
                    sj.job.run_at = run_at;
                    pb.now_is(id, Some(pb.changes.len()));
                    pb.changes.push(Change::Put(sj));
                }
            }
            // Work topics only: decoding refuses it on the schedule topic.
            Command::Release { .. } => {}
        }
    }
    for (p, pb) in parts.iter_mut() {
        direct::pick(shared, *p, pb)?;
    }
    shared.jobs.frontier(&mut parts);
    let applied = persist(shared, &parts, &b.dead)?;
    shared
        .stats
        .dead_lettered
        .fetch_add(b.dead.len() as u64, Ordering::Relaxed);
    // Stored jobs and direct jobs enter the window together, so the
    // dispatcher sees them in one run-at order; the jobs the batch held may
    // be fired again.
    let fallback = shared
        .jobs
        .admit(&applied, &mut parts, now.timestamp_millis(), &b.named);
    shared.signals.wake.notify_one();
    if !fallback.is_empty() {
        // Their partition was let go or taken again since the pick: these
        // go the durable way.
        let applied = persist(shared, &fallback, &[])?;
        shared.jobs.follow(&applied);
        shared.signals.wake.notify_one();
    }
    // Only now may the offsets be committed (the read thread stores them).
    shared.jobs.settle(&parts, &fallback);
    shared.stats.ingested.fetch_add(b.read, Ordering::Relaxed);
    // A partition's share of a full batch is kept for the next one.
    let keep = shared.cfg.scheduler.ingest_batch / parts.len().max(1);
    spare.extend(parts.into_values().map(|mut pb| {
        pb.clear(keep);
        pb
    }));
    Ok(())
}
