//! Held keys as held-topic records: key = the writer's claim (16 hex
//! digits and a `/`, see [`super::claim`]; absent in records written before
//! claims), work topic, a zero byte, entity key; value = the [`Hold`] as
//! JSON (`null` value: let go); partition = the work partition the key is
//! read from.

use serde::{Deserialize, Serialize};

use crate::job::JobId;
use crate::wire::OwnedRecord;

use super::{Blocker, Hold, HoldWrite, Rare, Skip, NEVER, NO_OFFSET};

/// The held-topic record key of `key` on work topic `topic`, written under
/// `claim`.
pub fn record_key(claim: Option<u64>, topic: &str, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(17 + topic.len() + 1 + key.len());
    if let Some(c) = claim {
        out.extend_from_slice(format!("{c:016x}/").as_bytes());
    }
    out.extend_from_slice(topic.as_bytes());
    out.push(0);
    out.extend_from_slice(key);
    out
}

/// A held-topic record key's parts: the claim it was written under, the
/// work topic and the entity key (a topic name has no `/`).
pub fn split_key(record_key: &[u8]) -> Option<(Option<u64>, &str, &[u8])> {
    let at = record_key.iter().position(|b| *b == 0)?;
    let head = std::str::from_utf8(&record_key[..at]).ok()?;
    let (claim, topic) = match head.split_once('/') {
        Some((hex, topic)) if hex.len() == 16 => (Some(u64::from_str_radix(hex, 16).ok()?), topic),
        Some(_) => return None,
        None => (None, head),
    };
    Some((claim, topic, &record_key[at + 1..]))
}

/// The record of `change` to `key` of `topic` under `claim`, for held
/// topic `held`.
pub fn record(held: &str, claim: Option<u64>, topic: &str, key: &[u8], change: &HoldWrite) -> OwnedRecord {
    OwnedRecord {
        topic: held.to_string(),
        key: record_key(claim, topic, key),
        value: match change {
            HoldWrite::Put(h) => Some(serde_json::to_vec(h).expect("a hold serializes")),
            HoldWrite::Let => None,
        },
        headers: Vec::new(),
    }
}

/// A record value read back: `Ok(None)` for a tombstone.
pub fn decode(value: Option<&[u8]>) -> Result<Option<Hold>, serde_json::Error> {
    value.map(serde_json::from_slice).transpose()
}

fn no_offset() -> i64 {
    NO_OFFSET
}

fn is_no_offset(offset: &i64) -> bool {
    *offset == NO_OFFSET
}

/// A [`Hold`] as the held topic keeps it (the fields not kept are set
/// as a hold read back starts).
#[derive(Serialize, Deserialize)]
pub(crate) struct Kept {
    blocker: Option<Blocker>,
    last_seq: u64,
    done_seq: u64,
    tail_at_ms: i64,
    since_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    released: Option<JobId>,
    #[serde(default = "no_offset", skip_serializing_if = "is_no_offset")]
    parked_to: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    skipped: Vec<Skip>,
}

impl From<Kept> for Hold {
    fn from(k: Kept) -> Hold {
        let rare = (k.released.is_some() || !k.skipped.is_empty()).then(|| {
            Box::new(Rare {
                released: k.released,
                skipped: k.skipped,
                skip_unwritten: false,
            })
        });
        Hold {
            blocker: k.blocker,
            last_seq: k.last_seq,
            done_seq: k.done_seq,
            admitted_seq: 0,
            waiting: 0,
            gave_up: 0,
            wait_since_ms: NEVER,
            gap_since_ms: NEVER,
            sent_seq: 0,
            tail_at_ms: k.tail_at_ms,
            since_ms: k.since_ms,
            rare,
            parked_to: k.parked_to,
        }
    }
}

impl From<Hold> for Kept {
    fn from(h: Hold) -> Kept {
        let rare = h.rare.map(|r| *r).unwrap_or_default();
        Kept {
            blocker: h.blocker,
            last_seq: h.last_seq,
            done_seq: h.done_seq,
            tail_at_ms: h.tail_at_ms,
            since_ms: h.since_ms,
            released: rare.released,
            parked_to: h.parked_to,
            skipped: rare.skipped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::hold::{Blocker, Cause, NEVER, NO_OFFSET};

    #[test]
    fn keys_and_values_round_trip() {
        let k = record_key(None, "crawl", b"a\0b");
        assert_eq!(split_key(&k), Some((None, "crawl", &b"a\0b"[..])));
        let k = record_key(Some(0xab), "crawl", b"a/\0b");
        assert_eq!(&k[..17], b"00000000000000ab/");
        assert_eq!(split_key(&k), Some((Some(0xab), "crawl", &b"a/\0b"[..])));
        assert_eq!(split_key(b"no-zero"), None);
        assert_eq!(split_key(b"xyz/crawl\0k"), None, "not a claim");
        let hold = Hold {
            blocker: Some(Blocker {
                id: crate::JobId::new(),
                attempt: 3,
                due_ms: 1_700_000_000_000,
                cause: Cause::Failed,
                park: std::num::NonZeroU64::new(2),
                arrived: true,
            }),
            last_seq: 4,
            done_seq: 1,
            admitted_seq: 3,
            waiting: 0,
            sent_seq: 0,
            gap_since_ms: NEVER,
            wait_since_ms: NEVER,
            gave_up: 0,
            tail_at_ms: 5,
            since_ms: 1,
            rare: None,
            parked_to: 41,
        };
        let rec = record("kairos.held", None, "crawl", b"k", &HoldWrite::Put(hold.clone()));
        let back = decode(rec.value.as_deref()).unwrap().unwrap();
        assert_eq!(back.parked_to, 41, "kept");
        assert!(!back.blocker.as_ref().unwrap().arrived, "not kept");
        assert_eq!((back.admitted_seq, back.done_seq, back.last_seq), (0, 1, 4));
        assert_eq!(back.blocker.unwrap().id, hold.blocker.unwrap().id);
        assert_eq!(decode(None).unwrap(), None);
        let tomb = record("kairos.held", None, "crawl", b"k", &HoldWrite::Let);
        assert_eq!(tomb.value, None);
        assert!(decode(Some(b"{")).is_err());
    }

    #[test]
    fn a_hold_written_before_parked_to_existed_reads_as_none_parked() {
        let old = br#"{"blocker":null,"last_seq":2,"done_seq":1,"tail_at_ms":5,"since_ms":1}"#;
        let back = decode(Some(&old[..])).unwrap().unwrap();
        assert_eq!(back.parked_to, NO_OFFSET);
        let none = Hold {
            parked_to: NO_OFFSET,
            ..back
        };
        let rec = record("kairos.held", None, "crawl", b"k", &HoldWrite::Put(none));
        let text = String::from_utf8(rec.value.unwrap()).unwrap();
        assert!(!text.contains("parked_to"), "left out when none: {text}");
    }

    #[test]
    fn a_release_and_skips_read_and_write_as_json_fields() {
        let id = "01a2187e-674d-772d-adda-6c86045e8a34";
        let text = format!(
            r#"{{"blocker":null,"last_seq":7,"done_seq":2,"tail_at_ms":5,"since_ms":1,"released":"{id}","parked_to":9,"skipped":[{{"after":3,"upto":6}}]}}"#
        );
        let back = decode(Some(text.as_bytes())).unwrap().unwrap();
        assert_eq!(back.released().map(|r| r.to_string()), Some(id.to_string()));
        assert_eq!(back.skipped(), [Skip { after: 3, upto: 6 }]);
        assert!(!back.skip_unwritten());
        let rec = record("kairos.held", None, "crawl", b"k", &HoldWrite::Put(back.clone()));
        assert_eq!(
            String::from_utf8(rec.value.unwrap()).unwrap(),
            text,
            "written as read"
        );
        // Neither: no fields, and nothing boxed.
        let mut plain = back;
        plain.set_released(None);
        plain.rare.as_mut().unwrap().skipped.clear();
        let rec = record("kairos.held", None, "crawl", b"k", &HoldWrite::Put(plain));
        let text = String::from_utf8(rec.value.unwrap()).unwrap();
        assert!(!text.contains("released") && !text.contains("skipped"), "{text}");
        assert_eq!(decode(Some(text.as_bytes())).unwrap().unwrap().rare, None);
    }
}
