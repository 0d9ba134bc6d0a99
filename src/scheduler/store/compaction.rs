//! Value-log compaction: live chunks of sparse segments copied forward.

use std::collections::BTreeMap;

use super::chunk::{inline_header, read_chunk, remove_chunk};
use super::keys::{B, J, N};
use super::value_log::Ptr;
use super::{Store, StoreError};

use crate::hash::HashSet;
use crate::scheduler::stored::CorruptJob;

impl Store {
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
}
