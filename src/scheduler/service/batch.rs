//! The batches on the scheduler's apply path: what ingest reads
//! ([`ReadBatch`]) and what the apply thread makes of it for one partition
//! ([`PartitionBatch`]). Types only: ingest, the lanes, apply, direct fires
//! and persist all use them, and none of those is imported from here.

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::store::Change;
use crate::scheduler::stored::StoredJob;
use crate::wire::{Command, OwnedRecord};

/// Most bytes of records (keys and payloads) in one read batch, whatever
/// `ingest_batch` allows; twice that may wait for each apply thread.
pub(super) const BATCH_BYTES: usize = 16 << 20;

/// Where a job named by an ingest batch was when the batch was read.
#[derive(Default)]
pub(super) enum Claim {
    /// Not in memory, or a stored job in the window: held there (not fired)
    /// until the batch is applied.
    #[default]
    Held,
    /// Being fired: a cancel or reschedule comes too late (a put is a new
    /// job, such as a worker's retry of it).
    Firing,
    /// A direct job (not stored), taken out of the window by the batch.
    Direct(Box<StoredJob>),
}

/// A batch of schedule records, read and decoded, on its way to be applied.
#[derive(Default)]
pub(super) struct ReadBatch {
    /// The records that name a job, in the order read.
    pub(super) records: Vec<Record>,
    /// Per partition, the last offset read.
    pub(super) last: HashMap<i32, i64>,
    /// Dead letters for the records that broke the contract.
    pub(super) dead: Vec<OwnedRecord>,
    /// The jobs the records name, and how each stood when the batch was read.
    pub(super) named: HashMap<(i32, JobId), Claimed>,
    /// Records read, skipped ones included.
    pub(super) read: u64,
    /// Bytes of the records read (keys and payloads).
    pub(super) bytes: usize,
}

/// How a job named by a batch stood when the batch was read.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Claimed {
    /// Being fired: a cancel or reschedule of it comes too late.
    pub(super) firing: bool,
    /// How many times the job was marked as changing in the window (once
    /// per batch merged in that found it not being fired).
    pub(super) marks: u32,
}

impl ReadBatch {
    /// Append `later`, read after this one.
    pub(super) fn merge(&mut self, later: ReadBatch) {
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
        self.bytes += later.bytes;
    }
}

/// One decoded schedule record.
pub(super) struct Record {
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) command: Command,
}

/// The job id a schedule record names: the id a job is stored under
/// ([`crate::Job::stored_id`]), the id a cancel or reschedule names.
pub(super) fn id_of(c: &Command) -> JobId {
    match c {
        Command::Schedule(job) => job.stored_id(),
        Command::Cancel(id) | Command::Reschedule { id, .. } | Command::Release { id, .. } => *id,
    }
}

/// What one batch of schedule records does to one partition.
#[derive(Default)]
pub(super) struct PartitionBatch {
    pub(super) changes: Vec<Change>,
    /// Each job id the batch names.
    pub(super) ids: HashMap<JobId, Named>,
    /// Highest offset read.
    pub(super) last_offset: i64,
    /// Latest creation time (Kafka timestamp) of the records read.
    pub(super) created_ms: Option<i64>,
    /// Indexes (in `changes`) of puts of jobs already due.
    pub(super) due_puts: Vec<usize>,
    /// Jobs taken out of `changes` to fire straight from memory.
    pub(super) direct: Vec<StoredJob>,
    /// The first schedule offset not handled once the batch is persisted
    /// (none: the batch does not move the store's checkpoint).
    pub(super) schedule_next: Option<i64>,
}

impl PartitionBatch {
    /// Empty, keeping the allocations for the next batch (a batch's worth
    /// of changes at most: a burst's larger lists are let go).
    pub(super) fn clear(&mut self, keep: usize) {
        self.changes.clear();
        self.changes.shrink_to(keep);
        self.ids.clear();
        self.last_offset = 0;
        self.created_ms = None;
        self.due_puts.clear();
        self.direct.clear();
        self.schedule_next = None;
    }

    /// Count a record naming `id`.
    pub(super) fn named(&mut self, id: JobId) -> &mut Named {
        let n = self.ids.entry(id).or_default();
        n.mentions += 1;
        n
    }

    /// Note where job `id` (already named) stands now.
    pub(super) fn now_is(&mut self, id: JobId, at: Option<usize>) {
        self.ids.entry(id).or_default().now = Some(at);
    }

    /// Whether a change to job `id` comes too late: the job was being
    /// fired when the batch was read, and the batch has not put it again.
    pub(super) fn too_late(&self, id: &JobId) -> bool {
        self.ids
            .get(id)
            .is_some_and(|n| matches!(n.claim, Claim::Firing) && n.now.is_none())
    }

    /// Offsets of direct jobs the batch cancels or replaces: they stop
    /// holding the commit once the batch is persisted.
    pub(super) fn released(&self) -> Vec<i64> {
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
pub(super) struct Named {
    /// How many records of the batch name the id.
    pub(super) mentions: u32,
    /// Where the job stands after the batch's changes so far: `None` when
    /// none changed it (the store knows), `Some(None)` deleted, `Some(Some(i))`
    /// the put at `changes[i]`.
    pub(super) now: Option<Option<usize>>,
    /// Where the job was when the batch was read.
    pub(super) claim: Claim,
}
