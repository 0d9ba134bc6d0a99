//! The scheduler's durable store of pending jobs, on sled. Nothing else in
//! Kairos touches sled.
//!
//! An on-disk hierarchical timer wheel. sled 0.34 keeps bookkeeping in memory
//! for every tree node (a leaf holds at most 16 entries), so memory follows
//! the number of *entries*, and it copies a leaf on every update; the store
//! therefore keeps few, large entries:
//!
//! | key | value |
//! |---|---|
//! | `N` partition run-at seq | *near*: a sorted run of up to 64 jobs due before the partition's cascade point, keyed by its first job; runs do not overlap, so a range scan yields due jobs in run-at then arrival order |
//! | `B` partition bucket-start chunk-no | *far*: a chunk of up to 256 jobs due in one time bucket, written by one ingest batch or one cascade |
//! | `J` partition first-id | *id hints*: up to 1024 sorted (job id, run-at, seq) records, for cancel, reschedule and replace by id |
//! | `M` partition | checkpoint: next changelog offset reflected here, pending count, cascade point, next chunk number, first schedule offset not yet handled, when it was last written |
//! | `L` segment | live bytes of one value-log segment (see `value_log`) |
//!
//! The bytes of `N`, `B` and `J` entries (runs, chunks, hint chunks) are
//! not in sled: they are appended to the value log, and the sled value is
//! a pointer to them followed by the chunk's 20-byte header.
//!
//! **Buckets.** Level `l` buckets are `1024 * 8^l` ms wide. A far job goes to
//! the widest bucket that starts at or after the partition's cascade point,
//! so a batch of jobs spread over a month lands in a dozen entries. As time
//! moves, [`Store::cascade`] takes every bucket that starts before the new
//! cascade point and moves its jobs one level finer, or into the near range.
//! A job is rewritten at most once per level (14 levels reach year 9999).
//!
//! **Near runs.** A near job belongs to the run with the greatest key at or
//! before its own (the first run, when it sorts before all of them). A batch
//! rewrites each run it touches once, under the key of its (new) first job,
//! split at 64 jobs; a run left empty is removed. Firing in order therefore
//! removes whole runs and rewrites at most the partly fired first run, and a
//! cascade or an ingest batch appends a few runs instead of an entry per job.
//!
//! **Ids.** A hint says where a job was put (run-at, seq), which does not
//! change when it cascades. Hints are not removed when a job fires (that would
//! touch scattered chunks on the hot path): a hint is checked against the
//! near run or the candidate buckets before it is believed, and stale hints
//! are dropped whenever their chunk is rewritten. Job ids from Kairos
//! producers (UUIDv7) and derived ids sort by time, so a batch touches one or
//! two hint chunks; random ids still work, at the cost of more chunk writes.
//!
//! Every change of a batch (jobs, hints, checkpoint, live counts) lands
//! atomically in one sled batch, after the bytes it points at were written
//! to the value log.

mod batch;
mod buckets;
mod cascade;
mod checkpoint;
mod chunk;
mod compaction;
mod counts;
mod hints;
mod keys;
mod near;
#[cfg(test)]
mod tests;
mod value_log;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use checkpoint::decode_checkpoint;

use crate::job::JobId;

use crate::clock::SharedClock;
use crate::hash::{HashMap, HashSet};
use crate::scheduler::stored::{CorruptJob, StoredJob};
use crate::sync::Lock;
use batch::{View, Writer};
pub use checkpoint::Checkpoint;
use chunk::{inline_header, load_jobs, remove_chunk};
use keys::{key_at_or_before, m_key, n_key, n_start, parse_n_key, prefix, B, J, N};
use value_log::{LogError, ValueLog};

/// Why the store failed. Any of these stops the scheduler from consuming and
/// committing: a job is never acknowledged that is not on disk.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// sled failed (I/O error, full or read-only disk, corruption).
    #[error("scheduler store: {0}")]
    Sled(#[from] sled::Error),
    /// A stored job could not be decoded.
    #[error("scheduler store: {0}")]
    Corrupt(#[from] CorruptJob),
    /// The value log (the chunks' bytes) failed.
    #[error("scheduler store: {0}")]
    Log(#[from] LogError),
    /// The task running a store call ended abnormally (it panicked).
    #[error("scheduler store: {0}")]
    Task(String),
}

/// Where a pending job sits in run-at order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DueKey {
    /// Run-at, milliseconds since the epoch.
    pub run_at_ms: i64,
    /// Schedule partition.
    pub partition: i32,
    /// Arrival order within the partition (the schedule-topic offset).
    pub seq: u64,
}

impl DueKey {
    /// Where `s` sits in `partition`.
    pub fn of(partition: i32, s: &StoredJob) -> DueKey {
        DueKey {
            run_at_ms: s.job.run_at.timestamp_millis(),
            partition,
            seq: s.seq,
        }
    }
}

/// One change to a partition's pending jobs.
// Puts are nearly every change (a job each): boxing them would cost an
// allocation per job to save bytes on the rare deletes.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add the job, replacing any pending job with the same id. Putting the
    /// same job (same id, run-at and seq) again changes nothing.
    Put(StoredJob),
    /// Drop the pending job with this id, if any.
    Delete(JobId),
    /// Drop the job that fired from this key, unless it has been replaced
    /// (rescheduled) since it was taken for firing.
    Fired(JobId, DueKey),
}

/// What a change did to the near range, for the in-memory window to follow.
// As `Change`: most are additions, one per job.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A job became pending at this key.
    Added(DueKey, StoredJob),
    /// The job pending at this key is gone (cancelled, replaced, fired).
    Removed(DueKey, JobId),
}

impl Applied {
    /// The key the change is at.
    pub fn key(&self) -> &DueKey {
        match self {
            Applied::Added(k, _) | Applied::Removed(k, _) => k,
        }
    }
}

/// What one batch does to one partition: its changes, and how far they move
/// the partition's checkpoints (see [`Checkpoint`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct PartitionWrite<'a> {
    /// The schedule partition.
    pub partition: i32,
    /// The changes, in order.
    pub changes: &'a [Change],
    /// The next changelog offset these changes bring the store to.
    pub changelog_next: Option<i64>,
    /// The first schedule offset not handled once these changes are in.
    pub schedule_next: Option<i64>,
}

impl<'a> PartitionWrite<'a> {
    /// `changes` to `partition`, moving no checkpoint.
    pub fn new(partition: i32, changes: &'a [Change]) -> Self {
        PartitionWrite {
            partition,
            changes,
            ..Default::default()
        }
    }
}

/// The durable store.
pub struct Store {
    /// The database (kept to flush and to report size).
    db: sled::Db,
    /// The one tree holding `N`, `B`, `J`, `L` and `M` entries.
    tree: sled::Tree,
    /// The bytes of the `N`, `B` and `J` chunks.
    log: ValueLog,
    /// Serialise read-modify-write batches per partition (the apply threads,
    /// the finisher, the cascade, compaction and changelog catch-up all
    /// write): partition `p` takes lock `p % WRITE_LOCKS`.
    write: [Mutex<()>; WRITE_LOCKS],
    /// The time stamped on checkpoints (`Checkpoint::written_ms`).
    clock: SharedClock,
}

/// Write locks, one per partition up to this many partitions.
const WRITE_LOCKS: usize = 64;
fn lock_index(partition: i32) -> usize {
    partition.unsigned_abs() as usize % WRITE_LOCKS
}

/// The name of the tree. A store written by an earlier layout (the trees in
/// [`OLD_TREES`]) is dropped on open; its partitions rebuild from the changelog.
const TREE: &str = "pending-v4";
const OLD_TREES: [&str; 3] = ["pending", "pending-v2", "pending-v3"];

impl Store {
    /// Open (or create) the store in `dir`, with sled's page cache bounded
    /// to `cache_bytes`.
    pub fn open(dir: &Path, cache_bytes: u64) -> Result<Store, StoreError> {
        Store::open_with_clock(dir, cache_bytes, crate::clock::system())
    }

    /// [`Store::open`], stamping checkpoints with `clock`'s time.
    pub fn open_with_clock(dir: &Path, cache_bytes: u64, clock: SharedClock) -> Result<Store, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .flush_every_ms(None)
            .open()?;
        for old in OLD_TREES {
            if db.tree_names().iter().any(|n| n.as_ref() == old.as_bytes()) {
                tracing::warn!(
                    tree = old,
                    "dropping a store written by an earlier layout; partitions rebuild from the changelog"
                );
                db.drop_tree(old)?;
            }
        }
        let tree = db.open_tree(TREE)?;
        let mut live = HashMap::default();
        for item in tree.scan_prefix([value_log::LIVE_KIND]) {
            let (k, v) = item?;
            let c = value_log::decode_live(&k, &v)?;
            live.insert(c.segment, c.bytes);
        }
        let log = ValueLog::open(&dir.join("values"), live)?;
        Ok(Store {
            db,
            tree,
            log,
            write: std::array::from_fn(|_| Mutex::new(())),
            clock,
        })
    }

    /// Now on the store's clock, in ms.
    fn now_ms(&self) -> i64 {
        self.clock.now().timestamp_millis()
    }

    /// The write lock of `partition`.
    fn lock(&self, partition: i32) -> std::sync::MutexGuard<'_, ()> {
        self.write[lock_index(partition)].locked()
    }

    /// Apply `changes` to `partition` as one atomic batch, optionally
    /// moving its changelog checkpoint. Durable after [`Store::flush`].
    /// Returns what changed in the near range.
    pub fn apply(
        &self,
        partition: i32,
        changes: &[Change],
        changelog_next: Option<i64>,
    ) -> Result<Vec<Applied>, StoreError> {
        self.apply_all(&[PartitionWrite {
            changelog_next,
            ..PartitionWrite::new(partition, changes)
        }])
    }

    /// [`Store::apply`] for several partitions at once, as one atomic
    /// batch (cheaper than one batch each: sled pays per batch too). A
    /// partition listed twice is applied in turns.
    pub fn apply_all(&self, parts: &[PartitionWrite<'_>]) -> Result<Vec<Applied>, StoreError> {
        let mut seen = HashSet::default();
        if !parts.iter().all(|w| seen.insert(w.partition)) {
            let mut applied = Vec::new();
            for part in parts {
                applied.extend(self.apply_all(std::slice::from_ref(part))?);
            }
            return Ok(applied);
        }
        let mut locks: Vec<usize> = parts.iter().map(|w| lock_index(w.partition)).collect();
        locks.sort_unstable();
        locks.dedup();
        let _guards: Vec<_> = locks.into_iter().map(|i| self.write[i].locked()).collect();
        let mut lb = self.log.begin();
        let mut batch = sled::Batch::default();
        let mut applied = Vec::new();
        for part in parts {
            let mut w = Writer {
                view: View::new(self, part.partition)?,
                new_far: BTreeMap::new(),
                far_removals: HashMap::default(),
                // One list for all partitions, passed along (not copied).
                applied: std::mem::take(&mut applied),
            };
            for change in part.changes {
                w.change(change)?;
            }
            applied = w.commit(part.changelog_next, part.schedule_next, &mut lb, &mut batch)?;
        }
        lb.apply(&self.tree, batch, inline_header)?;
        Ok(applied)
    }

    /// The pending job `id` of `partition`, if it is pending.
    pub fn current(&self, partition: i32, id: &JobId) -> Result<Option<StoredJob>, StoreError> {
        // Under the write lock: a cascade moving the job between the reads of
        // the cascade point and of the chunk would hide it.
        let _guard = self.lock(partition);
        let mut view = View::new(self, partition)?;
        match view.locate(id)? {
            Some(loc) => view.load(&loc, id),
            None => Ok(None),
        }
    }

    /// Which of `ids` are pending in `partition`.
    pub fn pending_ids(&self, partition: i32, ids: &[JobId]) -> Result<HashSet<JobId>, StoreError> {
        let _guard = self.lock(partition);
        let mut view = View::new(self, partition)?;
        let mut out = HashSet::default();
        for id in ids {
            if view.locate(id)?.is_some() {
                out.insert(*id);
            }
        }
        Ok(out)
    }

    /// Near jobs of `partition` with run-at at most `until_ms`, in run-at
    /// then arrival order, strictly after `after` (when given), at most
    /// `limit`. Only the near range is scanned: call [`Store::cascade`] up to
    /// `until_ms` first.
    pub fn scan_due(
        &self,
        partition: i32,
        after: Option<DueKey>,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(DueKey, StoredJob)>, StoreError> {
        let start = n_start(partition);
        // The run holding `after` (runs are sorted and do not overlap).
        let from = match after {
            Some(k) => key_at_or_before(&self.tree, &start, &n_key(&k))?.unwrap_or(start),
            None => start,
        };
        let end = n_key(&DueKey {
            run_at_ms: until_ms,
            partition,
            seq: u64::MAX,
        });
        let mut out = Vec::with_capacity(limit.min(4096));
        // Without the write lock: the entries read here may be moved by a
        // compaction, but their old bytes stay until the pin is dropped.
        let _pin = self.log.pin();
        for item in self.tree.range(from..=end) {
            let (_, v) = item?;
            for j in load_jobs(&self.log, &v)? {
                let key = j.key(partition);
                if key.run_at_ms > until_ms || out.len() >= limit {
                    return Ok(out);
                }
                if after.is_none_or(|a| key > a) {
                    out.push((key, j.decode()?));
                }
            }
        }
        Ok(out)
    }

    /// The earliest near job of `partition`.
    pub fn next_due(&self, partition: i32) -> Result<Option<DueKey>, StoreError> {
        Ok(match self.tree.scan_prefix(prefix(N, partition)).keys().next() {
            Some(k) => parse_n_key(&k?),
            None => None,
        })
    }

    /// Forget every pending job and the checkpoint of `partition` (before a
    /// rebuild from the changelog when the local copy cannot be trusted).
    pub fn clear_partition(&self, partition: i32) -> Result<(), StoreError> {
        let _guard = self.lock(partition);
        for kind in [N, B, J] {
            let mut entries = self.tree.scan_prefix(prefix(kind, partition)).peekable();
            while entries.peek().is_some() {
                let mut batch = sled::Batch::default();
                let mut lb = self.log.begin();
                for item in entries.by_ref().take(10_000) {
                    let (k, v) = item?;
                    remove_chunk(&mut lb, &mut batch, &k, &v)?;
                }
                lb.apply(&self.tree, batch, inline_header)?;
            }
        }
        self.tree.remove(m_key(partition))?;
        Ok(())
    }

    /// The checkpoint of `partition` (the default when the store has never held it).
    pub fn checkpoint(&self, partition: i32) -> Result<Checkpoint, StoreError> {
        Ok(match self.tree.get(m_key(partition))? {
            Some(v) => decode_checkpoint(&v)?,
            None => Checkpoint::default(),
        })
    }

    /// Whether the store has ever held `partition`.
    pub fn knows(&self, partition: i32) -> Result<bool, StoreError> {
        Ok(self.tree.contains_key(m_key(partition))?)
    }

    /// Make every applied batch durable (fsync).
    pub fn flush(&self) -> Result<(), StoreError> {
        let dead = self.log.sync()?;
        self.db.flush()?;
        self.log.delete(dead)?;
        Ok(())
    }

    /// Another tree of the store's database, for state that lives beside
    /// the pending jobs (the recurring schedules of owned partitions).
    /// Written without the store's flush discipline: what it holds can be
    /// rebuilt from Kafka.
    pub fn side_tree(&self, name: &str) -> Result<sled::Tree, StoreError> {
        Ok(self.db.open_tree(name)?)
    }

    /// Bytes the store takes on disk.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        Ok(self.db.size_on_disk()? + self.log.usage().written)
    }
}
