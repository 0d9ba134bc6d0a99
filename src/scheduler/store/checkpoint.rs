//! The per-partition checkpoint (`M` entry) and its encoding.

use crate::scheduler::stored::CorruptJob;

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
    /// When (ms, the store's clock) this checkpoint was last written: while
    /// the partition is owned, at least every cascade round. 0: unknown
    /// (a store written before this field existed).
    pub written_ms: i64,
}

impl Default for Checkpoint {
    fn default() -> Self {
        Checkpoint {
            changelog_next: 0,
            schedule_next: 0,
            pending: 0,
            cascaded_to: i64::MIN,
            next_chunk: 0,
            written_ms: 0,
        }
    }
}

pub(super) fn encode_checkpoint(cp: &Checkpoint) -> [u8; 48] {
    let mut out = [0u8; 48];
    out[..8].copy_from_slice(&cp.changelog_next.to_be_bytes());
    out[8..16].copy_from_slice(&cp.pending.to_be_bytes());
    out[16..24].copy_from_slice(&cp.cascaded_to.to_be_bytes());
    out[24..32].copy_from_slice(&cp.next_chunk.to_be_bytes());
    out[32..40].copy_from_slice(&cp.schedule_next.to_be_bytes());
    out[40..48].copy_from_slice(&cp.written_ms.to_be_bytes());
    out
}

/// Decodes every layout: 48 bytes; 40, written before `written_ms` existed
/// (read as 0: unknown); and 32, written before `schedule_next` existed
/// (read as 0: nothing is skipped).
pub(super) fn decode_checkpoint(v: &[u8]) -> Result<Checkpoint, CorruptJob> {
    if v.len() != 32 && v.len() != 40 && v.len() != 48 {
        return Err(CorruptJob("checkpoint length"));
    }
    let field = |i: usize| -> [u8; 8] { v[i * 8..i * 8 + 8].try_into().expect("8 bytes") };
    Ok(Checkpoint {
        changelog_next: i64::from_be_bytes(field(0)),
        pending: u64::from_be_bytes(field(1)),
        cascaded_to: i64::from_be_bytes(field(2)),
        next_chunk: u64::from_be_bytes(field(3)),
        schedule_next: if v.len() >= 40 {
            i64::from_be_bytes(field(4))
        } else {
            0
        },
        written_ms: if v.len() >= 48 {
            i64::from_be_bytes(field(5))
        } else {
            0
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_decodes() {
        let cp = Checkpoint {
            changelog_next: 7,
            schedule_next: 9,
            pending: 3,
            cascaded_to: -5,
            next_chunk: 11,
            written_ms: 1_700_000_000_000,
        };
        let bytes = encode_checkpoint(&cp);
        assert_eq!(decode_checkpoint(&bytes).unwrap(), cp);
        let before_written = decode_checkpoint(&bytes[..40]).unwrap();
        assert_eq!(before_written, Checkpoint { written_ms: 0, ..cp });
        let before_schedule_next = decode_checkpoint(&bytes[..32]).unwrap();
        assert_eq!(
            before_schedule_next,
            Checkpoint {
                written_ms: 0,
                schedule_next: 0,
                ..cp
            }
        );
        assert!(decode_checkpoint(&bytes[..39]).is_err());
    }
}
