//! The recurring schedules of owned partitions on disk (a sled tree of the
//! store's database): per schedule its definition and cursor, and an index
//! of each schedule's next occurrence. Nothing per schedule is kept in
//! memory; a partition's entries are rebuilt from the schedules and
//! cursors topics whenever it is assigned.
//!
//! Keys (partition as 4 big-endian bytes, times as 8, sign bit flipped):
//! - `d` partition id → the definition record's value, its version, the
//!   time it was first seen, its floor and next occurrence ([`Kept`]);
//! - `c` partition id → the cursor (last occurrence handled, ranges
//!   backfilled; JSON as in the cursors topic);
//! - `q` partition id → a backfill asked for and not yet done;
//! - `n` partition next id → nothing: the index, by next occurrence;
//! - `x` partition id → nothing: a cursor to tombstone (schedule deleted).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chrono::{DateTime, TimeZone as _, Utc};

use crate::schedules::{Backfill, Cursor, Recurrence, Schedule};

/// A schedule's definition as kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Kept {
    /// The definition record's value (JSON).
    pub(super) value: Vec<u8>,
    /// [`Schedule::version`] of it.
    pub(super) version: u64,
    /// When this schedule was first seen (its record's time): no
    /// occurrence before it runs unless a cursor says otherwise.
    pub(super) since_ms: i64,
    /// No occurrence before this time runs (set when a definition
    /// unpaused it).
    pub(super) floor_ms: Option<i64>,
    /// Its next occurrence as indexed, if any.
    pub(super) next_ms: Option<i64>,
}

impl Kept {
    /// As stored: version, first seen, a flags byte (floor, next), the
    /// floor and next if set (8 bytes each, big-endian), then the value.
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(33 + self.value.len());
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&self.since_ms.to_be_bytes());
        out.push(u8::from(self.floor_ms.is_some()) | (u8::from(self.next_ms.is_some()) << 1));
        for t in [self.floor_ms, self.next_ms].into_iter().flatten() {
            out.extend_from_slice(&t.to_be_bytes());
        }
        out.extend_from_slice(&self.value);
        out
    }

    /// What [`Kept::encode`] wrote (`None` for anything else).
    pub(super) fn decode(b: &[u8]) -> Option<Kept> {
        let word = |at: usize| Some(i64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?));
        let flags = *b.get(16)?;
        let mut at = 17;
        let mut take = |set: bool| -> Option<Option<i64>> {
            if !set {
                return Some(None);
            }
            let t = word(at)?;
            at += 8;
            Some(Some(t))
        };
        let floor_ms = take(flags & 1 != 0)?;
        let next_ms = take(flags & 2 != 0)?;
        Some(Kept {
            version: word(0)? as u64,
            since_ms: word(8)?,
            floor_ms,
            next_ms,
            value: b.get(at..)?.to_vec(),
        })
    }
}

/// What a definition record did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Defined {
    /// A new schedule, or a new version of one.
    Changed,
    /// The same version as kept, or a delete of nothing.
    Unchanged,
    /// A tombstone: the schedule is gone.
    Deleted,
    /// Not a valid definition (why): the schedule is gone.
    Invalid(String),
}

/// The sled tree.
pub(super) struct State {
    tree: sled::Tree,
    /// How many schedules it holds (owned partitions).
    held: Arc<AtomicU64>,
}

fn key(kind: u8, p: i32, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(5 + id.len());
    k.push(kind);
    k.extend_from_slice(&p.to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

fn index_key(p: i32, next_ms: i64, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(13 + id.len());
    k.push(b'n');
    k.extend_from_slice(&p.to_be_bytes());
    k.extend_from_slice(&((next_ms as u64) ^ (1 << 63)).to_be_bytes());
    k.extend_from_slice(id.as_bytes());
    k
}

fn prefix(kind: u8, p: i32) -> Vec<u8> {
    let mut k = vec![kind];
    k.extend_from_slice(&p.to_be_bytes());
    k
}

/// A time from milliseconds.
pub(super) fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

impl State {
    /// The state in `tree`, emptied (each partition is read anew when
    /// assigned), counting the schedules it holds in `held`.
    pub(super) fn new(tree: sled::Tree, held: Arc<AtomicU64>) -> sled::Result<State> {
        tree.clear()?;
        held.store(0, Ordering::Relaxed);
        Ok(State { tree, held })
    }

    /// Forget everything of partition `p` (before it is read anew, or when it goes).
    pub(super) fn clear(&self, p: i32) -> sled::Result<()> {
        for kind in [b'd', b'c', b'n', b'x', b'q'] {
            let mut batch = sled::Batch::default();
            let mut n = 0;
            for k in self.tree.scan_prefix(prefix(kind, p)).keys() {
                batch.remove(k?);
                n += 1;
            }
            self.tree.apply_batch(batch)?;
            if kind == b'd' {
                self.held.fetch_sub(n, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Schedule `id`'s definition, if kept.
    pub(super) fn kept(&self, p: i32, id: &str) -> sled::Result<Option<Kept>> {
        Ok(self.tree.get(key(b'd', p, id))?.and_then(|v| Kept::decode(&v)))
    }

    /// Schedule `id`'s last occurrence handled, if any.
    pub(super) fn cursor(&self, p: i32, id: &str) -> sled::Result<Option<i64>> {
        Ok(self.full_cursor(p, id)?.and_then(|c| c.last_ms))
    }

    /// Schedule `id`'s cursor, if any.
    pub(super) fn full_cursor(&self, p: i32, id: &str) -> sled::Result<Option<Cursor>> {
        Ok(self
            .tree
            .get(key(b'c', p, id))?
            .and_then(|v| crate::schedules::decode_cursor(&v)))
    }

    /// A definition record read: `None` deletes it, a value that is not a
    /// valid definition too (its schedule stops).
    pub(super) fn define(
        &self,
        p: i32,
        id: &str,
        value: Option<&[u8]>,
        written_ms: i64,
    ) -> sled::Result<Defined> {
        let old = self.kept(p, id)?;
        let parsed = value.map(Schedule::from_json);
        let parsed = parsed.map(|p| {
            p.and_then(|(s, r)| match s.id == id {
                true => Ok((s, r)),
                false => Err(crate::schedules::ScheduleError::Invalid(format!(
                    "its id `{}` is not its record's key",
                    s.id
                ))),
            })
        });
        let (value, schedule, recurrence) = match (value, parsed) {
            (Some(v), Some(Ok((s, r)))) => (v, s, r),
            (_, parsed) => {
                let outcome = match parsed {
                    Some(Err(e)) => Defined::Invalid(e.to_string()),
                    _ => Defined::Deleted,
                };
                let Some(old) = old else {
                    return Ok(match outcome {
                        Defined::Deleted => Defined::Unchanged,
                        refused => refused,
                    });
                };
                self.unindex(p, id, &old)?;
                self.tree.remove(key(b'd', p, id))?;
                self.held.fetch_sub(1, Ordering::Relaxed);
                if self.cursor(p, id)?.is_some() {
                    self.tree.insert(key(b'x', p, id), &[])?;
                }
                return Ok(outcome);
            }
        };
        let version = schedule.version();
        if old.as_ref().is_some_and(|o| o.version == version) {
            return Ok(Defined::Unchanged);
        }
        match &old {
            Some(o) => self.unindex(p, id, o)?,
            None => {
                self.held.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.tree.remove(key(b'x', p, id))?;
        // Unpaused by a new definition (not by a resume): what it missed
        // while paused does not run either.
        let was_paused = old
            .as_ref()
            .and_then(|o| Schedule::from_json(&o.value).ok())
            .is_some_and(|(s, _)| s.paused);
        let floor_ms = match was_paused && !schedule.paused {
            true => Some(written_ms),
            false => old.as_ref().and_then(|o| o.floor_ms),
        };
        let mut kept = Kept {
            value: value.to_vec(),
            version,
            since_ms: old.map_or(written_ms, |o| o.since_ms),
            floor_ms,
            next_ms: None,
        };
        self.reindex(p, id, &schedule, &recurrence, &mut kept)?;
        Ok(Defined::Changed)
    }

    /// Occurrences up to `last_ms` are handled (the tests' shorthand for
    /// [`State::merge_cursor`]).
    #[cfg(test)]
    pub(super) fn advance(&self, p: i32, id: &str, last_ms: i64) -> sled::Result<()> {
        let c = Cursor {
            last_ms: Some(last_ms),
            ..Cursor::default()
        };
        self.merge_cursor(p, id, &c)
    }

    /// A cursor read or written: merged with the one kept (the later last
    /// occurrence, every range backfilled).
    pub(super) fn merge_cursor(&self, p: i32, id: &str, c: &Cursor) -> sled::Result<()> {
        let old = self.full_cursor(p, id)?.unwrap_or_default();
        let new = old.merged(c);
        if new == old {
            return Ok(());
        }
        self.tree
            .insert(key(b'c', p, id), serde_json::to_vec(&new).expect("serialises"))?;
        if new.last_ms == old.last_ms {
            return Ok(());
        }
        if let Some(mut kept) = self.kept(p, id)? {
            if let Ok((s, r)) = Schedule::from_json(&kept.value) {
                self.unindex(p, id, &kept)?;
                self.reindex(p, id, &s, &r, &mut kept)?;
            }
        }
        Ok(())
    }

    /// A backfill of schedule `id` asked for (the request's value); done
    /// in a turn, once the partition's cursors are read.
    pub(super) fn ask_backfill(&self, p: i32, id: &str, value: Option<&[u8]>) -> sled::Result<bool> {
        match value.and_then(|v| serde_json::from_slice::<Backfill>(v).ok()) {
            Some(b) => {
                self.tree
                    .insert(key(b'q', p, id), serde_json::to_vec(&b).expect("serialises"))?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Backfills asked for in partition `p`, at most `most`.
    pub(super) fn backfills(&self, p: i32, most: usize) -> sled::Result<Vec<(String, Backfill)>> {
        let mut out = Vec::new();
        for kv in self.tree.scan_prefix(prefix(b'q', p)).take(most) {
            let (k, v) = kv?;
            if let Ok(b) = serde_json::from_slice(&v) {
                out.push((String::from_utf8_lossy(&k[5..]).into_owned(), b));
            }
        }
        Ok(out)
    }

    /// Schedule `id`'s backfill is done (or cannot be).
    pub(super) fn backfilled(&self, p: i32, id: &str) -> sled::Result<()> {
        self.tree.remove(key(b'q', p, id)).map(|_| ())
    }

    /// Where schedule `id`'s occurrences start: after its cursor, its
    /// first sighting, and its last resume, whichever is latest.
    pub(super) fn after(&self, p: i32, id: &str, s: &Schedule, kept: &Kept) -> sled::Result<DateTime<Utc>> {
        let from = self.cursor(p, id)?.unwrap_or(kept.since_ms);
        let resumed = s.resumed_at.map_or(i64::MIN, |t| t.timestamp_millis());
        Ok(at(from.max(resumed).max(kept.floor_ms.unwrap_or(i64::MIN))))
    }

    fn reindex(&self, p: i32, id: &str, s: &Schedule, r: &Recurrence, kept: &mut Kept) -> sled::Result<()> {
        kept.next_ms = match s.paused {
            true => None,
            false => r
                .next_after(self.after(p, id, s, kept)?)
                .map(|t| t.timestamp_millis()),
        };
        if let Some(n) = kept.next_ms {
            self.tree.insert(index_key(p, n, id), &[])?;
        }
        let v = kept.encode();
        self.tree.insert(key(b'd', p, id), v)?;
        Ok(())
    }

    fn unindex(&self, p: i32, id: &str, kept: &Kept) -> sled::Result<()> {
        if let Some(n) = kept.next_ms {
            self.tree.remove(index_key(p, n, id))?;
        }
        Ok(())
    }

    /// Up to `most` schedules of partition `p` whose next occurrence is at
    /// or before `until_ms`, earliest first.
    pub(super) fn due(&self, p: i32, until_ms: i64, most: usize) -> sled::Result<Vec<String>> {
        let mut out = Vec::new();
        for k in self.tree.scan_prefix(prefix(b'n', p)).keys() {
            let k = k?;
            let Some(next) = k.get(5..13).and_then(|b| <[u8; 8]>::try_from(b).ok()) else {
                continue;
            };
            if (u64::from_be_bytes(next) ^ (1 << 63)) as i64 > until_ms || out.len() >= most {
                break;
            }
            out.push(String::from_utf8_lossy(&k[13..]).into_owned());
        }
        Ok(out)
    }

    /// The earliest next occurrence of partition `p`, in ms.
    pub(super) fn earliest(&self, p: i32) -> sled::Result<Option<i64>> {
        Ok(self
            .tree
            .scan_prefix(prefix(b'n', p))
            .keys()
            .next()
            .transpose()?
            .and_then(|k| k.get(5..13).and_then(|b| <[u8; 8]>::try_from(b).ok()))
            .map(|b| (u64::from_be_bytes(b) ^ (1 << 63)) as i64))
    }

    /// Cursors of partition `p` to tombstone (their schedules were deleted).
    pub(super) fn gone(&self, p: i32, most: usize) -> sled::Result<Vec<String>> {
        self.tree
            .scan_prefix(prefix(b'x', p))
            .keys()
            .take(most)
            .map(|k| k.map(|k| String::from_utf8_lossy(&k[5..]).into_owned()))
            .collect()
    }

    /// A cursor tombstone read: the schedule's cursor is gone.
    pub(super) fn uncursor(&self, p: i32, id: &str) -> sled::Result<()> {
        self.tree.remove(key(b'c', p, id))?;
        self.tree.remove(key(b'x', p, id)).map(|_| ())
    }

    /// Once partition `p` is read: every cursor without a schedule is
    /// tombstoned (a delete read before its cursor left it). Returns how many.
    pub(super) fn orphans(&self, p: i32) -> sled::Result<usize> {
        let mut n = 0;
        for k in self.tree.scan_prefix(prefix(b'c', p)).keys() {
            let k = k?;
            let id = String::from_utf8_lossy(&k[5..]).into_owned();
            if self.tree.get(key(b'd', p, &id))?.is_none() && self.tree.get(key(b'q', p, &id))?.is_none() {
                self.tree.insert(key(b'x', p, &id), &[])?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// A deleted schedule's cursor tombstone is written.
    pub(super) fn forgotten(&self, p: i32, id: &str) -> sled::Result<()> {
        self.tree.remove(key(b'x', p, id))?;
        self.tree.remove(key(b'c', p, id)).map(|_| ())
    }
}

/// A schedule as held, for the admin endpoint.
pub(super) struct Listed {
    pub(super) partition: i32,
    pub(super) id: String,
    pub(super) kept: Kept,
    pub(super) cursor: Cursor,
}

/// Up to `most` schedules of partitions `parts` held in `tree`, by
/// partition then id (read from disk, none kept in memory).
pub(super) fn listing(tree: &sled::Tree, parts: &[i32], most: usize) -> sled::Result<Vec<Listed>> {
    let mut out = Vec::new();
    for &p in parts {
        for kv in tree.scan_prefix(prefix(b'd', p)) {
            if out.len() >= most {
                return Ok(out);
            }
            let (k, v) = kv?;
            let Some(kept) = Kept::decode(&v) else {
                continue;
            };
            let id = String::from_utf8_lossy(&k[5..]).into_owned();
            let cursor = tree
                .get(key(b'c', p, &id))?
                .and_then(|v| crate::schedules::decode_cursor(&v))
                .unwrap_or_default();
            out.push(Listed {
                partition: p,
                id,
                kept,
                cursor,
            });
        }
    }
    Ok(out)
}
