//! The cascade: far buckets move one level finer, or into the near range,
//! as the cascade point moves.

use std::collections::BTreeMap;

use super::buckets::{align_up, bucket_for, width};
use super::checkpoint::encode_checkpoint;
use super::chunk::{inline_header, load_jobs, remove_chunk, write_far, Raw};
use super::keys::{b_prefix, bucket_of_b_key, m_key, prefix, B};
use super::near::NearRuns;
use super::{Store, StoreError};

use crate::scheduler::stored::CorruptJob;

/// A cascade call moves at least this many far chunks (whole buckets) when
/// that many are due, and stops at the next bucket boundary after it.
pub(super) const CASCADE_CHUNKS: usize = 512;

impl Store {
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
            cp.written_ms = self.now_ms();
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
        cp.written_ms = self.now_ms();
        batch.insert(&m_key(partition)[..], &encode_checkpoint(&cp)[..]);
        lb.apply(&self.tree, batch, inline_header)?;
        Ok(new_t)
    }
}
