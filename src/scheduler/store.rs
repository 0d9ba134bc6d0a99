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
//! | `M` partition | checkpoint: next changelog offset reflected here, pending count, cascade point, next chunk number, first schedule offset not yet handled |
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

use std::collections::BTreeMap;

use crate::hash::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use crate::job::JobId;
use crate::scheduler::stored::{CorruptJob, StoredJob};
use crate::scheduler::value_log::{self, LogBatch, LogError, Ptr, ValueLog, PTR_LEN};

/// Why the store failed. Any of these stops the scheduler from consuming and
/// committing: a job is never acknowledged that is not on disk.
#[derive(Debug, thiserror::Error)]
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A job became pending at this key.
    Added(DueKey, StoredJob),
    /// The job pending at this key is gone (cancelled, replaced, fired).
    Removed(DueKey, JobId),
}

/// Per-partition checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The next changelog offset not yet reflected in this store.
    pub changelog_next: i64,
    /// The first schedule-topic offset whose record may not have been
    /// handled yet: every record before it is reflected here (or fired).
    /// A record read again below it (its offset was not committed before a
    /// crash) is skipped, so a job that fired is not fired again.
    pub schedule_next: i64,
    /// Jobs pending in the partition.
    pub pending: u64,
    /// Every pending job due before this instant (ms) is in the near range.
    pub cascaded_to: i64,
    /// Number of the next far chunk (keeps chunk keys unique).
    pub next_chunk: u64,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            changelog_next: 0,
            schedule_next: 0,
            pending: 0,
            cascaded_to: i64::MIN,
            next_chunk: 0,
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
    /// Serialise read-modify-write batches per partition (ingest, the
    /// finisher and the cascader all write): partition `p` takes lock
    /// `p % WRITE_LOCKS`.
    write: [Mutex<()>; WRITE_LOCKS],
}

const N: u8 = b'N';
const B: u8 = b'B';
const J: u8 = b'J';
const M: u8 = b'M';

/// Level 0 buckets are 2^10 ms wide; each level is 2^3 times wider.
const BASE_SHIFT: u32 = 10;
const LEVEL_SHIFT: u32 = 3;
/// Levels 0..14: the widest buckets span 2^49 ms (about 17,800 years).
const LEVELS: u32 = 14;
/// Most jobs in one far chunk, and a soft bound on its bytes.
const CHUNK_JOBS: usize = 256;
const CHUNK_BYTES: usize = 64 << 10;
/// Write locks, one per partition up to this many partitions.
const WRITE_LOCKS: usize = 64;
fn lock_index(partition: i32) -> usize {
    partition.unsigned_abs() as usize % WRITE_LOCKS
}

/// Most jobs in one near run.
const NEAR_JOBS: usize = 64;
/// Most hints in one id chunk before it splits.
const HINTS_PER_CHUNK: usize = 1024;
/// A cascade call moves at least this many far chunks (whole buckets) when
/// that many are due, and stops at the next bucket boundary after it.
const CASCADE_CHUNKS: usize = 512;
/// The name of the tree. A store written by an earlier layout (the trees in
/// [`OLD_TREES`]) is dropped on open; its partitions rebuild from the changelog.
const TREE: &str = "pending-v4";
const OLD_TREES: [&str; 3] = ["pending", "pending-v2", "pending-v3"];

fn width(level: u32) -> i64 {
    1i64 << (BASE_SHIFT + LEVEL_SHIFT * level)
}

fn align_down(ms: i64, w: i64) -> i64 {
    ms.div_euclid(w) * w
}

fn align_up(ms: i64, w: i64) -> i64 {
    align_down(ms.saturating_add(w - 1), w)
}

/// The bucket of a far job due at `run_at_ms` when the cascade point is `t`
/// (aligned to level 0, `run_at_ms >= t`): the widest bucket starting at or after `t`.
fn bucket_for(run_at_ms: i64, t: i64) -> i64 {
    let mut best = align_down(run_at_ms, width(0));
    for level in 1..LEVELS {
        let b = align_down(run_at_ms, width(level));
        if b < t {
            break;
        }
        best = b;
    }
    best
}

/// The buckets a far job due at `run_at_ms` can sit in when the cascade point is `t`.
fn candidate_buckets(run_at_ms: i64, t: i64) -> Vec<i64> {
    let mut out: Vec<i64> = (0..LEVELS)
        .map(|l| align_down(run_at_ms, width(l)))
        .filter(|b| *b >= t)
        .collect();
    out.dedup();
    out
}

/// Order-preserving encoding of an i64 as 8 big-endian bytes.
fn ordered(ms: i64) -> [u8; 8] {
    ((ms as u64) ^ (1 << 63)).to_be_bytes()
}

fn from_ordered(b: [u8; 8]) -> i64 {
    (u64::from_be_bytes(b) ^ (1 << 63)) as i64
}

fn part(p: i32) -> [u8; 4] {
    (p as u32).to_be_bytes()
}

/// The key of the near run whose first job is at `k`.
fn n_key(k: &DueKey) -> ChunkKey {
    let mut out = [0u8; 21];
    out[0] = N;
    out[1..5].copy_from_slice(&part(k.partition));
    out[5..13].copy_from_slice(&ordered(k.run_at_ms));
    out[13..21].copy_from_slice(&k.seq.to_be_bytes());
    out
}

fn parse_n_key(b: &[u8]) -> Option<DueKey> {
    if b.len() != 21 || b[0] != N {
        return None;
    }
    Some(DueKey {
        partition: u32::from_be_bytes(b[1..5].try_into().ok()?) as i32,
        run_at_ms: from_ordered(b[5..13].try_into().ok()?),
        seq: u64::from_be_bytes(b[13..21].try_into().ok()?),
    })
}

/// The smallest near key of `partition`.
fn n_start(partition: i32) -> ChunkKey {
    n_key(&DueKey {
        run_at_ms: i64::MIN,
        partition,
        seq: 0,
    })
}

fn b_key(partition: i32, bucket: i64, chunk: u64) -> ChunkKey {
    let mut out = [0u8; 21];
    out[0] = B;
    out[1..5].copy_from_slice(&part(partition));
    out[5..13].copy_from_slice(&ordered(bucket));
    out[13..21].copy_from_slice(&chunk.to_be_bytes());
    out
}

fn b_prefix(partition: i32, bucket: i64) -> [u8; 13] {
    let mut out = [0u8; 13];
    out.copy_from_slice(&b_key(partition, bucket, 0)[..13]);
    out
}

fn bucket_of_b_key(k: &[u8]) -> Option<i64> {
    Some(from_ordered(k.get(5..13)?.try_into().ok()?))
}

fn j_key(partition: i32, id: &[u8; 16]) -> [u8; 21] {
    let mut out = [0u8; 21];
    out[0] = J;
    out[1..5].copy_from_slice(&part(partition));
    out[5..21].copy_from_slice(id);
    out
}

fn m_key(partition: i32) -> [u8; 5] {
    let mut out = [M, 0, 0, 0, 0];
    out[1..5].copy_from_slice(&part(partition));
    out
}

fn prefix(kind: u8, partition: i32) -> [u8; 5] {
    let mut out = [kind, 0, 0, 0, 0];
    out[1..5].copy_from_slice(&part(partition));
    out
}

// ------------------------------------------------------------------ chunks

/// The key of a far chunk, near run or id chunk.
type ChunkKey = [u8; 21];

fn chunk_key(k: &[u8]) -> Result<ChunkKey, CorruptJob> {
    k.try_into().map_err(|_| CorruptJob("chunk key"))
}

/// The greatest key in `[lo, hi]` (both of one kind and partition).
fn key_at_or_before(tree: &sled::Tree, lo: &ChunkKey, hi: &ChunkKey) -> Result<Option<ChunkKey>, StoreError> {
    match tree.range(&lo[..]..=&hi[..]).keys().next_back() {
        Some(k) => Ok(Some(chunk_key(&k?)?)),
        None => Ok(None),
    }
}

/// The first key after `key` of the same kind and partition (its first 5 bytes).
fn key_after(tree: &sled::Tree, key: &ChunkKey) -> Result<Option<ChunkKey>, StoreError> {
    use std::ops::Bound::{Excluded, Unbounded};
    let next = tree
        .range::<&[u8], _>((Excluded(&key[..]), Unbounded))
        .keys()
        .next()
        .transpose()?;
    Ok(next
        .filter(|k| k.len() == 21 && k[..5] == key[..5])
        .map(|k| chunk_key(&k))
        .transpose()?)
}

/// One encoded job inside a chunk or run, with the fields the store orders
/// and finds it by, read without decoding the rest: moving a job between
/// chunks copies its bytes and never decodes it.
#[derive(Clone, Debug)]
struct Raw {
    run_at_ms: i64,
    seq: u64,
    id: JobId,
    /// The chunk (or the job alone) the bytes sit in.
    buf: sled::IVec,
    at: usize,
    len: usize,
}

impl Raw {
    fn new(s: &StoredJob) -> Raw {
        let bytes = s.encode();
        Raw {
            run_at_ms: s.job.run_at.timestamp_millis(),
            seq: s.seq,
            id: s.job.id,
            len: bytes.len(),
            at: 0,
            buf: bytes.into(),
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }

    fn key(&self, partition: i32) -> DueKey {
        DueKey {
            run_at_ms: self.run_at_ms,
            partition,
            seq: self.seq,
        }
    }

    fn decode(&self) -> Result<StoredJob, CorruptJob> {
        StoredJob::decode(self.bytes())
    }
}

/// A far chunk or near run: `count u32, seq-min u64, seq-max u64`, then per
/// job `len u32, bytes`.
fn encode_chunk(out: &mut Vec<u8>, jobs: &[Raw]) {
    let min = jobs.iter().map(|j| j.seq).min().unwrap_or(0);
    let max = jobs.iter().map(|j| j.seq).max().unwrap_or(0);
    out.reserve(20 + jobs.iter().map(|j| j.len + 4).sum::<usize>());
    out.extend_from_slice(&(jobs.len() as u32).to_be_bytes());
    out.extend_from_slice(&min.to_be_bytes());
    out.extend_from_slice(&max.to_be_bytes());
    for j in jobs {
        out.extend_from_slice(&(j.len as u32).to_be_bytes());
        out.extend_from_slice(j.bytes());
    }
}

/// The seq range a chunk holds, from its header.
fn chunk_seq_range(v: &[u8]) -> Result<(u64, u64), CorruptJob> {
    let h = v.get(..20).ok_or(CorruptJob("chunk header"))?;
    Ok((
        u64::from_be_bytes(h[4..12].try_into().expect("8 bytes")),
        u64::from_be_bytes(h[12..20].try_into().expect("8 bytes")),
    ))
}

/// The jobs of a chunk, not decoded.
fn chunk_jobs(v: &sled::IVec) -> Result<Vec<Raw>, CorruptJob> {
    let h = v.get(..20).ok_or(CorruptJob("chunk header"))?;
    let n = u32::from_be_bytes(h[..4].try_into().expect("4 bytes")) as usize;
    let mut at = 20;
    let mut out = Vec::with_capacity(n.min(CHUNK_JOBS * 4));
    for _ in 0..n {
        let len = v.get(at..at + 4).ok_or(CorruptJob("chunk job length"))?;
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        at += 4;
        let b = v.get(at..at + len).ok_or(CorruptJob("chunk job"))?;
        let (id, seq, run_at_ms) = StoredJob::peek(b).ok_or(CorruptJob("chunk job"))?;
        out.push(Raw {
            run_at_ms,
            seq,
            id,
            buf: v.clone(),
            at,
            len,
        });
        at += len;
    }
    Ok(out)
}

/// What an entry carries after its pointer (see [`LogBatch::put_with`]):
/// the chunk's first 20 bytes, its header (count and seq range), so a seq
/// range check needs no log read.
fn inline_header(body: &[u8]) -> &[u8] {
    &body[..body.len().min(20)]
}

/// The chunk an entry points at.
fn read_chunk(log: &ValueLog, entry: &[u8]) -> Result<sled::IVec, StoreError> {
    Ok(log.read(&Ptr::decode(entry)?)?.into())
}

/// The jobs of the far chunk or near run an entry points at, not decoded.
fn load_jobs(log: &ValueLog, entry: &[u8]) -> Result<Vec<Raw>, StoreError> {
    Ok(chunk_jobs(&read_chunk(log, entry)?)?)
}

/// Remove `key`, whose current entry is `entry`.
fn remove_chunk(
    lb: &mut LogBatch,
    batch: &mut sled::Batch,
    key: &[u8],
    entry: &[u8],
) -> Result<(), CorruptJob> {
    // Removed now; a put of the same key in this batch is inserted after.
    lb.release(&Ptr::decode(entry)?);
    batch.remove(key);
    Ok(())
}

/// The chunk header an entry carries (see [`inline_header`]).
fn entry_header(entry: &[u8]) -> &[u8] {
    entry.get(PTR_LEN..).unwrap_or_default()
}

/// Split jobs into chunks of at most `max_jobs` jobs and about [`CHUNK_BYTES`].
fn chunked(jobs: Vec<Raw>, max_jobs: usize) -> Vec<Vec<Raw>> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut bytes = 0;
    for j in jobs {
        if !cur.is_empty() && (cur.len() >= max_jobs || bytes + j.len > CHUNK_BYTES) {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += j.len;
        cur.push(j);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Write far jobs as chunks per bucket, numbering the chunks from the checkpoint.
fn write_far(lb: &mut LogBatch, partition: i32, cp: &mut Checkpoint, far: BTreeMap<i64, Vec<Raw>>) {
    for (bucket, jobs) in far {
        for c in chunked(jobs, CHUNK_JOBS) {
            lb.put_with(&b_key(partition, bucket, cp.next_chunk), |b| encode_chunk(b, &c));
            cp.next_chunk += 1;
        }
    }
}

/// One partition's near runs as a batch sees them: the committed runs it
/// touched, with the batch's changes.
struct NearRuns<'a> {
    tree: &'a sled::Tree,
    log: &'a ValueLog,
    partition: i32,
    /// Touched runs by committed key (`None`: the first run of a partition
    /// that had none), with whether this batch changed them and their
    /// committed entry.
    runs: HashMap<Option<ChunkKey>, (Vec<Raw>, bool, Option<sled::IVec>)>,
    /// The last lookup: every key in `[from, until)` belongs to `run`.
    last: Option<(ChunkKey, Option<ChunkKey>, Option<ChunkKey>)>,
}

impl<'a> NearRuns<'a> {
    fn new(store: &'a Store, partition: i32) -> Self {
        NearRuns {
            tree: &store.tree,
            log: &store.log,
            partition,
            runs: HashMap::default(),
            last: None,
        }
    }

    /// The committed run that `k` belongs to (`None`: there is none yet),
    /// loaded.
    fn run_of(&mut self, k: &DueKey) -> Result<Option<ChunkKey>, StoreError> {
        let key = n_key(k);
        if let Some((from, until, run)) = self.last {
            if from <= key && until.is_none_or(|u| key < u) {
                return Ok(run);
            }
        }
        let start = n_start(self.partition);
        let (from, run) = match key_at_or_before(self.tree, &start, &key)? {
            Some(b) => (b, Some(b)),
            // Before every run: the first run, if any, takes it.
            None => (start, key_after(self.tree, &start)?),
        };
        let until = match run {
            Some(r) => key_after(self.tree, &r)?,
            None => None,
        };
        self.last = Some((from, until, run));
        if !self.runs.contains_key(&run) {
            let entry = match run {
                Some(r) => self.tree.get(r)?,
                None => None,
            };
            let jobs = match &entry {
                Some(e) => load_jobs(self.log, e)?,
                None => Vec::new(),
            };
            self.runs.insert(run, (jobs, false, entry));
        }
        Ok(run)
    }

    /// The near job `id` at `k`, if it is there.
    fn find(&mut self, k: &DueKey, id: &JobId) -> Result<Option<&Raw>, StoreError> {
        let run = self.run_of(k)?;
        let p = self.partition;
        Ok(self.runs[&run].0.iter().find(|j| j.key(p) == *k && j.id == *id))
    }

    /// Take the near job `id` at `k` out, if it is there.
    fn remove(&mut self, k: &DueKey, id: &JobId) -> Result<(), StoreError> {
        let run = self.run_of(k)?;
        let p = self.partition;
        let (jobs, dirty, _) = self.runs.get_mut(&run).expect("loaded");
        // Jobs fire in order, so the one to remove is usually the first.
        if let Some(i) = jobs.iter().position(|j| j.key(p) == *k && j.id == *id) {
            jobs.remove(i);
            *dirty = true;
        }
        Ok(())
    }

    fn add(&mut self, j: Raw) -> Result<(), StoreError> {
        let run = self.run_of(&j.key(self.partition))?;
        let (jobs, dirty, _) = self.runs.get_mut(&run).expect("loaded");
        jobs.push(j);
        *dirty = true;
        Ok(())
    }

    /// Rewrite every changed run under the key of its first job, split
    /// evenly into runs of at most [`NEAR_JOBS`]; remove runs left empty.
    fn write(self, lb: &mut LogBatch, batch: &mut sled::Batch) -> Result<(), CorruptJob> {
        let p = self.partition;
        let mut pieces = Vec::new();
        for (key, (mut jobs, dirty, entry)) in self.runs {
            if !dirty {
                continue;
            }
            if let (Some(key), Some(entry)) = (key, entry) {
                remove_chunk(lb, batch, &key, &entry)?;
            }
            jobs.sort_unstable_by_key(|j| (j.run_at_ms, j.seq));
            // Even pieces: a full run that gains one job splits in halves,
            // not into a full run and a run of one.
            let even = jobs.len().div_ceil(jobs.len().div_ceil(NEAR_JOBS).max(1));
            pieces.extend(chunked(jobs, even.max(1)));
        }
        // After every removal: a piece may take a removed run's key.
        for piece in pieces {
            lb.put_with(&n_key(&piece[0].key(p)), |b| encode_chunk(b, &piece));
        }
        Ok(())
    }
}

/// Where a job was put: id, run-at, seq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Hint {
    id: [u8; 16],
    run_at_ms: i64,
    seq: u64,
}

fn encode_hints(out: &mut Vec<u8>, hints: &[Hint]) {
    out.reserve(hints.len() * 32);
    for h in hints {
        out.extend_from_slice(&h.id);
        out.extend_from_slice(&ordered(h.run_at_ms));
        out.extend_from_slice(&h.seq.to_be_bytes());
    }
}

fn decode_hints(v: &[u8]) -> Result<Vec<Hint>, CorruptJob> {
    if v.len() % 32 != 0 {
        return Err(CorruptJob("id chunk length"));
    }
    Ok(v.chunks_exact(32)
        .map(|c| Hint {
            id: c[..16].try_into().expect("16 bytes"),
            run_at_ms: from_ordered(c[16..24].try_into().expect("8 bytes")),
            seq: u64::from_be_bytes(c[24..32].try_into().expect("8 bytes")),
        })
        .collect())
}

// ------------------------------------------------------------------ locations

/// Where a pending job is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Loc {
    /// In the near range at this key.
    Near(DueKey),
    /// In the far chunk with this key.
    Far {
        chunk: ChunkKey,
        run_at_ms: i64,
        seq: u64,
    },
    /// In a far chunk this batch writes.
    NewFar { bucket: i64, run_at_ms: i64, seq: u64 },
}

impl Loc {
    fn run_at_seq(&self) -> (i64, u64) {
        match self {
            Loc::Near(k) => (k.run_at_ms, k.seq),
            Loc::Far { run_at_ms, seq, .. } | Loc::NewFar { run_at_ms, seq, .. } => (*run_at_ms, *seq),
        }
    }
}

/// Reads (and, in a batch, buffers changes to) one partition's id hints.
struct Hints<'a> {
    tree: &'a sled::Tree,
    log: &'a ValueLog,
    partition: i32,
    /// Loaded id chunks by their first id (`[0; 16]` for the first chunk),
    /// with whether this batch changed them and their committed entry.
    chunks: HashMap<[u8; 16], (Vec<Hint>, bool, Option<sled::IVec>)>,
    /// Ids whose hint this batch wrote: never dropped as stale.
    touched: HashSet<[u8; 16]>,
    /// The last lookup: every id in `[from, until)` belongs to chunk `from`.
    last: Option<([u8; 16], Option<[u8; 16]>)>,
}

impl<'a> Hints<'a> {
    fn new(store: &'a Store, partition: i32) -> Self {
        Hints {
            tree: &store.tree,
            log: &store.log,
            partition,
            chunks: HashMap::default(),
            touched: HashSet::default(),
            last: None,
        }
    }

    /// The first id of the chunk holding `id`'s hint, loading the chunk.
    fn chunk_of(&mut self, id: &[u8; 16]) -> Result<[u8; 16], StoreError> {
        if let Some((from, until)) = self.last {
            if from <= *id && until.is_none_or(|u| *id < u) {
                return Ok(from);
            }
        }
        let id_of = |k: ChunkKey| -> [u8; 16] { k[5..21].try_into().expect("21-byte key") };
        let lo = j_key(self.partition, &[0u8; 16]);
        let start = key_at_or_before(self.tree, &lo, &j_key(self.partition, id))?.map_or([0u8; 16], id_of);
        let until = key_after(self.tree, &j_key(self.partition, &start))?.map(id_of);
        self.last = Some((start, until));
        if !self.chunks.contains_key(&start) {
            let entry = self.tree.get(j_key(self.partition, &start))?;
            let hints = match &entry {
                Some(e) => decode_hints(&read_chunk(self.log, e)?)?,
                None => Vec::new(),
            };
            self.chunks.insert(start, (hints, false, entry));
        }
        Ok(start)
    }

    /// Whether this batch changed any chunk.
    fn changed(&self) -> bool {
        self.chunks.values().any(|(_, dirty, _)| *dirty)
    }

    fn get(&mut self, id: &[u8; 16]) -> Result<Option<Hint>, StoreError> {
        let c = self.chunk_of(id)?;
        let hints = &self.chunks[&c].0;
        Ok(hints.binary_search_by(|h| h.id.cmp(id)).ok().map(|i| hints[i]))
    }

    fn set(&mut self, hint: Hint) -> Result<(), StoreError> {
        let c = self.chunk_of(&hint.id)?;
        let (hints, dirty, _) = self.chunks.get_mut(&c).expect("loaded");
        match hints.binary_search_by(|h| h.id.cmp(&hint.id)) {
            Ok(i) => hints[i] = hint,
            Err(i) => hints.insert(i, hint),
        }
        *dirty = true;
        self.touched.insert(hint.id);
        Ok(())
    }

    fn remove(&mut self, id: &[u8; 16]) -> Result<(), StoreError> {
        let c = self.chunk_of(id)?;
        let (hints, dirty, _) = self.chunks.get_mut(&c).expect("loaded");
        if let Ok(i) = hints.binary_search_by(|h| h.id.cmp(id)) {
            hints.remove(i);
            *dirty = true;
        }
        Ok(())
    }

    /// Write the changed chunks: stale hints dropped (due before both `t`
    /// and `first_near`, so neither near nor far), split when too big.
    fn write(
        self,
        lb: &mut LogBatch,
        batch: &mut sled::Batch,
        t: i64,
        first_near: i64,
    ) -> Result<(), CorruptJob> {
        let p = self.partition;
        for (start, (mut hints, dirty, entry)) in self.chunks {
            if !dirty {
                continue;
            }
            if let Some(entry) = entry {
                remove_chunk(lb, batch, &j_key(p, &start), &entry)?;
            }
            hints.retain(|h| self.touched.contains(&h.id) || h.run_at_ms >= t.min(first_near));
            for (i, piece) in hints.chunks(HINTS_PER_CHUNK).enumerate() {
                let key = if i == 0 { start } else { piece[0].id };
                lb.put_with(&j_key(p, &key), |b| encode_hints(b, piece));
            }
        }
        Ok(())
    }
}

/// One partition's view for locating jobs: the committed store plus this
/// batch's changes.
struct View<'a> {
    store: &'a Store,
    partition: i32,
    cp: Checkpoint,
    hints: Hints<'a>,
    near: NearRuns<'a>,
    /// Jobs this batch moved: where they are now (`None`: gone).
    overlay: HashMap<JobId, Option<Loc>>,
}

impl<'a> View<'a> {
    fn new(store: &'a Store, partition: i32) -> Result<Self, StoreError> {
        let mut cp = store.checkpoint(partition)?;
        if cp.cascaded_to == i64::MIN {
            // Never cascaded, so empty: any cascade point is right. The wall
            // clock's now keeps the first batches from landing in the widest
            // buckets (the scheduler cascades to its own clock on assignment).
            cp.cascaded_to = align_up(chrono::Utc::now().timestamp_millis(), width(0));
        }
        Ok(View {
            store,
            partition,
            cp,
            hints: Hints::new(store, partition),
            near: NearRuns::new(store, partition),
            overlay: HashMap::default(),
        })
    }

    /// Where the pending job `id` is, if it is pending.
    fn locate(&mut self, id: &JobId) -> Result<Option<Loc>, StoreError> {
        if let Some(o) = self.overlay.get(id) {
            return Ok(o.clone());
        }
        let Some(h) = self.hints.get(id.as_bytes())? else {
            return Ok(None);
        };
        let p = self.partition;
        if h.run_at_ms < self.cp.cascaded_to {
            let k = DueKey {
                run_at_ms: h.run_at_ms,
                partition: p,
                seq: h.seq,
            };
            return Ok(self.near.find(&k, id)?.map(|_| Loc::Near(k)));
        }
        for b in candidate_buckets(h.run_at_ms, self.cp.cascaded_to) {
            for item in self.store.tree.scan_prefix(b_prefix(p, b)) {
                let (k, v) = item?;
                let (lo, hi) = chunk_seq_range(entry_header(&v))?;
                if h.seq < lo || h.seq > hi {
                    continue;
                }
                let jobs = load_jobs(&self.store.log, &v)?;
                if jobs.iter().any(|j| j.seq == h.seq && j.id == *id) {
                    return Ok(Some(Loc::Far {
                        chunk: chunk_key(&k)?,
                        run_at_ms: h.run_at_ms,
                        seq: h.seq,
                    }));
                }
            }
        }
        Ok(None)
    }

    /// The job at a committed location.
    fn load(&mut self, loc: &Loc, id: &JobId) -> Result<Option<StoredJob>, StoreError> {
        Ok(match loc {
            Loc::Near(k) => self.near.find(k, id)?.map(Raw::decode).transpose()?,
            Loc::Far { chunk, seq, .. } => match self.store.tree.get(chunk)? {
                Some(v) => load_jobs(&self.store.log, &v)?
                    .into_iter()
                    .find(|j| j.seq == *seq && j.id == *id)
                    .map(|j| j.decode())
                    .transpose()?,
                None => None,
            },
            Loc::NewFar { .. } => None,
        })
    }
}

/// A batch of changes to one partition being built.
struct Writer<'a> {
    view: View<'a>,
    /// Far jobs this batch adds, by bucket.
    new_far: BTreeMap<i64, Vec<Raw>>,
    /// Seqs to take out of committed far chunks.
    far_removals: HashMap<ChunkKey, HashSet<u64>>,
    applied: Vec<Applied>,
}

impl<'a> Writer<'a> {
    fn remove(&mut self, id: JobId, loc: Loc) -> Result<(), StoreError> {
        match loc {
            Loc::Near(k) => {
                self.view.near.remove(&k, &id)?;
                self.applied.push(Applied::Removed(k, id));
            }
            Loc::Far { chunk, seq, .. } => {
                self.far_removals.entry(chunk).or_default().insert(seq);
            }
            Loc::NewFar { bucket, seq, .. } => {
                if let Some(v) = self.new_far.get_mut(&bucket) {
                    v.retain(|j| !(j.seq == seq && j.id == id));
                }
            }
        }
        self.view.cp.pending = self.view.cp.pending.saturating_sub(1);
        self.view.overlay.insert(id, None);
        Ok(())
    }

    fn add(&mut self, s: &StoredJob) -> Result<(), StoreError> {
        let p = self.view.partition;
        let run_at_ms = s.job.run_at.timestamp_millis();
        let t = self.view.cp.cascaded_to;
        let loc = if run_at_ms < t {
            let k = DueKey::of(p, s);
            self.view.near.add(Raw::new(s))?;
            self.applied.push(Applied::Added(k, s.clone()));
            Loc::Near(k)
        } else {
            let bucket = bucket_for(run_at_ms, t);
            self.new_far.entry(bucket).or_default().push(Raw::new(s));
            Loc::NewFar {
                bucket,
                run_at_ms,
                seq: s.seq,
            }
        };
        self.view.hints.set(Hint {
            id: *s.job.id.as_bytes(),
            run_at_ms,
            seq: s.seq,
        })?;
        self.view.cp.pending += 1;
        self.view.overlay.insert(s.job.id, Some(loc));
        Ok(())
    }

    fn change(&mut self, change: &Change) -> Result<(), StoreError> {
        match change {
            Change::Put(s) => {
                let here = (s.job.run_at.timestamp_millis(), s.seq);
                match self.view.locate(&s.job.id)? {
                    Some(loc) if loc.run_at_seq() == here => {} // the same job again
                    Some(loc) => {
                        self.remove(s.job.id, loc)?;
                        self.add(s)?;
                    }
                    None => self.add(s)?,
                }
            }
            Change::Delete(id) => {
                if let Some(loc) = self.view.locate(id)? {
                    self.remove(*id, loc)?;
                    self.view.hints.remove(id.as_bytes())?;
                }
            }
            Change::Fired(id, k) => {
                // The hint is left (hints are checked before they are
                // believed): looking it up would touch scattered id chunks.
                let here = match self.view.overlay.get(id) {
                    Some(o) => o.as_ref() == Some(&Loc::Near(*k)),
                    None => self.view.near.find(k, id)?.is_some(),
                };
                if here {
                    self.remove(*id, Loc::Near(*k))?;
                }
            }
        }
        Ok(())
    }

    fn store(&self) -> &'a Store {
        self.view.store
    }

    /// Turn the buffered changes into `lb` and `batch`.
    fn commit(
        mut self,
        changelog_next: Option<i64>,
        schedule_next: Option<i64>,
        lb: &mut LogBatch,
        batch: &mut sled::Batch,
    ) -> Result<Vec<Applied>, StoreError> {
        let p = self.view.partition;
        let store = self.store();
        let tree = &store.tree;
        for (chunk, seqs) in std::mem::take(&mut self.far_removals) {
            let Some(v) = tree.get(chunk)? else { continue };
            let left: Vec<Raw> = load_jobs(&store.log, &v)?
                .into_iter()
                .filter(|j| !seqs.contains(&j.seq))
                .collect();
            remove_chunk(lb, batch, &chunk, &v)?;
            if !left.is_empty() {
                lb.put_with(&chunk, |b| encode_chunk(b, &left));
            }
        }
        write_far(lb, p, &mut self.view.cp, std::mem::take(&mut self.new_far));
        // Only needed to drop stale hints from chunks this batch rewrites.
        let first_near = if self.view.hints.changed() {
            store.next_due(p)?.map_or(i64::MAX, |k| k.run_at_ms)
        } else {
            i64::MAX
        };
        let Writer { view, applied, .. } = self;
        let mut cp = view.cp;
        if let Some(next) = changelog_next {
            cp.changelog_next = cp.changelog_next.max(next);
        }
        if let Some(next) = schedule_next {
            cp.schedule_next = cp.schedule_next.max(next);
        }
        view.near.write(lb, batch)?;
        view.hints.write(lb, batch, cp.cascaded_to, first_near)?;
        batch.insert(&m_key(p)[..], &encode_checkpoint(&cp)[..]);
        Ok(applied)
    }
}

impl Store {
    /// Open (or create) the store in `dir`, with sled's page cache bounded
    /// to `cache_bytes`.
    pub fn open(dir: &Path, cache_bytes: u64) -> Result<Store, StoreError> {
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
            let (segment, bytes) = value_log::decode_live(&k, &v)?;
            live.insert(segment, bytes);
        }
        let log = ValueLog::open(&dir.join("values"), live)?;
        Ok(Store {
            db,
            tree,
            log,
            write: std::array::from_fn(|_| Mutex::new(())),
        })
    }

    /// The write lock of `partition`.
    fn lock(&self, partition: i32) -> std::sync::MutexGuard<'_, ()> {
        self.write[lock_index(partition)]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
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
        let _guards: Vec<_> = locks
            .into_iter()
            .map(|i| self.write[i].lock().unwrap_or_else(|e| e.into_inner()))
            .collect();
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

    /// Move the cascade point of `partition` towards `until_ms`: every far
    /// job due before the new point joins the near range, the rest of the
    /// buckets passed move one level finer. Bounded work per call (whole
    /// buckets, about [`CASCADE_CHUNKS`] chunks); returns the new cascade
    /// point (below `until_ms` when work is left).
    ///
    /// The jobs a cascade adds to the near range are due at or after the old
    /// cascade point, which no window has reached (a window only mirrors the
    /// near range below the cascade point it saw), so a window has nothing
    /// to follow.
    pub fn cascade(&self, partition: i32, until_ms: i64) -> Result<i64, StoreError> {
        let _guard = self.lock(partition);
        let mut cp = self.checkpoint(partition)?;
        let target = align_up(until_ms, width(0));
        if cp.cascaded_to == i64::MIN {
            // Never cascaded, so empty: start here.
            cp.cascaded_to = target;
            self.tree.insert(m_key(partition), &encode_checkpoint(&cp)[..])?;
            return Ok(target);
        }
        if cp.cascaded_to >= target {
            return Ok(cp.cascaded_to);
        }
        let lo = prefix(B, partition).to_vec();
        let hi = b_prefix(partition, target).to_vec();
        let mut taken: Vec<(sled::IVec, sled::IVec)> = Vec::new();
        let mut new_t = target;
        for item in self.tree.range(lo..hi) {
            let (k, v) = item?;
            let bucket = bucket_of_b_key(&k).ok_or(CorruptJob("far chunk key"))?;
            if taken.len() >= CASCADE_CHUNKS
                && taken.last().and_then(|(k, _)| bucket_of_b_key(k)) != Some(bucket)
            {
                new_t = bucket;
                break;
            }
            taken.push((k, v));
        }
        let mut batch = sled::Batch::default();
        let mut lb = self.log.begin();
        let mut far: BTreeMap<i64, Vec<Raw>> = BTreeMap::new();
        let mut near = NearRuns::new(self, partition);
        for (k, v) in &taken {
            remove_chunk(&mut lb, &mut batch, k, v)?;
            for j in load_jobs(&self.log, v)? {
                if j.run_at_ms < new_t {
                    near.add(j)?;
                } else {
                    far.entry(bucket_for(j.run_at_ms, new_t)).or_default().push(j);
                }
            }
        }
        near.write(&mut lb, &mut batch)?;
        write_far(&mut lb, partition, &mut cp, far);
        cp.cascaded_to = new_t;
        batch.insert(&m_key(partition)[..], &encode_checkpoint(&cp)[..]);
        lb.apply(&self.tree, batch, inline_header)?;
        Ok(new_t)
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

    /// Copy the chunks still live in mostly dead value-log segments (see
    /// `value_log`) to the head of the log, so that those segments are
    /// deleted at the next [`Store::flush`]. Moves about `max_bytes` at
    /// most (at least one segment's live bytes, when any is due); returns
    /// the bytes moved. Scans every chunk entry without a lock, then moves
    /// each partition's under its write lock, skipping entries a batch
    /// changed meanwhile.
    pub fn compact(&self, max_bytes: u64) -> Result<u64, StoreError> {
        let victims: HashSet<u32> = self.log.compaction_candidates(max_bytes).into_iter().collect();
        if victims.is_empty() {
            return Ok(0);
        }
        let mut found: BTreeMap<i32, Vec<(sled::IVec, sled::IVec)>> = BTreeMap::new();
        for kind in [N, B, J] {
            for item in self.tree.scan_prefix([kind]) {
                let (k, v) = item?;
                if victims.contains(&Ptr::decode(&v)?.segment()) {
                    let p = k.get(1..5).ok_or(CorruptJob("chunk key"))?;
                    let p = u32::from_be_bytes(p.try_into().expect("4 bytes")) as i32;
                    found.entry(p).or_default().push((k, v));
                }
            }
        }
        let mut moved = 0u64;
        for (p, entries) in found {
            let _guard = self.lock(p);
            let mut lb = self.log.begin();
            let mut batch = sled::Batch::default();
            for (k, v) in entries {
                if self.tree.get(&k)?.as_ref() != Some(&v) {
                    continue;
                }
                let body = read_chunk(&self.log, &v)?;
                remove_chunk(&mut lb, &mut batch, &k, &v)?;
                lb.put_with(&k, |b| b.extend_from_slice(&body));
                moved += body.len() as u64;
            }
            lb.apply(&self.tree, batch, inline_header)?;
        }
        tracing::debug!(segments = victims.len(), bytes = moved, "value log compacted");
        Ok(moved)
    }

    /// Make every applied batch durable (fsync).
    pub fn flush(&self) -> Result<(), StoreError> {
        let dead = self.log.sync()?;
        self.db.flush()?;
        self.log.delete(dead)?;
        Ok(())
    }

    /// Bytes the store takes on disk.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        Ok(self.db.size_on_disk()? + self.log.usage().0)
    }
}

fn encode_checkpoint(cp: &Checkpoint) -> [u8; 40] {
    let mut out = [0u8; 40];
    out[..8].copy_from_slice(&cp.changelog_next.to_be_bytes());
    out[8..16].copy_from_slice(&cp.pending.to_be_bytes());
    out[16..24].copy_from_slice(&cp.cascaded_to.to_be_bytes());
    out[24..32].copy_from_slice(&cp.next_chunk.to_be_bytes());
    out[32..40].copy_from_slice(&cp.schedule_next.to_be_bytes());
    out
}

/// Decodes both layouts: 40 bytes, and the 32 written before
/// `schedule_next` existed (read as 0: nothing is skipped).
fn decode_checkpoint(v: &[u8]) -> Result<Checkpoint, CorruptJob> {
    if v.len() != 32 && v.len() != 40 {
        return Err(CorruptJob("checkpoint length"));
    }
    let field = |i: usize| -> [u8; 8] { v[i * 8..i * 8 + 8].try_into().expect("8 bytes") };
    Ok(Checkpoint {
        changelog_next: i64::from_be_bytes(field(0)),
        pending: u64::from_be_bytes(field(1)),
        cascaded_to: i64::from_be_bytes(field(2)),
        next_chunk: u64::from_be_bytes(field(3)),
        schedule_next: if v.len() == 40 {
            i64::from_be_bytes(field(4))
        } else {
            0
        },
    })
}

#[cfg(test)]
impl Store {
    /// Entries of one kind for `partition` (tests).
    fn count(&self, kind: u8, partition: i32) -> usize {
        self.tree.scan_prefix(prefix(kind, partition)).count()
    }

    /// The value log's live counts match the pointers in sled, and every
    /// pointer's segment exists (tests).
    fn check_log(&self) {
        let mut sums: HashMap<u32, u64> = HashMap::default();
        for kind in [N, B, J] {
            for item in self.tree.scan_prefix([kind]) {
                let (_, v) = item.unwrap();
                let ptr = Ptr::decode(&v).unwrap();
                *sums.entry(ptr.segment()).or_default() += ptr.len();
            }
        }
        assert_eq!(sums, self.log.live(), "live counts against pointers");
        let files = self.log.segments();
        assert!(sums.keys().all(|id| files.contains(id)), "{sums:?} in {files:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Job;
    use chrono::{TimeZone, Utc};
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    fn job(key: &str, ms: i64) -> Job {
        Job::new("jobs", key, b"p".to_vec()).at(Utc.timestamp_millis_opt(ms).unwrap())
    }

    fn put(j: &Job, seq: u64) -> Change {
        Change::Put(StoredJob { job: j.clone(), seq })
    }

    fn open() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(dir.path(), 1 << 20).unwrap();
        (dir, s)
    }

    /// Open the store in `dir` again, once the dropped handle's file lock is
    /// gone (sled lets it go from a background thread shortly after the drop;
    /// the test failed once on a loaded machine opening too soon).
    fn reopen(dir: &Path) -> Result<Store, StoreError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match Store::open(dir, 1 << 20) {
                Err(StoreError::Sled(sled::Error::Io(e)))
                    if e.to_string().contains("could not acquire lock")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20))
                }
                r => return r,
            }
        }
    }

    /// Cascade `p` until its cascade point reaches `until`.
    fn cascade_to(s: &Store, p: i32, until: i64) {
        while s.cascade(p, until).unwrap() < until {}
    }

    fn near_ids(s: &Store, p: i32) -> Vec<JobId> {
        s.scan_due(p, None, i64::MAX, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(_, sj)| sj.job.id)
            .collect()
    }

    #[test]
    fn bucket_choice_starts_at_or_after_the_cascade_point_and_is_a_candidate() {
        let t = 1_000_448; // aligned to 1024
        for r in [
            t,
            t + 1,
            t + 5_000,
            t + 86_400_000,
            t + 2_592_000_000,
            253_402_300_799_999,
        ] {
            let b = bucket_for(r, t);
            assert!(b >= t && b <= r, "{r}: bucket {b}");
            assert!(candidate_buckets(r, t).contains(&b));
        }
        // A month ahead lands in a wide bucket, a second ahead in a narrow one.
        assert!(bucket_for(t + 2_592_000_000, t) < t + 2_592_000_000 - 86_400_000);
        assert_eq!(bucket_for(t + 1_500, t), align_down(t + 1_500, 1024));
    }

    #[test]
    fn scans_in_run_at_then_arrival_order_per_partition() {
        let (_d, s) = open();
        let a = job("a", 2000);
        let b = job("b", 1000);
        let c = job("c", 2000);
        let neg = job("n", -5);
        let far = job("f", 253_402_300_799_999);
        s.apply(
            0,
            &[put(&a, 1), put(&b, 2), put(&c, 3), put(&neg, 4), put(&far, 5)],
            None,
        )
        .unwrap();
        s.apply(1, &[put(&job("other", 0), 1)], None).unwrap();
        assert_eq!(
            near_ids(&s, 0),
            vec![neg.id, b.id, a.id, c.id],
            "due before now: near at once"
        );
        cascade_to(&s, 0, i64::MAX / 2);
        assert_eq!(near_ids(&s, 0), vec![neg.id, b.id, a.id, c.id, far.id]);
        let upto: Vec<_> = s.scan_due(0, None, 1999, 100).unwrap();
        assert_eq!(upto.len(), 2);
        let after = s.scan_due(0, Some(upto[1].0), 2000, 100).unwrap();
        assert_eq!(
            after.iter().map(|(_, j)| j.job.id).collect::<Vec<_>>(),
            vec![a.id, c.id]
        );
        assert_eq!(s.scan_due(0, None, i64::MAX, 2).unwrap().len(), 2);
        assert_eq!(s.checkpoint(0).unwrap().pending, 5);
        assert_eq!(s.next_due(0).unwrap().unwrap().run_at_ms, -5);
    }

    #[test]
    fn put_with_a_known_id_replaces_and_delete_removes_near_and_far() {
        let (_d, s) = open();
        cascade_to(&s, 0, 10_000);
        let a = job("a", 1000); // near
        s.apply(0, &[put(&a, 1)], Some(10)).unwrap();
        let moved = a.clone().at(Utc.timestamp_millis_opt(50_000_000).unwrap()); // far
        let applied = s.apply(0, &[put(&moved, 1)], Some(11)).unwrap();
        assert!(matches!(applied[..], [Applied::Removed(k, _)] if k.run_at_ms == 1000));
        let cp = s.checkpoint(0).unwrap();
        assert_eq!((cp.changelog_next, cp.pending), (11, 1));
        assert_eq!(s.current(0, &a.id).unwrap().unwrap().job, moved);
        assert!(near_ids(&s, 0).is_empty());
        // Back to near, then the same put again changes nothing.
        let applied = s.apply(0, &[put(&a, 1)], None).unwrap();
        assert!(matches!(applied[..], [Applied::Added(k, _)] if k.run_at_ms == 1000));
        assert!(s.apply(0, &[put(&a, 1)], None).unwrap().is_empty());
        assert_eq!(s.checkpoint(0).unwrap().pending, 1);
        assert_eq!(s.count(B, 0), 0, "the far copy was taken out of its chunk");
        let applied = s
            .apply(0, &[Change::Delete(a.id), Change::Delete(a.id)], None)
            .unwrap();
        assert_eq!(applied.len(), 1);
        assert!(near_ids(&s, 0).is_empty());
        assert_eq!(s.current(0, &a.id).unwrap(), None);
        assert_eq!(s.checkpoint(0).unwrap().pending, 0);
        // A far job is cancelled out of its chunk, leaving its neighbours.
        let f1 = job("f1", 90_000_000);
        let f2 = job("f2", 90_000_001);
        s.apply(0, &[put(&f1, 2), put(&f2, 3)], None).unwrap();
        s.apply(0, &[Change::Delete(f1.id)], None).unwrap();
        assert_eq!(s.current(0, &f1.id).unwrap(), None);
        assert_eq!(s.current(0, &f2.id).unwrap().unwrap().job, f2);
        cascade_to(&s, 0, 100_000_000);
        assert_eq!(near_ids(&s, 0), vec![f2.id]);
    }

    #[test]
    fn a_fired_job_is_deleted_only_if_not_replaced_meanwhile() {
        let (_d, s) = open();
        cascade_to(&s, 0, 20_000);
        let a = job("a", 1000);
        s.apply(0, &[put(&a, 1)], None).unwrap();
        let fired_at = s.scan_due(0, None, i64::MAX, 1).unwrap()[0].0;
        let moved = a.clone().at(Utc.timestamp_millis_opt(9000).unwrap());
        s.apply(0, &[put(&moved, 1)], None).unwrap();
        assert!(s
            .apply(0, &[Change::Fired(a.id, fired_at)], None)
            .unwrap()
            .is_empty());
        let (now_at, now_job) = s.scan_due(0, None, i64::MAX, 1).unwrap().remove(0);
        assert_eq!((now_at.run_at_ms, now_job.job), (9000, moved));
        assert_eq!(s.apply(0, &[Change::Fired(a.id, now_at)], None).unwrap().len(), 1);
        assert_eq!(s.checkpoint(0).unwrap().pending, 0);
        assert_eq!(s.current(0, &a.id).unwrap(), None, "a stale hint is not believed");
    }

    #[test]
    fn changes_within_one_batch_see_each_other() {
        let (_d, s) = open();
        cascade_to(&s, 0, 20_000);
        for ms in [1000, 80_000_000] {
            let a = job("a", ms);
            s.apply(0, &[put(&a, 1), Change::Delete(a.id), put(&a, 2)], None)
                .unwrap();
            assert_eq!(s.current(0, &a.id).unwrap().unwrap().seq, 2);
            assert_eq!(s.checkpoint(0).unwrap().pending, 1);
            s.apply(0, &[Change::Delete(a.id)], None).unwrap();
            assert_eq!(s.checkpoint(0).unwrap().pending, 0);
        }
        assert_eq!(s.count(N, 0) + s.count(B, 0), 0);
    }

    #[test]
    fn survives_reopen_and_clears_one_partition() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = reopen(dir.path()).unwrap();
            s.apply(0, &[put(&job("a", 1), 1)], Some(7)).unwrap();
            s.apply(1, &[put(&job("b", 1), 1)], Some(3)).unwrap();
            s.flush().unwrap();
        }
        let s = reopen(dir.path()).unwrap();
        let cp = s.checkpoint(0).unwrap();
        assert_eq!((cp.changelog_next, cp.pending), (7, 1));
        s.clear_partition(0).unwrap();
        assert!(!s.knows(0).unwrap());
        cascade_to(&s, 0, 10_000);
        cascade_to(&s, 1, 10_000);
        assert!(s.scan_due(0, None, i64::MAX, 10).unwrap().is_empty());
        assert_eq!(s.scan_due(1, None, i64::MAX, 10).unwrap().len(), 1);
    }

    /// Pending jobs as they should be, and random changes to them.
    struct Model {
        rng: rand::rngs::StdRng,
        jobs: HashMap<JobId, StoredJob>,
        ids: Vec<JobId>,
        seq: u64,
    }

    impl Model {
        fn new(seed: u64) -> Model {
            Model {
                rng: rand::rngs::StdRng::seed_from_u64(seed),
                jobs: HashMap::default(),
                ids: Vec::new(),
                seq: 0,
            }
        }

        /// `n` changes due in `now + span`: 8% cancels and 8% replaces of
        /// ids seen before, new jobs otherwise; the model follows them.
        fn changes(&mut self, n: usize, now: i64, span: std::ops::Range<i64>) -> Vec<Change> {
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                self.seq += 1;
                let roll = self.rng.gen_range(0..100);
                let ms = now + self.rng.gen_range(span.clone());
                let known = (!self.ids.is_empty()).then(|| self.ids[self.rng.gen_range(0..self.ids.len())]);
                match known {
                    Some(id) if roll < 8 => {
                        self.jobs.remove(&id);
                        out.push(Change::Delete(id));
                        continue;
                    }
                    Some(id) if roll < 16 => {
                        let sj = StoredJob {
                            job: job("r", ms).id(id),
                            seq: self.seq,
                        };
                        self.jobs.insert(id, sj.clone());
                        out.push(Change::Put(sj));
                        continue;
                    }
                    _ => {}
                }
                let sj = StoredJob {
                    job: job("k", ms),
                    seq: self.seq,
                };
                self.ids.push(sj.job.id);
                self.jobs.insert(sj.job.id, sj.clone());
                out.push(Change::Put(sj));
            }
            out
        }
    }

    /// Near runs under random puts (before, between and after existing
    /// runs), replaces, cancels and partial fires: the near range always
    /// scans as the model sorted by (run-at, seq), and stays a few entries.
    #[test]
    fn near_runs_model_check() {
        let (_d, s) = open();
        let mut m = Model::new(11);
        let mut now = 1_700_000_000_000i64;
        cascade_to(&s, 0, now + 1_000_000_000); // everything below is near
        for round in 0..60 {
            let n = m.rng.gen_range(1..400);
            s.apply(0, &m.changes(n, now, -2_000..60_000), None).unwrap();
            now += m.rng.gen_range(0..2_000);
            // Fire part of what is due, in order, as a capacity-bound window would.
            let limit = m.rng.gen_range(0..300);
            let due = s.scan_due(0, None, now, limit).unwrap();
            let (model, ids) = (&mut m.jobs, &m.ids);
            for (k, j) in &due {
                assert!(k.run_at_ms <= now, "round {round}: early");
                assert_eq!(model.remove(&j.job.id).map(|m| DueKey::of(0, &m)), Some(*k));
            }
            let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
            s.apply(0, &fires, None).unwrap();
            let mut want: Vec<(DueKey, JobId)> =
                model.values().map(|j| (DueKey::of(0, j), j.job.id)).collect();
            want.sort();
            let got: Vec<(DueKey, JobId)> = s
                .scan_due(0, None, i64::MAX, usize::MAX)
                .unwrap()
                .into_iter()
                .map(|(k, j)| (k, j.job.id))
                .collect();
            assert_eq!(got, want, "round {round}");
            assert_eq!(s.checkpoint(0).unwrap().pending, model.len() as u64);
            for id in ids.iter().step_by(17) {
                assert_eq!(s.current(0, id).unwrap(), model.get(id).cloned(), "round {round}");
            }
        }
        let model = &m.jobs;
        assert!(model.len() > 2_000);
        assert!(
            s.count(N, 0) * 16 < model.len(),
            "{} near runs for {} jobs",
            s.count(N, 0),
            model.len()
        );
    }

    /// Random puts, replaces, cancels and fires over a month, checked against
    /// a model at every step: nothing lost, nothing early, counts right, and
    /// few entries for many jobs.
    #[test]
    fn model_check_over_a_month_of_cascades() {
        let (d, mut s) = open();
        s.log.set_segment_bytes(32 << 10);
        let mut m = Model::new(7);
        let month = 30 * 86_400_000i64;
        let mut now = 1_700_000_000_000i64;
        cascade_to(&s, 0, now);
        let mut fired = 0usize;
        for round in 0..40 {
            s.apply(0, &m.changes(250, now, -1000..month), None).unwrap();
            // Time moves; fire everything due, as the dispatcher would.
            now += m.rng.gen_range(0..month / 20);
            let (model, ids) = (&mut m.jobs, &m.ids);
            cascade_to(&s, 0, now + 1);
            let due = s.scan_due(0, None, now, usize::MAX).unwrap();
            let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
            for (k, j) in &due {
                let m = model
                    .remove(&j.job.id)
                    .expect("fired job is pending in the model");
                assert_eq!(
                    (m.seq, m.job.run_at.timestamp_millis()),
                    (k.seq, k.run_at_ms),
                    "round {round}"
                );
                assert!(k.run_at_ms <= now);
            }
            fired += due.len();
            s.apply(0, &fires, None).unwrap();
            assert!(
                model.values().all(|j| j.job.run_at.timestamp_millis() > now),
                "round {round}: a due job was missed"
            );
            assert_eq!(
                s.checkpoint(0).unwrap().pending,
                model.len() as u64,
                "round {round}"
            );
            for id in ids.iter().step_by(37) {
                assert_eq!(s.current(0, id).unwrap(), model.get(id).cloned(), "round {round}");
            }
            // The value log: compacted now and then, reopened now and then
            // (as after a kill: whatever was flushed).
            s.check_log();
            if round % 3 == 0 {
                s.compact(64 << 10).unwrap();
                s.check_log();
            }
            s.flush().unwrap();
            if round % 7 == 6 {
                drop(s);
                s = reopen(d.path()).unwrap();
                s.log.set_segment_bytes(32 << 10);
                s.check_log();
            }
        }
        assert!(fired > 1000);
        let model = &m.jobs;
        let entries = s.count(N, 0) + s.count(B, 0) + s.count(J, 0);
        assert!(
            entries * 4 < model.len(),
            "{entries} entries for {} pending jobs",
            model.len()
        );
        // Everything left fires, in order, once.
        cascade_to(&s, 0, i64::MAX / 2);
        let rest: BTreeMap<DueKey, JobId> = s
            .scan_due(0, None, i64::MAX, usize::MAX)
            .unwrap()
            .into_iter()
            .map(|(k, j)| (k, j.job.id))
            .collect();
        assert_eq!(rest.len(), model.len());
        assert!(rest.values().all(|id| model.contains_key(id)));
    }

    /// Emptied segments are deleted after a flush; segments kept alive by a
    /// few far jobs are compacted away; orphan segment files go on open; a
    /// damaged chunk is an error, never a wrong job.
    #[test]
    fn value_log_segments_are_deleted_compacted_and_checked() {
        let (d, s) = open();
        s.log.set_segment_bytes(16 << 10);
        let now = 1_700_000_000_000i64;
        let year = 365 * 86_400_000i64;
        cascade_to(&s, 0, now);
        let mut far_ids = Vec::new();
        for b in 0..20u64 {
            let mut changes: Vec<Change> = (0..100u64)
                .map(|i| put(&job("n", now + 5_000 + i as i64), b * 1000 + i))
                .collect();
            let far = job("f", now + year + b as i64);
            far_ids.push(far.id);
            changes.push(put(&far, b * 1000 + 999));
            s.apply(0, &changes, None).unwrap();
            s.flush().unwrap();
        }
        let segments_before = s.log.segments().len();
        assert!(segments_before >= 5, "{segments_before} segments");
        cascade_to(&s, 0, now + 10_000);
        let due = s.scan_due(0, None, now + 10_000, usize::MAX).unwrap();
        assert_eq!(due.len(), 2000);
        let fires: Vec<Change> = due.iter().map(|(k, j)| Change::Fired(j.job.id, *k)).collect();
        s.apply(0, &fires, None).unwrap();
        s.flush().unwrap();
        s.check_log();
        while s.compact(1 << 20).unwrap() > 0 {
            s.flush().unwrap();
        }
        s.flush().unwrap();
        s.check_log();
        let (written, live) = s.log.usage();
        assert!(
            s.log.segments().len() <= 3 && written < 4 * live.max(16 << 10),
            "{:?} segments, {written} bytes written for {live} live",
            s.log.segments()
        );
        for id in &far_ids {
            assert!(s.current(0, id).unwrap().is_some(), "far job {id} kept");
        }
        let dir = s.log.dir().to_path_buf();
        drop(s);

        // An orphan (a batch cut off by a crash) goes on open.
        std::fs::write(dir.join("0000999999.seg"), b"orphan").unwrap();
        let s = reopen(d.path()).unwrap();
        assert!(!dir.join("0000999999.seg").exists());
        s.check_log();
        for id in &far_ids {
            assert!(
                s.current(0, id).unwrap().is_some(),
                "far job {id} kept after reopen"
            );
        }
        // A damaged byte in a live segment: reads fail with a checksum error.
        let live_segment = *s.log.live().keys().next().unwrap();
        let path = dir.join(format!("{live_segment:010}.seg"));
        let mut bytes = std::fs::read(&path).unwrap();
        for b in bytes.iter_mut() {
            *b ^= 0x5a;
        }
        std::fs::write(&path, bytes).unwrap();
        let errors = far_ids.iter().filter(|id| s.current(0, id).is_err()).count();
        assert!(errors > 0, "a damaged segment was read without error");
        drop(s);
        // A segment the store points into, gone: the store does not open.
        std::fs::remove_file(&path).unwrap();
        assert!(reopen(d.path()).is_err());
    }
}
