//! The chunk codec: far chunks and near runs as length-prefixed job bytes
//! behind a small header, moved between chunks without decoding.

use std::collections::BTreeMap;

use super::checkpoint::Checkpoint;
use super::keys::b_key;
use super::value_log::{LogBatch, Ptr, ValueLog, PTR_LEN};
use super::{DueKey, StoreError};

use crate::job::JobId;
use crate::scheduler::stored::{CorruptJob, StoredJob};

/// Most jobs in one far chunk, and a soft bound on its bytes.
pub(super) const CHUNK_JOBS: usize = 256;
pub(super) const CHUNK_BYTES: usize = 64 << 10;

/// One encoded job inside a chunk or run, with the fields the store orders
/// and finds it by, read without decoding the rest: moving a job between
/// chunks copies its bytes and never decodes it.
#[derive(Clone, Debug)]
pub(super) struct Raw {
    pub(super) run_at_ms: i64,
    pub(super) seq: u64,
    pub(super) id: JobId,
    /// The chunk (or the job alone) the bytes sit in.
    pub(super) buf: sled::IVec,
    pub(super) at: usize,
    pub(super) len: usize,
}

impl Raw {
    pub(super) fn new(s: &StoredJob) -> Raw {
        let bytes = s.encode();
        Raw {
            run_at_ms: s.job.run_at.timestamp_millis(),
            seq: s.seq,
            id: s.job.stored_id(),
            len: bytes.len(),
            at: 0,
            buf: bytes.into(),
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }

    pub(super) fn key(&self, partition: i32) -> DueKey {
        DueKey {
            run_at_ms: self.run_at_ms,
            partition,
            seq: self.seq,
        }
    }

    pub(super) fn decode(&self) -> Result<StoredJob, CorruptJob> {
        StoredJob::decode(self.bytes())
    }
}

/// A far chunk or near run: `count u32, seq-min u64, seq-max u64`, then per
/// job `len u32, bytes`.
pub(super) fn encode_chunk(out: &mut Vec<u8>, jobs: &[Raw]) {
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

/// The seqs a chunk holds lie in this range, from its header.
pub(super) fn chunk_seq_range(v: &[u8]) -> Result<std::ops::RangeInclusive<u64>, CorruptJob> {
    let h = v.get(..20).ok_or(CorruptJob("chunk header"))?;
    let lo = u64::from_be_bytes(h[4..12].try_into().expect("8 bytes"));
    let hi = u64::from_be_bytes(h[12..20].try_into().expect("8 bytes"));
    Ok(lo..=hi)
}

/// The jobs of a chunk, not decoded.
pub(super) fn chunk_jobs(v: &sled::IVec) -> Result<Vec<Raw>, CorruptJob> {
    let h = v.get(..20).ok_or(CorruptJob("chunk header"))?;
    let n = u32::from_be_bytes(h[..4].try_into().expect("4 bytes")) as usize;
    let mut at = 20;
    let mut out = Vec::with_capacity(n.min(CHUNK_JOBS * 4));
    for _ in 0..n {
        let len = v.get(at..at + 4).ok_or(CorruptJob("chunk job length"))?;
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        at += 4;
        let b = v.get(at..at + len).ok_or(CorruptJob("chunk job"))?;
        let crate::scheduler::stored::Peeked { id, seq, run_at_ms } =
            StoredJob::peek(b).ok_or(CorruptJob("chunk job"))?;
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
pub(super) fn inline_header(body: &[u8]) -> &[u8] {
    &body[..body.len().min(20)]
}

/// The chunk an entry points at.
pub(super) fn read_chunk(log: &ValueLog, entry: &[u8]) -> Result<sled::IVec, StoreError> {
    Ok(log.read(&Ptr::decode(entry)?)?.into())
}

/// The jobs of the far chunk or near run an entry points at, not decoded.
pub(super) fn load_jobs(log: &ValueLog, entry: &[u8]) -> Result<Vec<Raw>, StoreError> {
    Ok(chunk_jobs(&read_chunk(log, entry)?)?)
}

/// Remove `key`, whose current entry is `entry`.
pub(super) fn remove_chunk(
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

/// How many jobs the chunk an entry points at holds, from its inline header.
pub(super) fn entry_count(entry: &[u8]) -> Result<u32, CorruptJob> {
    let h = entry_header(entry).get(..4).ok_or(CorruptJob("chunk header"))?;
    Ok(u32::from_be_bytes(h.try_into().expect("4 bytes")))
}

/// The chunk header an entry carries (see [`inline_header`]).
pub(super) fn entry_header(entry: &[u8]) -> &[u8] {
    entry.get(PTR_LEN..).unwrap_or_default()
}

/// Split jobs into chunks of at most `max_jobs` jobs and about [`CHUNK_BYTES`].
pub(super) fn chunked(jobs: Vec<Raw>, max_jobs: usize) -> Vec<Vec<Raw>> {
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
pub(super) fn write_far(
    lb: &mut LogBatch,
    partition: i32,
    cp: &mut Checkpoint,
    far: BTreeMap<i64, Vec<Raw>>,
) {
    for (bucket, jobs) in far {
        for c in chunked(jobs, CHUNK_JOBS) {
            lb.put_with(&b_key(partition, bucket, cp.next_chunk), |b| encode_chunk(b, &c));
            cp.next_chunk += 1;
        }
    }
}
