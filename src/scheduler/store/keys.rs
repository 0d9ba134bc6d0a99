//! The whole key scheme of the store's one sled tree (see the table in
//! the parent module), and range lookups over it.

use super::{DueKey, StoreError};

use crate::scheduler::stored::CorruptJob;

pub(super) const N: u8 = b'N';
pub(super) const B: u8 = b'B';
pub(super) const J: u8 = b'J';
pub(super) const M: u8 = b'M';

/// Order-preserving encoding of an i64 as 8 big-endian bytes.
pub(super) fn ordered(ms: i64) -> [u8; 8] {
    ((ms as u64) ^ (1 << 63)).to_be_bytes()
}

pub(super) fn from_ordered(b: [u8; 8]) -> i64 {
    (u64::from_be_bytes(b) ^ (1 << 63)) as i64
}

pub(super) fn part(p: i32) -> [u8; 4] {
    (p as u32).to_be_bytes()
}

/// The key of the near run whose first job is at `k`.
pub(super) fn n_key(k: &DueKey) -> ChunkKey {
    let mut out = [0u8; 21];
    out[0] = N;
    out[1..5].copy_from_slice(&part(k.partition));
    out[5..13].copy_from_slice(&ordered(k.run_at_ms));
    out[13..21].copy_from_slice(&k.seq.to_be_bytes());
    out
}

pub(super) fn parse_n_key(b: &[u8]) -> Option<DueKey> {
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
pub(super) fn n_start(partition: i32) -> ChunkKey {
    n_key(&DueKey {
        run_at_ms: i64::MIN,
        partition,
        seq: 0,
    })
}

pub(super) fn b_key(partition: i32, bucket: i64, chunk: u64) -> ChunkKey {
    let mut out = [0u8; 21];
    out[0] = B;
    out[1..5].copy_from_slice(&part(partition));
    out[5..13].copy_from_slice(&ordered(bucket));
    out[13..21].copy_from_slice(&chunk.to_be_bytes());
    out
}

pub(super) fn b_prefix(partition: i32, bucket: i64) -> [u8; 13] {
    let mut out = [0u8; 13];
    out.copy_from_slice(&b_key(partition, bucket, 0)[..13]);
    out
}

pub(super) fn bucket_of_b_key(k: &[u8]) -> Option<i64> {
    Some(from_ordered(k.get(5..13)?.try_into().ok()?))
}

pub(super) fn j_key(partition: i32, id: &[u8; 16]) -> [u8; 21] {
    let mut out = [0u8; 21];
    out[0] = J;
    out[1..5].copy_from_slice(&part(partition));
    out[5..21].copy_from_slice(id);
    out
}

pub(super) fn m_key(partition: i32) -> [u8; 5] {
    let mut out = [M, 0, 0, 0, 0];
    out[1..5].copy_from_slice(&part(partition));
    out
}

pub(super) fn prefix(kind: u8, partition: i32) -> [u8; 5] {
    let mut out = [kind, 0, 0, 0, 0];
    out[1..5].copy_from_slice(&part(partition));
    out
}

/// The key of a far chunk, near run or id chunk.
pub(super) type ChunkKey = [u8; 21];

pub(super) fn chunk_key(k: &[u8]) -> Result<ChunkKey, CorruptJob> {
    k.try_into().map_err(|_| CorruptJob("chunk key"))
}

/// The greatest key in `[lo, hi]` (both of one kind and partition).
pub(super) fn key_at_or_before(
    tree: &sled::Tree,
    lo: &ChunkKey,
    hi: &ChunkKey,
) -> Result<Option<ChunkKey>, StoreError> {
    match tree.range(&lo[..]..=&hi[..]).keys().next_back() {
        Some(k) => Ok(Some(chunk_key(&k?)?)),
        None => Ok(None),
    }
}

/// The first key after `key` of the same kind and partition (its first 5 bytes).
pub(super) fn key_after(tree: &sled::Tree, key: &ChunkKey) -> Result<Option<ChunkKey>, StoreError> {
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
