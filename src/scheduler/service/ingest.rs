//! Ingest: schedule records into the changelog, the store and the window.
//!
//! Two threads, so that reading never waits for a batch to be persisted:
//!
//! - **read** (`kairos-ingest`, the consumer's thread, where the rebalance
//!   callbacks run): polls a batch, decodes it, skips records handled before,
//!   dead-letters malformed ones and claims the jobs the batch names (a job
//!   being fired makes a cancel or reschedule of it too late; any other is
//!   held in the window until the batch is applied). The batch's partitions
//!   then count as read this far (see
//!   [`CaughtUp`](crate::scheduler::caught_up::CaughtUp)), and it goes to
//! - **apply** (`kairos-apply`): resolves each change against the batch, the
//!   window's direct jobs and the store, writes the changelog and the store
//!   (flushed), puts the jobs into the window, and only then lets the
//!   batch's offsets be committed (the read thread hands them to the
//!   consumer).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::BorrowedMessage;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::Message;
use tracing::{debug, info, warn};

use super::{status, Ctx, SchedulerError, Shared};
use crate::hash::HashMap;
use crate::job::JobId;
use crate::kafka;
use crate::scheduler::changelog;
use crate::scheduler::direct::DirectOffsets;
use crate::scheduler::store::{Applied, Change, DueKey, PartitionWrite, StoreError};
use crate::scheduler::stored::StoredJob;
use crate::wire::{self, Command, Context, DeadLetter, OwnedRecord, RecordView};

/// What one batch of schedule records does to one partition.
#[derive(Default)]
struct PartitionBatch {
    changes: Vec<Change>,
    /// Each job id the batch names.
    ids: HashMap<JobId, Named>,
    /// Highest offset read.
    last_offset: i64,
    /// Latest creation time (Kafka timestamp) of the records read.
    created_ms: Option<i64>,
    /// Indexes (in `changes`) of puts of jobs already due.
    due_puts: Vec<usize>,
    /// Jobs taken out of `changes` to fire straight from memory.
    direct: Vec<StoredJob>,
    /// The first schedule offset not handled once the batch is persisted
    /// (none: the batch does not move the store's checkpoint).
    schedule_next: Option<i64>,
}

impl PartitionBatch {
    /// Empty, keeping the allocations for the next batch.
    fn clear(&mut self) {
        self.changes.clear();
        self.ids.clear();
        self.last_offset = 0;
        self.created_ms = None;
        self.due_puts.clear();
        self.direct.clear();
        self.schedule_next = None;
    }

    /// Count a record naming `id`.
    fn named(&mut self, id: JobId) -> &mut Named {
        let n = self.ids.entry(id).or_default();
        n.mentions += 1;
        n
    }

    /// Note where job `id` (already named) stands now.
    fn now_is(&mut self, id: JobId, at: Option<usize>) {
        self.ids.entry(id).or_default().now = Some(at);
    }

    /// Whether a change to job `id` comes too late: the job was being
    /// fired when the batch was read, and the batch has not put it again.
    fn too_late(&self, id: &JobId) -> bool {
        self.ids
            .get(id)
            .is_some_and(|n| matches!(n.claim, Claim::Firing) && n.now.is_none())
    }

    /// Offsets of direct jobs the batch cancels or replaces: they stop
    /// holding the commit once the batch is persisted.
    fn released(&self) -> Vec<i64> {
        self.ids
            .values()
            .filter_map(|n| match &n.claim {
                Claim::Direct(s) => Some(s.seq as i64),
                _ => None,
            })
            .collect()
    }
}

/// What a batch does to one job id.
#[derive(Default)]
struct Named {
    /// How many records of the batch name the id.
    mentions: u32,
    /// Where the job stands after the batch's changes so far: `None` when
    /// none changed it (the store knows), `Some(None)` deleted, `Some(Some(i))`
    /// the put at `changes[i]`.
    now: Option<Option<usize>>,
    /// Where the job was when the batch was read.
    claim: Claim,
}

/// Where a job named by an ingest batch was when the batch was read.
#[derive(Default)]
enum Claim {
    /// Not in memory, or a stored job in the window: held there (not fired)
    /// until the batch is applied.
    #[default]
    Held,
    /// Being fired: a cancel or reschedule comes too late (a put is a new
    /// job, such as a worker's retry of it).
    Firing,
    /// A direct job (not stored), taken out of the window by the batch.
    Direct(StoredJob),
}

/// A consumer error is logged; a fatal one (librdkafka gave up on the
/// client, as when another process joined with this instance's id and the
/// group fenced this one out) stops the scheduler.
fn consumer_error(consumer: &BaseConsumer<Ctx>, e: &KafkaError) -> Result<(), SchedulerError> {
    if let Some((code, reason)) = consumer.client().fatal_error() {
        return Err(SchedulerError::Fatal(format!(
            "the schedule topic consumer failed for good ({code:?}: {reason}); \
             if another instance runs with this instance's id, give each its own data_dir or instance_id"
        )));
    }
    warn!(error = %e, "schedule topic consumer");
    Ok(())
}

pub(super) fn ingest_loop(shared: &Arc<Shared>) -> Result<(), SchedulerError> {
    let cfg = &shared.cfg;
    let member = kafka::Membership {
        group: &cfg.scheduler.group_id,
        session_timeout: cfg.scheduler.session_timeout,
        instance_id: shared.instance_id.clone(),
    };
    let consumer: BaseConsumer<Ctx> = kafka::consumer(
        &cfg.kafka,
        &member,
        "kairos-scheduler",
        Ctx {
            shared: shared.clone(),
        },
    )?;
    consumer.subscribe(&[&cfg.topics.schedule])?;
    let apply_shared = shared.clone();
    let applier = std::thread::Builder::new()
        .name("kairos-apply".into())
        .spawn(move || apply_loop(&apply_shared))
        .map_err(|e| SchedulerError::Fatal(e.to_string()))?;
    // Most records read and waiting to be applied: beyond it reading waits.
    let most = 2 * cfg.scheduler.ingest_batch.max(1);
    let mut last_report = Instant::now();
    // Kept from batch to batch: growing it anew each time showed in profiles.
    let mut msgs: Vec<BorrowedMessage<'_>> = Vec::with_capacity(cfg.scheduler.ingest_batch);
    while !shared.stop.is_cancelled() {
        match consumer.poll(Duration::from_millis(100)) {
            None => {}
            Some(Err(e)) => consumer_error(&consumer, &e)?,
            Some(Ok(m)) => msgs.push(m),
        }
        while !msgs.is_empty() && msgs.len() < cfg.scheduler.ingest_batch {
            match consumer.poll(Duration::ZERO) {
                Some(Ok(m)) => msgs.push(m),
                Some(Err(e)) => {
                    consumer_error(&consumer, &e)?;
                    break;
                }
                None => break,
            }
        }
        if !msgs.is_empty() {
            if shared.stop.is_cancelled() {
                break; // do not half-process a batch on the way out
            }
            let batch = read_batch(shared, &msgs);
            msgs.clear();
            shared.applying.push(batch, most);
        }
        // Batches applied and direct jobs fired meanwhile may let offsets move.
        shared.store_offsets(&consumer);
        if last_report.elapsed() >= cfg.scheduler.report_interval {
            last_report = Instant::now();
            report(shared, &consumer);
        }
    }
    // The batches read are applied before the last commit.
    shared.applying.close();
    applier
        .join()
        .map_err(|_| SchedulerError::Fatal("apply thread panicked".into()))?;
    shared.store_offsets(&consumer);
    match consumer.commit_consumer_state(CommitMode::Sync) {
        Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
        Err(e) => warn!(error = %e, "final commit failed"),
    }
    consumer.unsubscribe();
    // Serve the revocation callback so the group moves our partitions now.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !consumer.assignment().map(|a| a.count() == 0).unwrap_or(true) && Instant::now() < deadline {
        consumer.poll(Duration::from_millis(50));
    }
    Ok(())
}

/// Records read and not yet applied, merged into one batch while the apply
/// thread is busy (so reading never waits for a batch to be persisted, and
/// a backlog is applied in larger batches). A revoked partition is let go
/// only once the records read from it are applied.
#[derive(Default)]
pub(super) struct Applying {
    state: Mutex<Queue>,
    changed: Condvar,
}

#[derive(Default)]
struct Queue {
    /// Read, waiting for the apply thread.
    waiting: Option<ReadBatch>,
    /// The apply thread is applying a batch.
    busy: bool,
    /// No more batches come.
    closed: bool,
}

impl Applying {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hand `batch` to the apply thread, merged with what waits; first wait
    /// while `most` records or more wait.
    fn push(&self, batch: ReadBatch, most: usize) {
        let mut q = self.lock();
        while q.waiting.as_ref().is_some_and(|w| w.records.len() >= most) && !q.closed {
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
        match &mut q.waiting {
            Some(w) => w.merge(batch),
            None => q.waiting = Some(batch),
        }
        self.changed.notify_all();
    }

    /// The next batch to apply (`None` once closed and drained).
    fn take(&self) -> Option<ReadBatch> {
        let mut q = self.lock();
        q.busy = false;
        self.changed.notify_all();
        loop {
            if let Some(b) = q.waiting.take() {
                q.busy = true;
                self.changed.notify_all();
                return Some(b);
            }
            if q.closed {
                return None;
            }
            q = self.changed.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// No more batches come: the apply thread ends once it has applied the rest.
    fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Wait until every batch read is applied, or `deadline`; whether they are.
    pub(super) fn wait_idle(&self, deadline: Instant) -> bool {
        let mut q = self.lock();
        while q.waiting.is_some() || q.busy {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            q = self
                .changed
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// Apply the batches read, in order. After a failure (the scheduler is then
/// stopping) the rest are only taken off.
fn apply_loop(shared: &Arc<Shared>) {
    let mut spare: Vec<PartitionBatch> = Vec::new();
    let mut failed = false;
    while let Some(batch) = shared.applying.take() {
        if !failed {
            if let Err(e) = apply_batch(shared, batch, &mut spare) {
                shared.fail(e.to_string());
                failed = true;
            }
        }
    }
}

fn report(shared: &Shared, consumer: &BaseConsumer<Ctx>) {
    let st = status(shared);
    let direct: usize = shared.direct().values().map(DirectOffsets::in_flight).sum();
    let mut lag = 0i64;
    if let Ok(pos) = consumer.position() {
        for e in pos.elements() {
            if let (Ok((_, high)), Some(at)) = (
                consumer.fetch_watermarks(e.topic(), e.partition(), Duration::from_secs(1)),
                e.offset().to_raw(),
            ) {
                if at >= 0 {
                    lag += (high - at).max(0);
                }
            }
        }
    }
    info!(owned = ?st.owned, pending = st.pending, in_memory = st.in_memory, direct, ingested = st.ingested,
        fired = st.fired, dead_lettered = st.dead_lettered, lag, "scheduler status");
}

/// The job `id` of partition `p` as it stands: this batch's changes first,
/// then a direct job the batch took out of the window, then the store.
fn current(
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
        }) => return Ok(Some(s.clone())),
        _ => {}
    }
    shared.store.current(p, id)
}

/// A change that met its job being fired: the job fires as it was.
fn too_late(shared: &Shared, what: &str, p: i32, offset: i64, id: &JobId) {
    shared.stats.too_late.fetch_add(1, Ordering::Relaxed);
    info!(job_id = %id, partition = p, offset, change = what, "too late: the job is being fired");
}

/// A batch of schedule records, read and decoded, on its way to be applied.
#[derive(Default)]
struct ReadBatch {
    /// The records that name a job, in the order read.
    records: Vec<Record>,
    /// Per partition, the last offset read.
    last: HashMap<i32, i64>,
    /// Dead letters for the records that broke the contract.
    dead: Vec<OwnedRecord>,
    /// The jobs the records name, and how each stood when the batch was read.
    named: HashMap<(i32, JobId), Claimed>,
    /// Records read, skipped ones included.
    read: u64,
}

/// How a job named by a batch stood when the batch was read.
#[derive(Clone, Copy, Debug, Default)]
struct Claimed {
    /// Being fired: a cancel or reschedule of it comes too late.
    firing: bool,
    /// How many times the job was marked as changing in the window (once
    /// per batch merged in that found it not being fired).
    marks: u32,
}

impl ReadBatch {
    /// Append `later`, read after this one.
    fn merge(&mut self, later: ReadBatch) {
        self.records.extend(later.records);
        for (p, last) in later.last {
            let l = self.last.entry(p).or_insert(last);
            *l = (*l).max(last);
        }
        self.dead.extend(later.dead);
        for (k, c) in later.named {
            let e = self.named.entry(k).or_insert(Claimed {
                firing: c.firing,
                marks: 0,
            });
            e.marks += c.marks;
        }
        self.read += later.read;
    }
}

/// One decoded schedule record.
struct Record {
    partition: i32,
    offset: i64,
    command: Command,
}

/// The job id a schedule record names.
fn id_of(c: &Command) -> JobId {
    match c {
        Command::Schedule(job) => job.id,
        Command::Cancel(id) | Command::Reschedule { id, .. } => *id,
    }
}

/// Read a batch: decode it, skip the records handled before (read again
/// after a crash, their offsets not committed: their jobs may have fired),
/// and claim the jobs it names. From then on no job the batch changes can
/// fire unchanged, so the partitions count as read this far and jobs due up
/// to here may fire, without waiting for the batch to be persisted.
fn read_batch(shared: &Shared, msgs: &[BorrowedMessage<'_>]) -> ReadBatch {
    let cfg = &shared.cfg;
    let mut b = ReadBatch {
        records: Vec::with_capacity(msgs.len()),
        read: msgs.len() as u64,
        ..ReadBatch::default()
    };
    let mut created: HashMap<i32, i64> = HashMap::default();
    // Copied, so that decoding does not hold the lock the dispatcher reads.
    let handled_below = shared.caught_up().handled_below();
    for m in msgs {
        let (p, offset) = (m.partition(), m.offset());
        let last = b.last.entry(p).or_insert(offset);
        *last = (*last).max(offset);
        if let Some(t) = m.timestamp().to_millis() {
            let c = created.entry(p).or_insert(t);
            *c = (*c).max(t);
        }
        if handled_below.get(&p).is_some_and(|h| offset < *h) {
            debug!(partition = p, offset, "handled before; skipped");
            shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let view = RecordView::from_message(m);
        match wire::decode(&view, Context::Schedule, &cfg.limits) {
            Ok(command) => b.records.push(Record {
                partition: p,
                offset,
                command,
            }),
            Err(e) => {
                warn!(partition = p, offset, reason = %e, "schedule record dead-lettered");
                let d = DeadLetter {
                    reason: e.to_string(),
                    origin_topic: m.topic().to_string(),
                    origin_partition: p,
                    origin_offset: offset,
                };
                b.dead.push(wire::dead_letter_record(
                    &view,
                    &d,
                    &cfg.topics.dead_letter,
                    &cfg.limits,
                ));
            }
        }
    }
    {
        let mut w = shared.wheel();
        for r in &b.records {
            let id = id_of(&r.command);
            if let std::collections::hash_map::Entry::Vacant(v) = b.named.entry((r.partition, id)) {
                let firing = w.is_firing(r.partition, &id);
                if !firing {
                    w.changing(r.partition, id);
                }
                v.insert(Claimed {
                    firing,
                    marks: u32::from(!firing),
                });
            }
        }
    }
    let moved = {
        let mut gate = shared.caught_up();
        b.last.iter().fold(false, |moved, (p, last)| {
            gate.ingested(*p, last + 1, created.get(p).copied()) || moved
        })
    };
    if moved {
        shared.wake.notify_one();
    }
    b
}

/// Apply a batch read: resolve each change against the batch itself, the
/// window's direct jobs and the store; write the changelog and the store;
/// put the jobs into the window; and only then let the batch's offsets be
/// committed.
fn apply_batch(
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
    {
        let mut w = shared.wheel();
        for (&(p, id), c) in &b.named {
            let claim = if c.firing {
                Claim::Firing
            } else if let Some((_, s)) = w.take_direct_job(p, &id) {
                Claim::Direct(s)
            } else {
                Claim::Held
            };
            let pb = parts.get_mut(&p).expect("every partition read has a batch");
            pb.ids.insert(
                id,
                Named {
                    claim,
                    ..Named::default()
                },
            );
        }
    }
    for r in b.records {
        let (p, offset) = (r.partition, r.offset);
        let pb = parts.get_mut(&p).expect("every partition read has a batch");
        match r.command {
            // A job put again while it is being fired (a worker's retry of
            // it, or a re-send) is a new job: it replaces the one in the
            // store, and fires in its turn.
            Command::Schedule(job) => {
                debug!(job_id = %job.id, key = %job.key_lossy(), partition = p, offset,
                    run_at = %wire::format_time(job.run_at), "scheduled");
                let sj = StoredJob {
                    job,
                    seq: offset as u64,
                };
                let at = pb.changes.len();
                pb.named(sj.job.id).now = Some(Some(at));
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
        }
    }
    for (p, pb) in parts.iter_mut() {
        pick_direct(shared, *p, pb)?;
    }
    {
        let held = shared.direct();
        for (p, pb) in parts.iter_mut() {
            if !pb.changes.is_empty() {
                let first = held.get(p).map_or(pb.last_offset + 1, |d| {
                    let holding = pb.direct.iter().map(|s| s.seq as i64);
                    d.first_unhandled(pb.last_offset, holding, &pb.released())
                });
                pb.schedule_next = Some(first);
            }
        }
    }
    let applied = persist(shared, &parts, &b.dead)?;
    shared
        .stats
        .dead_lettered
        .fetch_add(b.dead.len() as u64, Ordering::Relaxed);
    // Direct jobs hold their offsets before the dispatcher can see them.
    {
        let mut direct = shared.direct();
        for (p, pb) in &parts {
            let d = direct.entry(*p).or_default();
            for s in &pb.direct {
                d.hold(s.seq as i64);
            }
        }
    }
    // Stored jobs and direct jobs enter the window together, so the
    // dispatcher sees them in one run-at order; the jobs the batch held may
    // be fired again.
    let mut fallback: HashMap<i32, PartitionBatch> = HashMap::default();
    {
        let mut w = shared.wheel();
        w.follow(&applied);
        for (p, pb) in parts.iter_mut() {
            for s in pb.direct.drain(..) {
                let k = DueKey::of(*p, &s);
                let (id, offset) = (s.job.id, s.seq);
                match w.add_direct(k, s) {
                    None => {
                        debug!(job_id = %id, partition = p, offset, "due on arrival: firing from memory")
                    }
                    Some(s) => fallback.entry(*p).or_default().changes.push(Change::Put(s)),
                }
            }
        }
        w.changed(
            b.named
                .iter()
                .flat_map(|(k, c)| std::iter::repeat_n(*k, c.marks as usize)),
        );
    }
    shared.wake.notify_one();
    if !fallback.is_empty() {
        // The window filled up meanwhile: these go the durable way.
        let applied = persist(shared, &fallback, &[])?;
        shared.wheel().follow(&applied);
        shared.wake.notify_one();
    }
    // Only now may the offsets be committed (the read thread stores them).
    {
        let mut direct = shared.direct();
        for (p, pb) in &parts {
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
    shared.stats.ingested.fetch_add(b.read, Ordering::Relaxed);
    spare.extend(parts.into_values().map(|mut pb| {
        pb.clear();
        pb
    }));
    Ok(())
}

/// Take out of `pb` the jobs that can fire straight from memory: due on
/// arrival, named by no other record of the batch (nor replacing a direct
/// job), not pending under their
/// id (a replace must delete the old job durably), and where the window
/// mirrors the partition up to them (so they fire in order with stored jobs).
fn pick_direct(shared: &Shared, p: i32, pb: &mut PartitionBatch) -> Result<(), StoreError> {
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
                        .is_some_and(|n| n.mentions == 1 && matches!(n.claim, Claim::Held))
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

/// Write the batch's changelog records and dead letters (acknowledged by
/// Kafka), then apply its changes to the store and flush it. Returns what
/// changed in the near range.
fn persist(
    shared: &Shared,
    parts: &HashMap<i32, PartitionBatch>,
    dead: &[OwnedRecord],
) -> Result<Vec<Applied>, SchedulerError> {
    let cfg = &shared.cfg;
    // 1. Changelog and dead letters, acknowledged by Kafka.
    let topic = &cfg.topics.changelog;
    let records: Vec<(i32, OwnedRecord)> = parts
        .iter()
        .flat_map(|(p, pb)| {
            let changes = pb.changes.iter().map(|c| match c {
                Change::Put(s) => changelog::put_record(topic, s),
                Change::Delete(id) | Change::Fired(id, _) => changelog::tombstone(topic, id),
            });
            // After the changes it covers, in the same partition.
            let handled = pb
                .schedule_next
                .map(|n| changelog::schedule_next_record(topic, n));
            changes.chain(handled).map(move |r| (*p, r))
        })
        .collect();
    let mut sends: Vec<(Option<i32>, &OwnedRecord)> = records.iter().map(|(p, r)| (Some(*p), r)).collect();
    sends.extend(dead.iter().map(|r| (None, r)));
    let delivered = send_all_retrying(shared, &sends)?;
    let mut changelog_next: HashMap<i32, i64> = HashMap::default();
    for ((p, rec), d) in sends.iter().zip(&delivered) {
        if let (Some(p), true) = (p, rec.topic == cfg.topics.changelog) {
            let e = changelog_next.entry(*p).or_insert(0);
            *e = (*e).max(d.offset + 1);
        }
    }
    // 2. The store, flushed to disk (nothing to do for a batch of direct jobs).
    let writes: Vec<PartitionWrite> = parts
        .iter()
        .filter(|(p, pb)| !pb.changes.is_empty() || changelog_next.contains_key(p))
        .map(|(p, pb)| PartitionWrite {
            changelog_next: changelog_next.get(p).copied(),
            schedule_next: pb.schedule_next,
            ..PartitionWrite::new(*p, &pb.changes)
        })
        .collect();
    let mut applied = Vec::new();
    if !writes.is_empty() {
        applied = shared.store.apply_all(&writes)?;
        shared.store.flush()?;
    }
    Ok(applied)
}

/// Send records and wait for every acknowledgement, retrying the failed ones
/// (the writes are idempotent by job id) until they succeed or the scheduler
/// stops. Records pinned to a partition are retried from the first failure
/// on, in their order.
fn send_all_retrying(
    shared: &Shared,
    records: &[(Option<i32>, &OwnedRecord)],
) -> Result<Vec<rdkafka::producer::future_producer::Delivery>, SchedulerError> {
    let mut out: Vec<Option<rdkafka::producer::future_producer::Delivery>> =
        (0..records.len()).map(|_| None).collect();
    let mut delay = kafka::RetryDelay::new();
    loop {
        let pending: Vec<usize> = (0..records.len()).filter(|i| out[*i].is_none()).collect();
        if pending.is_empty() {
            return Ok(out.into_iter().map(|d| d.expect("all delivered")).collect());
        }
        let results = futures::executor::block_on(futures::future::join_all(
            pending
                .iter()
                .map(|i| kafka::send(&shared.producer, records[*i].1, records[*i].0)),
        ));
        let mut failed = Vec::new();
        for (i, r) in pending.into_iter().zip(results) {
            match r {
                Ok(d) => out[i] = Some(d),
                Err(e) => {
                    failed.push(i);
                    warn!(topic = %records[i].1.topic, error = %e, "write failed; retrying");
                }
            }
        }
        let parts: Vec<Option<i32>> = records.iter().map(|(p, _)| *p).collect();
        for i in written_again(&parts, &failed) {
            out[i] = None;
        }
        if !failed.is_empty() {
            if shared.stop.is_cancelled() {
                return Err(SchedulerError::Fatal(
                    "stopped with writes unacknowledged; their records will be re-read".into(),
                ));
            }
            std::thread::sleep(delay.next_delay());
        }
    }
}

/// Of records pinned to partitions `parts`, those to write again after the
/// records `failed` failed: every one after a failure in its partition, so
/// that the changelog keeps each job's records in order (compaction keeps the
/// last one, and a put retried after its own tombstone would revive the job).
fn written_again(parts: &[Option<i32>], failed: &[usize]) -> Vec<usize> {
    let mut first: HashMap<i32, usize> = HashMap::default();
    for &i in failed {
        if let Some(p) = parts[i] {
            let f = first.entry(p).or_insert(i);
            *f = (*f).min(i);
        }
    }
    parts
        .iter()
        .enumerate()
        .filter(|(i, p)| p.and_then(|p| first.get(&p)).is_some_and(|f| i > f))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_changelog_write_rewrites_the_rest_of_its_partition_in_order() {
        let parts = [Some(0), Some(0), Some(1), None, Some(0), Some(1), None];
        assert_eq!(written_again(&parts, &[]), Vec::<usize>::new());
        assert_eq!(written_again(&parts, &[1]), vec![4], "after 1 in partition 0");
        assert_eq!(
            written_again(&parts, &[4, 0]),
            vec![1, 4],
            "from the first failure"
        );
        assert_eq!(
            written_again(&parts, &[2, 3]),
            vec![5],
            "dead letters (None) stand alone"
        );
    }
}
