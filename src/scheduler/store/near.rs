//! Near runs: sorted, non-overlapping runs of up to [`NEAR_JOBS`] jobs due
//! before the cascade point, as one batch sees and changes them.

use super::chunk::{chunked, encode_chunk, load_jobs, remove_chunk, Raw};
use super::keys::{key_after, key_at_or_before, n_key, n_start, ChunkKey};
use super::value_log::{LogBatch, ValueLog};
use super::{DueKey, Store, StoreError};

use crate::hash::HashMap;
use crate::job::JobId;
use crate::scheduler::stored::CorruptJob;

/// Most jobs in one near run.
pub(super) const NEAR_JOBS: usize = 64;

/// One partition's near runs as a batch sees them: the committed runs it
/// touched, with the batch's changes.
pub(super) struct NearRuns<'a> {
    pub(super) tree: &'a sled::Tree,
    pub(super) log: &'a ValueLog,
    pub(super) partition: i32,
    /// Touched runs by committed key (`None`: the first run of a partition
    /// that had none), with whether this batch changed them and their
    /// committed entry.
    pub(super) runs: HashMap<Option<ChunkKey>, (Vec<Raw>, bool, Option<sled::IVec>)>,
    /// The last lookup: every key in `[from, until)` belongs to `run`.
    pub(super) last: Option<(ChunkKey, Option<ChunkKey>, Option<ChunkKey>)>,
}

impl<'a> NearRuns<'a> {
    pub(super) fn new(store: &'a Store, partition: i32) -> Self {
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
    pub(super) fn run_of(&mut self, k: &DueKey) -> Result<Option<ChunkKey>, StoreError> {
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
    pub(super) fn find(&mut self, k: &DueKey, id: &JobId) -> Result<Option<&Raw>, StoreError> {
        let run = self.run_of(k)?;
        let p = self.partition;
        Ok(self.runs[&run].0.iter().find(|j| j.key(p) == *k && j.id == *id))
    }

    /// Take the near job `id` at `k` out, if it is there.
    pub(super) fn remove(&mut self, k: &DueKey, id: &JobId) -> Result<(), StoreError> {
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

    pub(super) fn add(&mut self, j: Raw) -> Result<(), StoreError> {
        let run = self.run_of(&j.key(self.partition))?;
        let (jobs, dirty, _) = self.runs.get_mut(&run).expect("loaded");
        jobs.push(j);
        *dirty = true;
        Ok(())
    }

    /// Rewrite every changed run under the key of its first job, split
    /// evenly into runs of at most [`NEAR_JOBS`]; remove runs left empty.
    pub(super) fn write(self, lb: &mut LogBatch, batch: &mut sled::Batch) -> Result<(), CorruptJob> {
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
