//! The finisher: waits for a fire batch's writes, then tombstones and
//! deletes what was acknowledged, releases direct jobs' offsets, and puts
//! what failed back into the window.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use super::fire::{FireBatch, FireWrite, FireWrites};
use super::persist::owned_or_log;
use super::{blocking_store, Shared};

use crate::hash::{HashMap, HashSet};
use crate::job::JobId;
use crate::scheduler::changelog;
use crate::scheduler::store::{Change, DueKey, PartitionWrite, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::wire::{DeadLetter, OwnedRecord};
use crate::{kafka, wire};

/// Most jobs one finisher round takes on. Merging the batches waiting saves
/// tombstone and flush work, but a round of a whole backlog (every batch
/// the dispatcher handed over meanwhile, copied and awaited at once) held
/// up offsets and the fired count for a third of a second in the drain bench.
pub(super) const FINISH_ROUND_JOBS: usize = 8_192;

/// Finish fire batches as they come, merging the batches waiting (up to
/// [`FINISH_ROUND_JOBS`]) into one round of tombstones, store deletes and flush.
pub(super) async fn finish_loop(
    shared: Arc<Shared>,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<FireBatch>,
) {
    while let Some(first) = inbox.recv().await {
        let mut jobs = first.due.len();
        let mut batches = vec![first];
        while jobs < FINISH_ROUND_JOBS {
            let Ok(b) = inbox.try_recv() else { break };
            jobs += b.due.len();
            batches.push(b);
        }
        let mut parts: Vec<HashSet<i32>> = Vec::with_capacity(batches.len());
        let mut due = Vec::with_capacity(jobs);
        let mut direct = HashMap::default();
        let mut writes: FireWrites = Vec::with_capacity(jobs);
        let mut room = Vec::with_capacity(batches.len());
        for b in batches {
            due.extend(b.due);
            direct.extend(b.direct);
            writes.extend(b.writes);
            parts.push(b.parts);
            room.push(b.room);
        }
        let ok = finish_fire(&shared, due, direct, writes).await;
        shared.jobs.rounds_done(&parts);
        drop(room);
        if let Err(e) = ok {
            shared.fail(e.to_string());
        }
    }
}

/// What a finisher round writes for one partition.
#[derive(Default)]
pub(super) struct Fired {
    /// Changelog records: tombstones, then how far the partition is handled.
    pub(super) tombs: Vec<OwnedRecord>,
    /// Store deletions.
    pub(super) changes: Vec<Change>,
    /// The next changelog offset once `tombs` are written.
    pub(super) changelog_next: i64,
    /// The first schedule offset not handled.
    pub(super) schedule_next: Option<i64>,
}

/// Finish a fire batch: wait for its writes, then tombstone and delete the
/// stored jobs acknowledged, and release the offsets of the direct ones. Jobs
/// whose write failed go back into the window. In exactly-once mode the
/// work records, dead letters and tombstones are written here, in one
/// transaction ([`in_transaction`]).
pub(super) async fn finish_fire(
    shared: &Arc<Shared>,
    due: Vec<(DueKey, StoredJob)>,
    direct: HashMap<DueKey, i64>,
    writes: FireWrites,
) -> Result<(), StoreError> {
    let cfg = &shared.cfg;
    // Every write is with librdkafka already: awaiting them in turn is
    // enough, and cheaper than joining them.
    let mut results = Vec::with_capacity(writes.len());
    for w in writes {
        results.push(match w {
            FireWrite::Sent(f) => Some(f.await),
            FireWrite::InTransaction => None,
        });
    }
    let now = shared.clock.now();
    let mut done: Vec<&(DueKey, StoredJob)> = Vec::new();
    let mut retry: Vec<(DueKey, StoredJob)> = Vec::new();
    let mut dead: Vec<(&(DueKey, StoredJob), OwnedRecord)> = Vec::new();
    let mut to_write: Vec<&(DueKey, StoredJob)> = Vec::new();
    let mut fired = 0u64;
    for (item, r) in due.iter().zip(results) {
        let (k, s) = item;
        match r {
            None => to_write.push(item),
            Some(Ok(d)) => {
                fired += 1;
                let late_ms = (now - s.job.run_at).num_milliseconds();
                shared.stats.fire_lateness.observe_ms(late_ms);
                debug!(job_id = %s.job.id, park = ?s.job.parked, key = %s.job.key_lossy(), topic = %s.job.topic,
                    partition = d.partition, offset = d.offset, late_ms, "fired");
                done.push(item);
            }
            Some(Err(e)) if kafka::is_unknown_topic(&e) => {
                warn!(job_id = %s.job.id, key = %s.job.key_lossy(), topic = %s.job.topic, partition = k.partition,
                    offset = k.seq, "work topic does not exist; dead-lettering");
                let reason = format!("work topic `{}` does not exist", s.job.topic);
                let d = DeadLetter {
                    reason,
                    origin_topic: cfg.topics.schedule.clone(),
                    origin_partition: k.partition,
                    origin_offset: k.seq as i64,
                };
                dead.push((item, wire::dead_job_record(&s.job, &d, &cfg.topics.dead_letter)));
            }
            Some(Err(e)) => {
                warn!(job_id = %s.job.id, key = %s.job.key_lossy(), topic = %s.job.topic, partition = k.partition,
                    offset = k.seq, error = %e, "fire failed; will retry");
                retry.push(item.clone());
            }
        }
    }
    let (by_part, fired, later, applying) = match &shared.kafka.txn {
        Some(txn) => {
            let written = in_transaction(shared, txn, to_write, dead, &direct, &mut retry).await;
            (written.by_part, written.fired, written.later, written.applying)
        }
        None => {
            confirm_dead(shared, dead, &mut done, &mut retry).await;
            (tombstone(shared, &done, &direct).await, fired, 0, None)
        }
    };
    // Off the runtime threads, so that the dispatcher keeps firing meanwhile.
    let applied = if by_part.is_empty() {
        Vec::new()
    } else {
        blocking_store(shared, "store delete", move |s| {
            let owned = s.reads.owned.read();
            let writes: Vec<PartitionWrite> = by_part
                .iter()
                .filter(|(p, _)| owned_or_log(&owned, **p))
                .map(|(p, f)| PartitionWrite {
                    changelog_next: (f.changelog_next > 0).then_some(f.changelog_next),
                    schedule_next: f.schedule_next,
                    ..PartitionWrite::new(*p, &f.changes)
                })
                .collect();
            let applied = s.store.apply_all(&writes)?;
            s.store.flush()?;
            Ok(applied)
        })
        .await?
    };
    // Exactly once: the round's tombstones no longer hold checkpoints back.
    drop(applying);
    shared.stats.fired.fetch_add(fired, Ordering::Relaxed);
    let backoff = retry.len() > later;
    shared.jobs.finished(&applied, &due, retry, &direct);
    if later > 0 {
        // Due again at once: the dispatcher takes them in its next round.
        shared.signals.wake.notify_one();
    }
    if backoff {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// At least once: write the dead letters of jobs whose work topic is
/// missing; those written are done, the others retried.
async fn confirm_dead<'a>(
    shared: &Shared,
    dead: Vec<(&'a (DueKey, StoredJob), OwnedRecord)>,
    done: &mut Vec<&'a (DueKey, StoredJob)>,
    retry: &mut Vec<(DueKey, StoredJob)>,
) {
    let dead_results = futures::future::join_all(
        dead.iter()
            .map(|(_, r)| kafka::send(&shared.kafka.producer, r, None)),
    )
    .await;
    for ((item, _), r) in dead.iter().zip(dead_results) {
        match r {
            Ok(_) => {
                shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                done.push(item);
            }
            Err(e) => {
                warn!(job_id = %item.1.job.id, key = %item.1.job.key_lossy(), partition = item.0.partition,
                    offset = item.0.seq, error = %e, "dead-letter write failed; will retry");
                retry.push((*item).clone());
            }
        }
    }
}

/// At least once: the jobs `done` (fired or dead-lettered) are tombstoned
/// in the changelog, and their partitions' handled offsets written after.
async fn tombstone(
    shared: &Shared,
    done: &[&(DueKey, StoredJob)],
    direct: &HashMap<DueKey, i64>,
) -> HashMap<i32, Fired> {
    let mut done = done.to_vec();
    // Direct jobs: nothing stored; their schedule offsets may now be committed.
    let fired_direct = shared.jobs.release_direct(&mut done, direct);
    shared
        .stats
        .fired_direct
        .fetch_add(fired_direct, Ordering::Relaxed);
    let order = shared.kafka.changelog_order.lock().await;
    let mut by_part = decide_tombstones(shared, &done);
    // One list of (partition, record), so that each acknowledgement is read
    // against the record it answers.
    let sent: Vec<(i32, &OwnedRecord)> = by_part
        .iter()
        .flat_map(|(p, f)| f.tombs.iter().map(move |r| (*p, r)))
        .collect();
    let pinned: Vec<_> = sent.iter().map(|(p, r)| (*r, Some(*p))).collect();
    let acks = kafka::enqueue_all(&shared.kafka.producer, &pinned).await;
    drop(order);
    let results = futures::future::join_all(acks).await;
    let acks = results.into_iter().map(|r| r.map(|d| d.offset));
    let partitions: Vec<i32> = sent.iter().map(|(p, _)| *p).collect();
    let (written, failed) = changelog::written_up_to(&partitions, acks);
    for (i, err) in failed {
        // The local delete still happens; a later owner rebuilding from
        // the changelog may fire this job again (a documented duplicate).
        warn!(key = %String::from_utf8_lossy(&sent[i].1.key), error = %err, "changelog write failed");
    }
    drop(sent);
    for (p, next) in written {
        if let Some(f) = by_part.get_mut(&p) {
            f.changelog_next = next;
        }
    }
    by_part
}

/// The changelog records for the jobs `done`, per partition: a tombstone
/// each, then how far the partition is handled. Called under the changelog
/// order lock: a job put again since it was taken (a worker's retry under
/// its id) keeps its new put, which a tombstone written after it would
/// delete from the changelog, and so from a rebuild; a put read later is
/// written after the tombstone.
fn decide_tombstones(shared: &Shared, done: &[&(DueKey, StoredJob)]) -> HashMap<i32, Fired> {
    let topic = &shared.cfg.topics.changelog;
    let put_again: HashSet<(i32, JobId)> = shared.jobs.put_again(done);
    let mut by_part: HashMap<i32, Fired> = HashMap::default();
    for (k, s) in done {
        let e = by_part.entry(k.partition).or_default();
        if put_again.contains(&(k.partition, s.job.stored_id())) {
            debug!(job_id = %s.job.id, partition = k.partition, offset = k.seq,
                "fired; its id was put again meanwhile, the changelog keeps the new put");
        } else {
            e.tombs.push(changelog::tombstone(topic, &s.job.stored_id()));
        }
        e.changes.push(Change::Fired(s.job.stored_id(), *k));
    }
    // How far each partition is handled, with the direct jobs just fired:
    // after its tombstones, so a new owner skips what fired here.
    for (p, f) in by_part.iter_mut() {
        if let Some(next) = shared.jobs.frontier_after_fires(*p) {
            f.schedule_next = Some(next);
            f.tombs.push(changelog::schedule_next_record(topic, next));
        }
    }
    by_part
}

/// What an exactly-once round wrote.
struct InTransaction<'a> {
    by_part: HashMap<i32, Fired>,
    /// Holds other writers' checkpoints below the round's tombstones until
    /// its store delete is done.
    applying: Option<super::transactions::Applying<'a>>,
    fired: u64,
    /// Direct jobs left for a later round (first in `retry`): not failures.
    later: usize,
}

/// Exactly once: the work records of `fire`, the dead letters `dead` and
/// every tombstone in one transaction, with, per partition with direct
/// jobs among them, how far it is handled. Committed: all are done.
/// Aborted: all go into `retry` (nothing of the round is visible to
/// read_committed readers); a fatal error stops the scheduler. A job above
/// its partition's first direct job left in flight waits for a later round
/// (a direct job's fire could not be recorded as handled; a stored job's
/// record could be read again and stored anew).
async fn in_transaction<'a>(
    shared: &Shared,
    txn: &'a super::transactions::Transactions,
    mut fire: Vec<&(DueKey, StoredJob)>,
    mut dead: Vec<(&(DueKey, StoredJob), OwnedRecord)>,
    direct: &HashMap<DueKey, i64>,
    retry: &mut Vec<(DueKey, StoredJob)>,
) -> InTransaction<'a> {
    let handled = match direct.is_empty() {
        true => HashMap::default(),
        false => {
            let round = fire.iter().map(|i| &i.0).chain(dead.iter().map(|(i, _)| &i.0));
            shared
                .jobs
                .frontier_if_fired(round.filter(|k| direct.contains_key(k)))
        }
    };
    // A stored job fires only once its partition is handled past its
    // record (with this round's direct jobs): after a crash, reading from
    // an earlier direct job would read its record again and store it anew.
    let mut frontier: HashMap<i32, Option<i64>> = HashMap::default();
    for (k, _) in fire.iter().copied().chain(dead.iter().map(|(i, _)| *i)) {
        frontier.entry(k.partition).or_insert_with(|| {
            handled
                .get(&k.partition)
                .copied()
                .or_else(|| shared.jobs.frontier_after_fires(k.partition))
        });
    }
    let waits = |k: &DueKey| match direct.contains_key(k) {
        true => handled.get(&k.partition).is_none_or(|h| k.seq as i64 >= *h),
        false => frontier
            .get(&k.partition)
            .copied()
            .flatten()
            .is_some_and(|f| k.seq as i64 >= f),
    };
    let before = retry.len();
    for item in fire.extract_if(.., |i| waits(&i.0)) {
        retry.push(item.clone());
    }
    for (item, _) in dead.extract_if(.., |(i, _)| waits(&i.0)) {
        retry.push(item.clone());
    }
    let later = retry.len() - before;
    let done: Vec<&(DueKey, StoredJob)> = fire.iter().copied().chain(dead.iter().map(|(i, _)| *i)).collect();
    let mut records: Vec<(OwnedRecord, Option<i32>)> = Vec::with_capacity(done.len() * 2);
    records.extend(
        fire.iter()
            .map(|(_, s)| (wire::encode(&s.job, &s.job.topic), None)),
    );
    let dead_count = dead.len() as u64;
    records.extend(dead.into_iter().map(|(_, r)| (r, None)));
    let order = shared.kafka.changelog_order.lock().await;
    let stored: Vec<&(DueKey, StoredJob)> = done
        .iter()
        .copied()
        .filter(|(k, _)| !direct.contains_key(k))
        .collect();
    let mut by_part = decide_tombstones(shared, &stored);
    let topic = &shared.cfg.topics.changelog;
    for (p, next) in &handled {
        let f = by_part.entry(*p).or_default();
        f.schedule_next = Some(f.schedule_next.map_or(*next, |n| n.max(*next)));
        f.tombs.push(changelog::schedule_next_record(topic, *next));
    }
    let first_tomb = records.len();
    let partitions: Vec<i32> = by_part
        .iter()
        .flat_map(|(p, f)| f.tombs.iter().map(move |_| *p))
        .collect();
    for (p, f) in by_part.iter_mut() {
        records.extend(std::mem::take(&mut f.tombs).into_iter().map(|r| (r, Some(*p))));
    }
    let answer = txn.submit(records);
    drop(order);
    match answer.wait().await {
        Ok(committed) => {
            let acks = committed.acks;
            let applying = txn.applying(committed.pending);
            let now = shared.clock.now();
            for ((k, s), d) in fire.iter().copied().zip(&acks) {
                let late_ms = (now - s.job.run_at).num_milliseconds();
                shared.stats.fire_lateness.observe_ms(late_ms);
                debug!(job_id = %s.job.id, park = ?s.job.parked, key = %s.job.key_lossy(), topic = %s.job.topic,
                    partition = k.partition, offset = k.seq, work_partition = d.partition, work_offset = d.offset,
                    late_ms, "fired in a transaction");
            }
            shared
                .stats
                .dead_lettered
                .fetch_add(dead_count, Ordering::Relaxed);
            // The direct jobs' offsets may now be committed.
            let mut fired_direct = done;
            let n = shared.jobs.release_direct(&mut fired_direct, direct);
            shared.stats.fired_direct.fetch_add(n, Ordering::Relaxed);
            let tombs = acks[first_tomb..].iter().map(|d| Ok::<_, ()>(d.offset));
            let (written, _) = changelog::written_up_to(&partitions, tombs);
            for (p, next) in written {
                if let Some(f) = by_part.get_mut(&p) {
                    f.changelog_next = applying.applicable(p, next);
                }
            }
            InTransaction {
                by_part,
                applying: Some(applying),
                fired: fire.len() as u64,
                later,
            }
        }
        Err(e) => {
            if e.fatal {
                shared.fail(format!("firing in a transaction: {e}"));
            } else if !e.not_owned.is_empty() {
                // Put back, until the partitions are let go.
                debug!(jobs = done.len(), partitions = ?e.not_owned, "fire round refused: partitions not owned");
            } else {
                warn!(jobs = done.len(), error = %e, "fire round aborted; will retry");
            }
            retry.extend(done.into_iter().cloned());
            InTransaction {
                by_part: HashMap::default(),
                applying: None,
                fired: 0,
                later: 0,
            }
        }
    }
}
