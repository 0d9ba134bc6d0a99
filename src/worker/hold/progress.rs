//! Exactly-once progress of a partition whose keys can be held, as a
//! held-topic record: which offsets above the committed one are done.
//!
//! In exactly-once mode a held key's state is committed with the writes of
//! every job it counts, in the next transaction, not once the partition's
//! commit point passes them (a hold that counts a job must never be
//! committed without that job's writes, and a job above the commit point
//! may still be read again). Those jobs' writes are then committed above
//! the commit point, and this record, in the same transaction, says so:
//! the partition's next owner skips them instead of running them again.
//!
//! Key: the writer's claim (16 hex digits and a `/`), work topic, a `0x01`
//! byte (a hold's key has a zero byte there: the two never mix); value:
//! [`Done`] as JSON; partition = the work partition.

use serde::{Deserialize, Serialize};

use crate::wire::OwnedRecord;

/// The offsets from a commit point up to `to` that are done: all but
/// `open` (ascending).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {
    /// The first offset not read when it was written.
    pub to: i64,
    /// Offsets below `to` not done then, ascending.
    pub open: Vec<i64>,
}

impl Done {
    /// Whether the record at `offset` was done (its writes committed).
    pub fn contains(&self, offset: i64) -> bool {
        offset < self.to && self.open.binary_search(&offset).is_err()
    }
}

/// The held-topic record key of work topic `topic`'s progress under
/// `claim`.
pub fn record_key(claim: u64, topic: &str) -> Vec<u8> {
    let mut out = format!("{claim:016x}/{topic}").into_bytes();
    out.push(1);
    out
}

/// A progress record key's claim and work topic (`None`: not one).
pub fn split_key(record_key: &[u8]) -> Option<(u64, &str)> {
    let head = record_key.strip_suffix(&[1])?;
    let head = std::str::from_utf8(head).ok()?;
    let (hex, topic) = head.split_once('/')?;
    if hex.len() != 16 || topic.contains('\0') {
        return None;
    }
    Some((u64::from_str_radix(hex, 16).ok()?, topic))
}

/// The record of `done` for `topic` under `claim`, for held topic `held`.
pub fn record(held: &str, claim: u64, topic: &str, done: &Done) -> OwnedRecord {
    OwnedRecord {
        topic: held.to_string(),
        key: record_key(claim, topic),
        value: Some(serde_json::to_vec(done).expect("progress serializes")),
        headers: Vec::new(),
    }
}

/// A progress record's value.
pub fn decode(value: Option<&[u8]>) -> Result<Option<Done>, serde_json::Error> {
    value.map(serde_json::from_slice).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_never_read_as_a_hold() {
        let k = record_key(0xab, "orders");
        assert_eq!(split_key(&k), Some((0xab, "orders")));
        assert_eq!(super::super::record::split_key(&k), None, "no hold");
        let hold = super::super::record::record_key(Some(0xab), "orders", b"");
        assert_eq!(split_key(&hold), None, "a hold is not progress");
        assert_eq!(split_key(b"zz/orders\x01"), None);
    }

    #[test]
    fn done_is_every_offset_below_its_end_but_the_open_ones() {
        let done = Done {
            to: 10,
            open: vec![4, 7],
        };
        let got: Vec<i64> = (0..12).filter(|o| done.contains(*o)).collect();
        assert_eq!(got, vec![0, 1, 2, 3, 5, 6, 8, 9]);
        let rec = record("held", 1, "t", &done);
        assert_eq!(decode(rec.value.as_deref()).unwrap(), Some(done));
        assert_eq!(decode(None).unwrap(), None);
        assert!(decode(Some(b"{")).is_err());
    }
}
