//! Held keys in the running worker ([`crate::worker::hold`] decides):
//! consulted for every job read, updated and written (through the keeper)
//! when a job of a holdable key settles, and released by an operator's
//! release record (read back on assignment by `held_load`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tracing::{debug, info, warn};

use super::keeper::{self, ParkedJob};
use super::offsets::write_in_background;
use super::{Entry, Shared, Tp, WorkerState};

use crate::config::OnFailure;
use crate::job::{Job, JobId};
use crate::worker::hold::{Admit, Cause, HoldUpdate, HoldWrite, Settlement};
use crate::worker::settle::Settled;

/// Jobs just read from a holdable partition: those that may run go on to
/// the lock table (the caller buffers them), the others are parked.
pub(super) fn admit(
    shared: &Shared,
    st: &mut WorkerState,
    e: Entry,
    now_ms: i64,
    parks: &mut Vec<ParkedJob>,
) -> Option<Entry> {
    if !shared.topics.holding[e.tp.0] {
        return Some(e);
    }
    if st.holds.read_again(e.tp, &e.job, e.offset) {
        debug!(job_id = %e.job.id, key = %e.job.key_lossy(), partition = e.tp.1, offset = e.offset,
            "read again: its key's hold dealt with it already (parked, or an earlier run of the job holding the key)");
        st.finish(e.tp, e.offset, None);
        return None;
    }
    let gave_up = |st: &WorkerState| st.holds.get(e.tp, &e.job.key).map_or(0, |h| h.gave_up);
    let before = gave_up(st);
    let admit = st.holds.admit(e.tp, &e.job, now_ms);
    if gave_up(st) > before {
        warn!(job_id = %e.job.id, key = %e.job.key_lossy(), partition = e.tp.1, offset = e.offset,
            gave_up_after_ms = st.holds.give_up_ms(), "held key gave up waiting for a job that did not come back; its order may not hold");
    }
    match admit {
        Admit::Run => Some(e),
        Admit::Released => Some(Entry {
            instead: Some(crate::worker::Outcome::dead(
                "its key was released by an operator (kairos keys release)",
            )),
            ..e
        }),
        Admit::Park { seq, at_ms } => {
            parks.push(parked(st, e.job, e.tp, e.offset, seq, at_ms));
            None
        }
        Admit::Stale => {
            stale(st, &e);
            None
        }
        Admit::Wait => {
            let key = (e.tp, e.job.key.clone());
            st.waiting.entry(key.clone()).or_default().push(e);
            if st.waiting.values().map(Vec::len).sum::<usize>() > shared.cfg.worker.max_buffered {
                // Too many wait: this key's go out behind its parked jobs.
                let entries = st.waiting.remove(&key).unwrap_or_default();
                park_all(st, key.0, entries, parks);
            }
            None
        }
    }
}

/// An earlier run of the job holding its key, read again or delivered
/// twice: finished without running (its failure holds the key already).
fn stale(st: &mut WorkerState, e: &Entry) {
    debug!(job_id = %e.job.id, key = %e.job.key_lossy(), partition = e.tp.1, offset = e.offset, attempt = e.job.attempt,
        "an earlier run of the job holding its key: finished without running");
    st.finish(e.tp, e.offset, None);
}

/// Park jobs that waited in memory behind `tp`'s held key, in their order.
fn park_all(st: &mut WorkerState, tp: Tp, entries: Vec<Entry>, parks: &mut Vec<ParkedJob>) {
    let jobs: Vec<&Job> = entries.iter().map(|e| &e.job).collect();
    let admits = st.holds.park_waiting(tp, &jobs);
    for (e, a) in entries.into_iter().zip(admits) {
        if let Admit::Park { seq, at_ms } = a {
            parks.push(parked(st, e.job, e.tp, e.offset, seq, at_ms));
        }
    }
}

/// A job read before its run-at on a holdable partition, handed to the
/// scheduler by the keeper (not parked: no sequence, its run-at kept).
pub(super) fn handed_over(st: &mut WorkerState, e: Entry) -> ParkedJob {
    debug!(job_id = %e.job.id, key = %e.job.key_lossy(), partition = e.tp.1, offset = e.offset,
        "read before its run-at; handed to the scheduler");
    for_keeper(st, e.job, e.tp, e.offset, false)
}

/// A parked job as the keeper writes it.
fn parked(st: &mut WorkerState, mut job: Job, tp: Tp, offset: i64, seq: u64, at_ms: i64) -> ParkedJob {
    // Read as written, or a copy parked under an earlier hold of its key
    // (given a number of this one): its offset counts in `Hold::parked_to`.
    let fresh = job.parked.is_none_or(|s| s != seq);
    debug!(job_id = %job.id, key = %job.key_lossy(), partition = tp.1, offset, attempt = job.attempt, seq, fresh, "parked");
    job.parked = Some(seq);
    job.early = None;
    job.run_at = chrono::DateTime::from_timestamp_millis(at_ms).unwrap_or(job.run_at);
    let hold = st.holds.get(tp, &job.key).map(|h| h.since_ms);
    ParkedJob {
        hold,
        ..for_keeper(st, job, tp, offset, fresh)
    }
}

/// `job`, read from `tp` at `offset`, for the keeper to write under the
/// partition's current ownership; the partition's in-flight count covers
/// it until written.
fn for_keeper(st: &mut WorkerState, job: Job, tp: Tp, offset: i64, fresh: bool) -> ParkedJob {
    *st.in_flight.entry(tp).or_insert(0) += 1;
    let generation = st.owned.get(&tp).map_or(0, |o| o.generation);
    ParkedJob {
        job,
        tp,
        offset,
        generation,
        fresh,
        hold: None,
    }
}

/// After `key`'s running job settled: if its key is now held, take its
/// buffered jobs out of the lock table to park them.
pub(super) fn park_buffered(st: &mut WorkerState, tp: Tp, key: &[u8], parks: &mut Vec<ParkedJob>) {
    if !st.holds.parks_buffered(tp, key) {
        return;
    }
    for e in st.table.take_buffered(key) {
        match st.holds.park_buffered(tp, &e.job) {
            Some(Admit::Park { seq, at_ms }) => parks.push(parked(st, e.job, e.tp, e.offset, seq, at_ms)),
            Some(Admit::Stale) => stale(st, &e),
            // Its blocker's next run, back already: it runs next.
            _ => st.table.push(e),
        }
    }
}

/// `job`'s outcome is written: update its key's hold and write it before
/// the job counts as finished. `false` when the write could not be made
/// (the partition went): the job stays unfinished.
///
/// In exactly-once mode the hold changes and the job finishes under one
/// lock, and the next transaction writes both (see `held_round`).
pub(super) async fn settled(
    shared: &Shared,
    job: &Job,
    (tp, offset, generation): (Tp, i64, u64),
    settled: &Settled,
) -> bool {
    if !shared.topics.holding[tp.0] {
        return true;
    }
    let topic = &shared.topics.names[tp.0];
    let how = match settled {
        Settled::Retried { next } if shared.cfg.worker.on_failure(topic) == OnFailure::HoldKey => {
            Settlement::Again {
                attempt: next.attempt,
                due_ms: next.run_at.timestamp_millis(),
                cause: Cause::Failed,
            }
        }
        Settled::Deferred { next } => Settlement::Again {
            attempt: next.attempt,
            due_ms: next.run_at.timestamp_millis(),
            cause: Cause::Paced,
        },
        _ => Settlement::Finished,
    };
    if how == Settlement::Finished && shared.jobs.nothing_held() {
        // Nothing held: the common case, without the lock.
        return true;
    }
    let now_ms = shared.clock.now().timestamp_millis();
    let update = {
        let mut st = shared.jobs.lock();
        if st.owned.get(&tp).map(|o| o.generation) != Some(generation) {
            // Read under an ownership let go meanwhile: its next owner
            // reads the job again, under the holds it read back.
            return false;
        }
        let update = st.holds.settled(tp, job, how, now_ms);
        if update == HoldUpdate::Unchanged && st.waiting.is_empty() {
            // Nothing held here: the common case, kept cheap.
            return true;
        }
        // The key's jobs buffered behind this one, then those waiting in
        // memory, are parked now, in the same lock: ahead of any job of the
        // key read from here on. A key let go runs the jobs that waited.
        let mut parks = Vec::new();
        park_buffered(&mut st, tp, &job.key, &mut parks);
        let waiting = st.waiting.remove(&(tp, job.key.clone())).unwrap_or_default();
        match &update {
            HoldUpdate::Write(HoldWrite::Let) => {
                for e in waiting {
                    st.table.push(e);
                }
            }
            _ if st.holds.parks_buffered(tp, &job.key) => park_all(&mut st, tp, waiting, &mut parks),
            _ if !waiting.is_empty() => {
                st.waiting.insert((tp, job.key.clone()), waiting);
            }
            _ => {}
        }
        keeper::hand(shared, &mut st, parks);
        if shared.cfg.worker.exactly_once && matches!(update, HoldUpdate::Write(_)) {
            st.dirty.entry(tp).or_default().insert(job.key.clone());
            st.finish(tp, offset, Some(generation));
        }
        update
    };
    match update {
        HoldUpdate::Unchanged => true,
        HoldUpdate::Overflow => {
            shared.stats.hold_overflow.fetch_add(1, Ordering::Relaxed);
            warn!(job_id = %job.id, key = %job.key_lossy(), partition = tp.1, max = shared.cfg.worker.max_held_keys,
                "too many keys held: this key is not held, its later jobs may overtake the retry");
            true
        }
        HoldUpdate::Write(change) => {
            if let HoldWrite::Put(h) = &change {
                if let Some(b) = h.blocker.as_ref().filter(|b| b.id == job.id) {
                    info!(job_id = %job.id, key = %job.key_lossy(), partition = tp.1, attempt = b.attempt,
                        cause = ?b.cause, held_ms = now_ms - h.since_ms, "key held");
                }
            }
            if shared.cfg.worker.exactly_once {
                // Taken by the next transaction, with the job's writes.
                return shared
                    .jobs
                    .lock()
                    .owned
                    .get(&tp)
                    .is_some_and(|o| o.generation == generation);
            }
            shared.out.keeper.write(tp, job.key.clone(), generation).await
        }
    }
}

/// An operator's release of `key`, held by `id`, read at `offset`: the key
/// lets its jobs run, the job's next run is brought forward to be
/// dead-lettered when it comes back, and the record is finished once the
/// hold is written.
pub(super) fn release(shared: &Arc<Shared>, tp: Tp, offset: i64, key: Vec<u8>, id: JobId) {
    let (change, generation) = {
        let mut st = shared.jobs.lock();
        let generation = st.owned.get(&tp).map(|o| o.generation);
        (st.holds.release(tp, &key, id), generation)
    };
    let key_text = String::from_utf8_lossy(&key).into_owned();
    let (Some(_), Some(generation)) = (change, generation) else {
        warn!(job_id = %id, key = %key_text, partition = tp.1, offset,
            "release of a key not held by that job here; ignored");
        shared.jobs.finish_now(tp, offset);
        return;
    };
    info!(job_id = %id, key = %key_text, partition = tp.1, offset, "key released by an operator");
    let s = shared.clone();
    write_in_background(
        shared,
        tp,
        offset,
        |s| &s.released,
        move || {
            let (s, key) = (s.clone(), key.clone());
            async move {
                if !keeper::write(&s, tp, key, generation).await {
                    return Err("the hold was not written".to_string());
                }
                // Bring the released job back now, to be dead-lettered.
                let now = s.clock.now();
                s.out
                    .producer
                    .reschedule(id, now)
                    .await
                    .map(|()| Vec::new())
                    .map_err(|e| e.to_string())
            }
        },
    );
}

/// Keys whose jobs waited in memory too long for parked jobs that are late
/// park them behind those (called by the poll thread about once a second):
/// their offsets then no longer hold the partition's commit back.
pub(super) fn park_overdue_waiting(shared: &Arc<Shared>) {
    let now_ms = shared.clock.now().timestamp_millis();
    let mut st = shared.jobs.lock();
    if st.waiting.is_empty() {
        return;
    }
    let mut parks = Vec::new();
    for (tp, key) in st.holds.overdue_waiting(now_ms) {
        let entries = st.waiting.remove(&(tp, key.to_vec())).unwrap_or_default();
        debug!(key = %String::from_utf8_lossy(&key), partition = tp.1, waiting = entries.len(),
            "jobs waited in memory too long for the key's parked jobs: parked behind them");
        park_all(&mut st, tp, entries, &mut parks);
        if let Some(generation) = st.owned.get(&tp).map(|o| o.generation) {
            let s = shared.clone();
            shared.drivers.runtime.spawn(async move {
                keeper::write(&s, tp, key.to_vec(), generation).await;
            });
        }
    }
    keeper::hand(shared, &mut st, parks);
}
