//! Counts of a partition's pending jobs by when they come due, and by work
//! topic: what the scheduler's metrics and `kairos stats` report.

use std::collections::BTreeMap;

use super::chunk::{self, load_jobs};
use super::keys::{self, parse_n_key, prefix, B, N};
use super::{Store, StoreError};
use crate::scheduler::stored::CorruptJob;

impl Store {
    /// Pending jobs of `partition` by when they come due: entry `i` counts
    /// the jobs before `edges[i]` (and at or after `edges[i - 1]`), the last
    /// entry those at or after the last edge (`edges` ascending, in ms).
    /// Counted from the entries' inline headers: only a near run that
    /// straddles an edge is read (at most one per edge). A far chunk counts
    /// at its bucket's start, so a far job may count in an earlier span than
    /// its run-at, never a later one.
    pub fn pending_by_due(&self, partition: i32, edges: &[i64]) -> Result<Vec<u64>, StoreError> {
        let mut out = vec![0u64; edges.len() + 1];
        let span = |at: i64| edges.partition_point(|e| *e <= at);
        let _pin = self.log.pin();
        // Near runs in order: a run spans from its first job to the next
        // run's first job.
        let mut prev: Option<(i64, sled::IVec)> = None;
        let mut count_run = |run: (i64, sled::IVec), next_at: Option<i64>| -> Result<(), StoreError> {
            let (at, entry) = run;
            let straddles = match next_at {
                Some(next) => span(at) != span(next.saturating_sub(1)),
                None => span(at) < edges.len(),
            };
            if straddles {
                for j in load_jobs(&self.log, &entry)? {
                    out[span(j.run_at_ms)] += 1;
                }
            } else {
                out[span(at)] += chunk::entry_count(&entry)? as u64;
            }
            Ok(())
        };
        for item in self.tree.scan_prefix(prefix(N, partition)) {
            let (k, v) = item?;
            let at = parse_n_key(&k).ok_or(CorruptJob("near run key"))?.run_at_ms;
            if let Some(run) = prev.replace((at, v)) {
                count_run(run, Some(at))?;
            }
        }
        if let Some(run) = prev {
            count_run(run, None)?;
        }
        for item in self.tree.scan_prefix(prefix(B, partition)) {
            let (k, v) = item?;
            let at = keys::bucket_of_b_key(&k).ok_or(CorruptJob("far chunk key"))?;
            out[span(at)] += chunk::entry_count(&v)? as u64;
        }
        Ok(out)
    }

    /// Pending jobs of `partition` per work topic, by when they come due
    /// (spans as in [`Store::pending_by_due`], but exact): every job is read,
    /// so this costs a pass over the partition's pending jobs.
    pub fn pending_by_topic(
        &self,
        partition: i32,
        edges: &[i64],
    ) -> Result<BTreeMap<String, Vec<u64>>, StoreError> {
        let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let _pin = self.log.pin();
        for kind in [N, B] {
            for item in self.tree.scan_prefix(prefix(kind, partition)) {
                let (_, v) = item?;
                for j in load_jobs(&self.log, &v)? {
                    let topic = j.decode()?.job.topic;
                    let spans = out.entry(topic).or_insert_with(|| vec![0; edges.len() + 1]);
                    spans[edges.partition_point(|e| *e <= j.run_at_ms)] += 1;
                }
            }
        }
        Ok(out)
    }
}
