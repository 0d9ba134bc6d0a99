//! Id hints: where each job was put (run-at, seq), in sorted chunks of up
//! to [`HINTS_PER_CHUNK`], for cancel, reschedule and replace by id.

use super::chunk::{read_chunk, remove_chunk};
use super::keys::{from_ordered, j_key, key_after, key_at_or_before, ordered, ChunkKey};
use super::value_log::{LogBatch, ValueLog};
use super::{Store, StoreError};

use crate::hash::{HashMap, HashSet};
use crate::scheduler::stored::CorruptJob;

/// Most hints in one id chunk before it splits.
pub(super) const HINTS_PER_CHUNK: usize = 1024;

/// Where a job was put: id, run-at, seq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hint {
    pub(super) id: [u8; 16],
    pub(super) run_at_ms: i64,
    pub(super) seq: u64,
}

pub(super) fn encode_hints(out: &mut Vec<u8>, hints: &[Hint]) {
    out.reserve(hints.len() * 32);
    for h in hints {
        out.extend_from_slice(&h.id);
        out.extend_from_slice(&ordered(h.run_at_ms));
        out.extend_from_slice(&h.seq.to_be_bytes());
    }
}

pub(super) fn decode_hints(v: &[u8]) -> Result<Vec<Hint>, CorruptJob> {
    if !v.len().is_multiple_of(32) {
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

/// Reads (and, in a batch, buffers changes to) one partition's id hints.
pub(super) struct Hints<'a> {
    pub(super) tree: &'a sled::Tree,
    pub(super) log: &'a ValueLog,
    pub(super) partition: i32,
    /// Loaded id chunks by their first id (`[0; 16]` for the first chunk),
    /// with whether this batch changed them and their committed entry.
    pub(super) chunks: HashMap<[u8; 16], (Vec<Hint>, bool, Option<sled::IVec>)>,
    /// Ids whose hint this batch wrote: never dropped as stale.
    pub(super) touched: HashSet<[u8; 16]>,
    /// The last lookup: every id in `[from, until)` belongs to chunk `from`.
    pub(super) last: Option<([u8; 16], Option<[u8; 16]>)>,
}

impl<'a> Hints<'a> {
    pub(super) fn new(store: &'a Store, partition: i32) -> Self {
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
    pub(super) fn chunk_of(&mut self, id: &[u8; 16]) -> Result<[u8; 16], StoreError> {
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
    pub(super) fn changed(&self) -> bool {
        self.chunks.values().any(|(_, dirty, _)| *dirty)
    }

    pub(super) fn get(&mut self, id: &[u8; 16]) -> Result<Option<Hint>, StoreError> {
        let c = self.chunk_of(id)?;
        let hints = &self.chunks[&c].0;
        Ok(hints.binary_search_by(|h| h.id.cmp(id)).ok().map(|i| hints[i]))
    }

    pub(super) fn set(&mut self, hint: Hint) -> Result<(), StoreError> {
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

    pub(super) fn remove(&mut self, id: &[u8; 16]) -> Result<(), StoreError> {
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
    pub(super) fn write(
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
