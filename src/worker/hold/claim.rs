//! Whose held-topic records count: a partition's earlier owners fenced.
//!
//! Each ownership of a holdable work partition has a *claim*, a random
//! number its owner puts in the key of every held-topic record it writes
//! and in the metadata of every offset it commits for the partition.
//! Kafka takes a commit only from the member the group gave the partition
//! to, so the claim committed last names the ownership whose records count.
//! An earlier owner that still writes after it lost the partition (a write
//! queued in its client across a broker outage, a keeper round under way)
//! writes under its own claim: the next owner passes over those records,
//! and compaction never lets them replace the current owner's, since each
//! claim's records have keys of their own.
//!
//! A new owner reads back the records of the committed claim, writes the
//! holds again under its own claim, commits that claim (with the offset
//! committed already), then deletes every older record key it read. A
//! crash between those steps leaves the committed claim's records as they
//! were. Records without a claim (written before claims existed) count
//! while no claim has been committed for the partition.
//!
//! Pure and in memory; the worker service reads, writes and commits.

use crate::hash::HashMap;

use super::Hold;

/// The commit metadata naming `claim`.
pub fn metadata(claim: u64) -> String {
    format!("{PREFIX}{claim:016x}")
}

/// The claim named by commit metadata (`None`: none, or not Kairos's).
pub fn of_metadata(metadata: &str) -> Option<u64> {
    let hex = metadata.strip_prefix(PREFIX)?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

const PREFIX: &str = "kairos-claim=";

/// One partition's held-topic records read back, in log order: the holds
/// of the committed claim and every record key still live (to delete once
/// the new claim is committed).
pub struct ReadBack {
    committed: Option<u64>,
    holds: HashMap<Vec<u8>, Option<Hold>>,
    /// Record keys whose last record is not a tombstone, and whether they
    /// are of the committed claim.
    live: HashMap<Vec<u8>, bool>,
}

/// What a [`ReadBack`] found.
pub struct Found {
    /// The committed claim's holds, by entity key.
    pub holds: Vec<(Vec<u8>, Hold)>,
    /// Every record key read whose last record is not a tombstone: the
    /// committed claim's (written again under the new claim) and the
    /// others' (written after their owner lost the partition).
    pub to_delete: Vec<Vec<u8>>,
    /// Keys of other claims whose last record is not a tombstone (an
    /// earlier owner's writes that do not count).
    pub passed_over: usize,
}

impl ReadBack {
    /// Reading back under `committed`, the claim committed last for the
    /// partition (`None`: none).
    pub fn new(committed: Option<u64>) -> Self {
        ReadBack {
            committed,
            holds: HashMap::default(),
            live: HashMap::default(),
        }
    }

    /// The next record: its whole key, its claim, its entity key and its
    /// value (`Ok(None)`: a tombstone; `Err`: a value that did not decode,
    /// after which the key's last readable hold stands).
    pub fn record<E>(
        &mut self,
        record_key: &[u8],
        claim: Option<u64>,
        key: &[u8],
        value: Result<Option<Hold>, E>,
    ) {
        let counts = claim == self.committed;
        match value {
            Ok(None) => {
                self.live.remove(record_key);
                if counts {
                    self.holds.insert(key.to_vec(), None);
                }
            }
            Ok(Some(h)) => {
                self.live.insert(record_key.to_vec(), counts);
                if counts {
                    self.holds.insert(key.to_vec(), Some(h));
                }
            }
            Err(_) => {
                self.live.insert(record_key.to_vec(), counts);
            }
        }
    }

    /// What was found.
    pub fn finish(self) -> Found {
        Found {
            holds: self
                .holds
                .into_iter()
                .filter_map(|(k, h)| Some((k, h?)))
                .collect(),
            passed_over: self.live.values().filter(|counts| !**counts).count(),
            to_delete: self.live.into_keys().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold whose parked jobs are done up to `done`, as the held topic
    /// keeps it.
    fn hold(done: u32) -> Hold {
        let kept =
            format!(r#"{{"blocker":null,"last_seq":20,"done_seq":{done},"tail_at_ms":0,"since_ms":1}}"#);
        super::super::record::decode(Some(kept.as_bytes()))
            .unwrap()
            .unwrap()
    }

    type Value = Result<Option<Hold>, ()>;

    #[test]
    fn metadata_round_trips_and_others_name_no_claim() {
        assert_eq!(of_metadata(&metadata(0xfeed)), Some(0xfeed));
        assert_eq!(of_metadata(&metadata(u64::MAX)), Some(u64::MAX));
        assert_eq!(of_metadata(""), None);
        assert_eq!(of_metadata("kairos-claim=12"), None);
        assert_eq!(of_metadata("someone else's"), None);
    }

    /// The failure this fences: the owner before (claim 1) writes an older
    /// hold after the current owner (claim 2) wrote its own. The committed
    /// claim's record counts, wherever the other lands.
    #[test]
    fn a_record_of_an_earlier_claim_written_late_does_not_count() {
        let mut rb = ReadBack::new(Some(2));
        let late: Value = Ok(Some(hold(11)));
        rb.record(b"2/k", Some(2), b"k", Ok::<_, ()>(Some(hold(16))));
        rb.record(b"1/k", Some(1), b"k", late);
        let found = rb.finish();
        assert_eq!(found.holds.len(), 1);
        assert_eq!(found.holds[0].1.done_seq, 16, "the current owner's hold");
        assert_eq!(found.passed_over, 1);
        let mut dead = found.to_delete;
        dead.sort();
        assert_eq!(dead, [b"1/k".to_vec(), b"2/k".to_vec()]);
    }

    #[test]
    fn a_tombstone_of_the_committed_claim_lets_the_key_go() {
        let mut rb = ReadBack::new(Some(2));
        rb.record(b"2/k", Some(2), b"k", Ok::<_, ()>(Some(hold(3))));
        rb.record(b"2/k", Some(2), b"k", Ok::<_, ()>(None));
        // A late record of the owner before, after the let-go.
        rb.record(b"1/k", Some(1), b"k", Ok::<_, ()>(Some(hold(1))));
        let found = rb.finish();
        assert!(found.holds.is_empty(), "let go");
        assert_eq!(found.to_delete, [b"1/k".to_vec()]);
    }

    #[test]
    fn records_without_a_claim_count_until_a_claim_is_committed() {
        let legacy = |committed| {
            let mut rb = ReadBack::new(committed);
            rb.record(b"t\0k", None, b"k", Ok::<_, ()>(Some(hold(4))));
            rb.finish()
        };
        assert_eq!(legacy(None).holds.len(), 1);
        assert!(legacy(Some(9)).holds.is_empty());
        // A claim written but never committed (its owner died before) does
        // not count either.
        let mut rb = ReadBack::new(None);
        rb.record(b"t\0k", None, b"k", Ok::<_, ()>(Some(hold(4))));
        rb.record(b"5/k", Some(5), b"k", Ok::<_, ()>(Some(hold(9))));
        assert_eq!(rb.finish().holds[0].1.done_seq, 4);
    }

    #[test]
    fn an_unreadable_record_leaves_the_last_readable_hold_and_is_deleted() {
        let mut rb = ReadBack::new(Some(2));
        rb.record(b"2/k", Some(2), b"k", Ok::<_, &str>(Some(hold(3))));
        rb.record(b"2/k", Some(2), b"k", Err("bad json"));
        let found = rb.finish();
        assert_eq!(found.holds[0].1.done_seq, 3);
        assert_eq!(found.to_delete, [b"2/k".to_vec()]);
    }
}
