//! The scheduler's durable store of pending jobs, on sled. Nothing else in
//! Kairos touches sled.
//!
//! One sled tree holds three kinds of entries, told apart by a one-byte
//! prefix, so that every change of a batch (job, index entry, checkpoint)
//! lands atomically in one sled batch:
//!
//! | key | value |
//! |---|---|
//! | `D` partition run-at seq | the [`StoredJob`] (ordered by run-at, then arrival: a range scan yields due jobs in order) |
//! | `J` partition job-id | run-at and seq of the job's `D` entry (for cancel, reschedule, replace) |
//! | `M` partition | checkpoint: next changelog offset reflected here, and the pending count |
//!
//! Memory: sled's page cache is bounded by `cache_capacity`, but sled 0.34
//! also keeps per-page bookkeeping in memory for every page on disk, so RSS
//! grows with the number of pending jobs: about 53 bytes per job measured by
//! `benches/scheduler_memory.rs` (two entries per job, pages of a few
//! entries). Fewer, larger entries per job is the way to flatten it.

use std::path::Path;
use std::sync::Mutex;

use crate::job::JobId;
use crate::scheduler::stored::{CorruptJob, StoredJob};

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

/// One change to a partition's pending jobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add the job, replacing any pending job with the same id.
    Put(StoredJob),
    /// Drop the pending job with this id, if any.
    Delete(JobId),
    /// Drop the job that fired from this key, unless it has been replaced
    /// (rescheduled) since it was taken for firing.
    Fired(JobId, DueKey),
}

/// What a change did, for the in-memory window to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Applied {
    /// A job became pending at this key.
    Added(DueKey, StoredJob),
    /// The job pending at this key is gone (cancelled, replaced, fired).
    Removed(DueKey, JobId),
}

/// Per-partition checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// The next changelog offset not yet reflected in this store.
    pub changelog_next: i64,
    /// Jobs pending in the partition.
    pub pending: u64,
}

/// The durable store.
pub struct Store {
    /// The database (kept to flush and to report size).
    db: sled::Db,
    /// The one tree holding `D`, `J` and `M` entries.
    tree: sled::Tree,
    /// Serialises read-modify-write batches (ingest and dispatcher both write).
    write: Mutex<()>,
}

const D: u8 = b'D';
const J: u8 = b'J';
const M: u8 = b'M';

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

fn d_key(k: &DueKey) -> [u8; 21] {
    let mut out = [0u8; 21];
    out[0] = D;
    out[1..5].copy_from_slice(&part(k.partition));
    out[5..13].copy_from_slice(&ordered(k.run_at_ms));
    out[13..21].copy_from_slice(&k.seq.to_be_bytes());
    out
}

fn parse_d_key(b: &[u8]) -> Option<DueKey> {
    if b.len() != 21 || b[0] != D {
        return None;
    }
    Some(DueKey {
        partition: u32::from_be_bytes(b[1..5].try_into().ok()?) as i32,
        run_at_ms: from_ordered(b[5..13].try_into().ok()?),
        seq: u64::from_be_bytes(b[13..21].try_into().ok()?),
    })
}

fn j_key(partition: i32, id: &JobId) -> [u8; 21] {
    let mut out = [0u8; 21];
    out[0] = J;
    out[1..5].copy_from_slice(&part(partition));
    out[5..21].copy_from_slice(id.as_bytes());
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

impl Store {
    /// Open (or create) the store in `dir`, with sled's page cache bounded
    /// to `cache_bytes`.
    pub fn open(dir: &Path, cache_bytes: u64) -> Result<Store, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .flush_every_ms(None)
            .open()?;
        let tree = db.open_tree("pending")?;
        Ok(Store {
            db,
            tree,
            write: Mutex::new(()),
        })
    }

    /// Apply `changes` to `partition` as one atomic batch, optionally
    /// moving its changelog checkpoint. Durable after [`Store::flush`].
    pub fn apply(
        &self,
        partition: i32,
        changes: &[Change],
        changelog_next: Option<i64>,
    ) -> Result<Vec<Applied>, StoreError> {
        let _guard = self.write.lock().unwrap_or_else(|e| e.into_inner());
        let mut cp = self.checkpoint(partition)?;
        let mut batch = sled::Batch::default();
        // Entries changed earlier in this batch, which sled cannot read back yet.
        let mut overlay: std::collections::HashMap<JobId, Option<DueKey>> = Default::default();
        let mut applied = Vec::with_capacity(changes.len());
        for change in changes {
            let id = match change {
                Change::Put(s) => s.job.id,
                Change::Delete(id) | Change::Fired(id, _) => *id,
            };
            let current = match overlay.get(&id) {
                Some(k) => *k,
                None => self.lookup(partition, &id)?,
            };
            if let Change::Fired(_, fired_at) = change {
                if current != Some(*fired_at) {
                    continue;
                }
            }
            if let Some(old) = current {
                batch.remove(&d_key(&old)[..]);
                batch.remove(&j_key(partition, &id)[..]);
                cp.pending = cp.pending.saturating_sub(1);
                applied.push(Applied::Removed(old, id));
            }
            match change {
                Change::Put(s) => {
                    let k = DueKey {
                        run_at_ms: s.job.run_at.timestamp_millis(),
                        partition,
                        seq: s.seq,
                    };
                    batch.insert(&d_key(&k)[..], s.encode());
                    let mut loc = [0u8; 16];
                    loc[..8].copy_from_slice(&ordered(k.run_at_ms));
                    loc[8..].copy_from_slice(&k.seq.to_be_bytes());
                    batch.insert(&j_key(partition, &id)[..], &loc[..]);
                    cp.pending += 1;
                    overlay.insert(id, Some(k));
                    applied.push(Applied::Added(k, s.clone()));
                }
                Change::Delete(_) | Change::Fired(..) => {
                    overlay.insert(id, None);
                }
            }
        }
        if let Some(next) = changelog_next {
            cp.changelog_next = cp.changelog_next.max(next);
        }
        batch.insert(&m_key(partition)[..], &encode_checkpoint(&cp)[..]);
        self.tree.apply_batch(batch)?;
        Ok(applied)
    }

    /// Where the pending job `id` of `partition` sits, if it is pending.
    pub fn lookup(&self, partition: i32, id: &JobId) -> Result<Option<DueKey>, StoreError> {
        Ok(self.tree.get(j_key(partition, id))?.and_then(|v| {
            let v: [u8; 16] = v.as_ref().try_into().ok()?;
            Some(DueKey {
                run_at_ms: from_ordered(v[..8].try_into().ok()?),
                partition,
                seq: u64::from_be_bytes(v[8..].try_into().ok()?),
            })
        }))
    }

    /// The job pending at `key`, if any.
    pub fn get(&self, key: &DueKey) -> Result<Option<StoredJob>, StoreError> {
        match self.tree.get(d_key(key))? {
            Some(v) => Ok(Some(StoredJob::decode(&v)?)),
            None => Ok(None),
        }
    }

    /// Pending jobs of `partition` with run-at at most `until_ms`, in run-at
    /// then arrival order, strictly after `after` (when given), at most `limit`.
    pub fn scan_due(
        &self,
        partition: i32,
        after: Option<DueKey>,
        until_ms: i64,
        limit: usize,
    ) -> Result<Vec<(DueKey, StoredJob)>, StoreError> {
        let start: Vec<u8> = match after {
            Some(k) => {
                let mut v = d_key(&k).to_vec();
                v.push(0); // strictly after k
                v
            }
            None => prefix(D, partition).to_vec(),
        };
        let end = d_key(&DueKey {
            run_at_ms: until_ms,
            partition,
            seq: u64::MAX,
        });
        let mut out = Vec::new();
        for item in self.tree.range(start..=end.to_vec()) {
            if out.len() >= limit {
                break;
            }
            let (k, v) = item?;
            let Some(key) = parse_d_key(&k) else { continue };
            if key.partition != partition {
                break;
            }
            out.push((key, StoredJob::decode(&v)?));
        }
        Ok(out)
    }

    /// The earliest pending run-at of `partition`.
    pub fn next_due(&self, partition: i32) -> Result<Option<DueKey>, StoreError> {
        Ok(match self.tree.scan_prefix(prefix(D, partition)).next() {
            Some(item) => parse_d_key(&item?.0),
            None => None,
        })
    }

    /// Forget every pending job and the checkpoint of `partition` (before a
    /// rebuild from the changelog when the local copy cannot be trusted).
    pub fn clear_partition(&self, partition: i32) -> Result<(), StoreError> {
        let _guard = self.write.lock().unwrap_or_else(|e| e.into_inner());
        for kind in [D, J] {
            let mut batch = sled::Batch::default();
            let mut n = 0;
            for item in self.tree.scan_prefix(prefix(kind, partition)).keys() {
                batch.remove(item?);
                n += 1;
                if n % 10_000 == 0 {
                    self.tree.apply_batch(std::mem::take(&mut batch))?;
                }
            }
            self.tree.apply_batch(batch)?;
        }
        self.tree.remove(m_key(partition))?;
        Ok(())
    }

    /// The checkpoint of `partition` (all zero when the store has never held it).
    pub fn checkpoint(&self, partition: i32) -> Result<Checkpoint, StoreError> {
        Ok(match self.tree.get(m_key(partition))? {
            Some(v) if v.len() == 16 => Checkpoint {
                changelog_next: i64::from_be_bytes(v[..8].try_into().expect("8 bytes")),
                pending: u64::from_be_bytes(v[8..].try_into().expect("8 bytes")),
            },
            _ => Checkpoint::default(),
        })
    }

    /// Whether the store has ever held `partition`.
    pub fn knows(&self, partition: i32) -> Result<bool, StoreError> {
        Ok(self.tree.contains_key(m_key(partition))?)
    }

    /// Make every applied batch durable (fsync).
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    /// Make every applied batch durable, without blocking the async runtime.
    pub async fn flush_async(&self) -> Result<(), StoreError> {
        self.db.flush_async().await?;
        Ok(())
    }

    /// Bytes the store takes on disk.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        Ok(self.db.size_on_disk()?)
    }
}

fn encode_checkpoint(cp: &Checkpoint) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&cp.changelog_next.to_be_bytes());
    out[8..].copy_from_slice(&cp.pending.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Job;
    use chrono::{TimeZone, Utc};

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
        let got: Vec<_> = s
            .scan_due(0, None, i64::MAX, 100)
            .unwrap()
            .into_iter()
            .map(|(_, sj)| sj.job.id)
            .collect();
        assert_eq!(got, vec![neg.id, b.id, a.id, c.id, far.id]);
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
    fn put_with_a_known_id_replaces_and_delete_removes() {
        let (_d, s) = open();
        let a = job("a", 1000);
        s.apply(0, &[put(&a, 1)], Some(10)).unwrap();
        let moved = a.clone().at(Utc.timestamp_millis_opt(5000).unwrap());
        let applied = s.apply(0, &[put(&moved, 1)], Some(11)).unwrap();
        assert!(matches!(applied[0], Applied::Removed(k, _) if k.run_at_ms == 1000));
        assert!(matches!(applied[1], Applied::Added(k, _) if k.run_at_ms == 5000));
        assert_eq!(
            s.checkpoint(0).unwrap(),
            Checkpoint {
                changelog_next: 11,
                pending: 1
            }
        );
        assert_eq!(s.lookup(0, &a.id).unwrap().unwrap().run_at_ms, 5000);
        let applied = s
            .apply(0, &[Change::Delete(a.id), Change::Delete(a.id)], None)
            .unwrap();
        assert_eq!(applied.len(), 1);
        assert!(s.scan_due(0, None, i64::MAX, 10).unwrap().is_empty());
        assert_eq!(s.checkpoint(0).unwrap().pending, 0);
    }

    #[test]
    fn a_fired_job_is_deleted_only_if_not_replaced_meanwhile() {
        let (_d, s) = open();
        let a = job("a", 1000);
        s.apply(0, &[put(&a, 1)], None).unwrap();
        let fired_at = s.lookup(0, &a.id).unwrap().unwrap();
        let moved = a.clone().at(Utc.timestamp_millis_opt(9000).unwrap());
        s.apply(0, &[put(&moved, 1)], None).unwrap();
        assert!(s
            .apply(0, &[Change::Fired(a.id, fired_at)], None)
            .unwrap()
            .is_empty());
        assert_eq!(s.lookup(0, &a.id).unwrap().unwrap().run_at_ms, 9000);
        let now_at = s.lookup(0, &a.id).unwrap().unwrap();
        assert_eq!(s.get(&now_at).unwrap().unwrap().job, moved);
        assert_eq!(s.apply(0, &[Change::Fired(a.id, now_at)], None).unwrap().len(), 1);
        assert_eq!(s.checkpoint(0).unwrap().pending, 0);
    }

    #[test]
    fn changes_within_one_batch_see_each_other() {
        let (_d, s) = open();
        let a = job("a", 1000);
        let applied = s
            .apply(0, &[put(&a, 1), Change::Delete(a.id), put(&a, 2)], None)
            .unwrap();
        assert_eq!(applied.len(), 3);
        let left = s.scan_due(0, None, i64::MAX, 10).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].0.seq, 2);
        assert_eq!(s.checkpoint(0).unwrap().pending, 1);
    }

    #[test]
    fn survives_reopen_and_clears_one_partition() {
        let dir = tempfile::tempdir().unwrap();
        {
            let s = Store::open(dir.path(), 1 << 20).unwrap();
            s.apply(0, &[put(&job("a", 1), 1)], Some(7)).unwrap();
            s.apply(1, &[put(&job("b", 1), 1)], Some(3)).unwrap();
            s.flush().unwrap();
        }
        let s = Store::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(
            s.checkpoint(0).unwrap(),
            Checkpoint {
                changelog_next: 7,
                pending: 1
            }
        );
        s.clear_partition(0).unwrap();
        assert!(!s.knows(0).unwrap());
        assert!(s.scan_due(0, None, i64::MAX, 10).unwrap().is_empty());
        assert_eq!(s.scan_due(1, None, i64::MAX, 10).unwrap().len(), 1);
    }
}
