//! The batch overlay: one partition's committed state plus a batch's
//! changes ([`View`]), and the batch being built ([`Writer`]).

use std::collections::BTreeMap;

use super::buckets::{align_up, bucket_for, candidate_buckets, width};
use super::checkpoint::{encode_checkpoint, Checkpoint};
use super::chunk::{chunk_seq_range, encode_chunk, entry_header, load_jobs, remove_chunk, write_far, Raw};
use super::hints::{Hint, Hints};
use super::keys::{b_prefix, chunk_key, m_key, ChunkKey};
use super::near::NearRuns;
use super::value_log::LogBatch;
use super::{Applied, Change, DueKey, Store, StoreError};

use crate::hash::{HashMap, HashSet};
use crate::job::JobId;
use crate::scheduler::stored::StoredJob;

/// Where a pending job is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Loc {
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
    pub(super) fn run_at_seq(&self) -> (i64, u64) {
        match self {
            Loc::Near(k) => (k.run_at_ms, k.seq),
            Loc::Far { run_at_ms, seq, .. } | Loc::NewFar { run_at_ms, seq, .. } => (*run_at_ms, *seq),
        }
    }
}

/// One partition's view for locating jobs: the committed store plus this
/// batch's changes.
pub(super) struct View<'a> {
    pub(super) store: &'a Store,
    pub(super) partition: i32,
    pub(super) cp: Checkpoint,
    pub(super) hints: Hints<'a>,
    pub(super) near: NearRuns<'a>,
    /// Jobs this batch moved: where they are now (`None`: gone).
    pub(super) overlay: HashMap<JobId, Option<Loc>>,
}

impl<'a> View<'a> {
    pub(super) fn new(store: &'a Store, partition: i32) -> Result<Self, StoreError> {
        let mut cp = store.checkpoint(partition)?;
        if cp.cascaded_to == i64::MIN {
            // Never cascaded, so empty: any cascade point is right. The
            // store clock's now keeps the first batches from landing in the
            // widest buckets.
            cp.cascaded_to = align_up(store.now_ms(), width(0));
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
    pub(super) fn locate(&mut self, id: &JobId) -> Result<Option<Loc>, StoreError> {
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
                if !chunk_seq_range(entry_header(&v))?.contains(&h.seq) {
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
    pub(super) fn load(&mut self, loc: &Loc, id: &JobId) -> Result<Option<StoredJob>, StoreError> {
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
pub(super) struct Writer<'a> {
    pub(super) view: View<'a>,
    /// Far jobs this batch adds, by bucket.
    pub(super) new_far: BTreeMap<i64, Vec<Raw>>,
    /// Seqs to take out of committed far chunks.
    pub(super) far_removals: HashMap<ChunkKey, HashSet<u64>>,
    pub(super) applied: Vec<Applied>,
}

impl<'a> Writer<'a> {
    pub(super) fn remove(&mut self, id: JobId, loc: Loc) -> Result<(), StoreError> {
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

    pub(super) fn add(&mut self, s: &StoredJob) -> Result<(), StoreError> {
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
            id: *s.job.stored_id().as_bytes(),
            run_at_ms,
            seq: s.seq,
        })?;
        self.view.cp.pending += 1;
        self.view.overlay.insert(s.job.stored_id(), Some(loc));
        Ok(())
    }

    pub(super) fn change(&mut self, change: &Change) -> Result<(), StoreError> {
        match change {
            Change::Put(s) => {
                let here = (s.job.run_at.timestamp_millis(), s.seq);
                match self.view.locate(&s.job.stored_id())? {
                    Some(loc) if loc.run_at_seq() == here => {} // the same job again
                    Some(loc) => {
                        self.remove(s.job.stored_id(), loc)?;
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

    pub(super) fn store(&self) -> &'a Store {
        self.view.store
    }

    /// Turn the buffered changes into `lb` and `batch`.
    pub(super) fn commit(
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
        cp.written_ms = store.now_ms();
        batch.insert(&m_key(p)[..], &encode_checkpoint(&cp)[..]);
        Ok(applied)
    }
}
