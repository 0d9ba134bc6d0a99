//! The bytes of the store's chunks, kept outside sled in append-only segment
//! files; sled holds a 20-byte pointer per chunk.
//!
//! sled 0.34 rewrites a whole leaf (up to 16 entries) every tenth update and
//! logs every update, so a store whose values are kilobyte chunks wrote each
//! job's bytes four to six times over. Here a chunk's bytes are written once,
//! appended to the head segment; rewriting a chunk appends its new bytes and
//! leaves the old ones as garbage.
//!
//! **Accounting.** Each segment has a count of live bytes (bytes some sled
//! entry points at), kept in sled itself (`L` segment-id entries) in the same
//! atomic batch as the pointers that change it. A sealed segment whose count
//! drops to zero is deleted once that batch is durable (after the next
//! [`ValueLog::sync`] and sled flush). Segment files that no count names
//! (written by batches a crash cut off) are deleted on open.
//!
//! **Compaction.** A job due in a year keeps its whole segment alive. A
//! sealed segment less than half live is a compaction candidate: the store
//! copies its live chunks to the head and repoints their entries (see
//! `Store::compact`), after which the segment is dead.
//!
//! **Crash ordering.** A batch's bytes are written to the head file (the
//! kernel holds them) before the sled batch naming them is applied, so a
//! process killed at any point never leaves a pointer to bytes it did not
//! write. For power loss, [`ValueLog::sync`] fsyncs every segment written
//! before sled's own flush: a flushed pointer names synced bytes unless the
//! batch raced the flush (written after the segment sync, made durable by
//! the same sled flush), the same window sled leaves for its own blob files.
//! Every read checks a CRC-32 of the chunk, so such a chunk is reported as
//! corrupt, never returned wrong.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};

use crate::hash::{HashMap, HashSet};
use crate::scheduler::stored::CorruptJob;
use crate::sync::{Lock, ReadWrite};

/// A head segment is sealed once it holds this many bytes.
pub const SEGMENT_BYTES: u64 = 64 << 20;
/// Bytes of an encoded [`Ptr`].
pub const PTR_LEN: usize = 20;
/// The sled key kind of the live-byte counts.
pub const LIVE_KIND: u8 = b'L';

/// Why the value log failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// A segment file could not be created, written, read, synced or deleted.
    #[error("value log {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The failure.
        source: std::io::Error,
    },
    /// A pointer or the bytes it names do not check out.
    #[error("value log: {0}")]
    Corrupt(#[from] CorruptJob),
    /// sled failed applying the batch that points into the log.
    #[error("value log: {0}")]
    Sled(#[from] sled::Error),
}

/// Where a chunk's bytes are: segment, offset, length and CRC-32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ptr {
    segment: u32,
    offset: u64,
    len: u32,
    crc: u32,
}

impl Ptr {
    /// The 20-byte form kept in sled.
    pub fn encode(&self) -> [u8; PTR_LEN] {
        let mut out = [0u8; PTR_LEN];
        out[..4].copy_from_slice(&self.segment.to_be_bytes());
        out[4..12].copy_from_slice(&self.offset.to_be_bytes());
        out[12..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..20].copy_from_slice(&self.crc.to_be_bytes());
        out
    }

    /// Read the pointer at the start of a sled value.
    pub fn decode(v: &[u8]) -> Result<Ptr, CorruptJob> {
        let v = v.get(..PTR_LEN).ok_or(CorruptJob("value pointer"))?;
        let u32_at = |i: usize| u32::from_be_bytes(v[i..i + 4].try_into().expect("4 bytes"));
        Ok(Ptr {
            segment: u32_at(0),
            offset: u64::from_be_bytes(v[4..12].try_into().expect("8 bytes")),
            len: u32_at(12),
            crc: u32_at(16),
        })
    }

    /// The segment holding the bytes.
    pub fn segment(&self) -> u32 {
        self.segment
    }

    /// How many bytes.
    #[cfg(test)]
    pub fn len(&self) -> u64 {
        u64::from(self.len)
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The append-only value log of one store.
pub struct ValueLog {
    dir: PathBuf,
    /// Segment files by id, for reading. Written only to add a segment or
    /// to delete dead ones; readers that hold a [`Pin`] keep deletion out.
    files: RwLock<HashMap<u32, Arc<File>>>,
    /// Taken for reading by [`Pin`]s, for writing to delete segments.
    pins: RwLock<()>,
    state: Mutex<LogState>,
    /// Held through a sync: a sync that finds nothing unsynced because
    /// another is still fsyncing the segments must wait for it to end. Keeps
    /// the first failed fsync (segment, reason): Linux may mark the pages
    /// that failed clean, so no later fsync proves them written, and every
    /// sync after it fails too.
    syncing: Mutex<Option<(PathBuf, String)>>,
}

struct LogState {
    /// A head is sealed once it holds this many bytes.
    segment_bytes: u64,
    head: u32,
    head_len: u64,
    /// Live bytes per segment (segments with none are absent).
    live: HashMap<u32, u64>,
    /// Bytes written per segment.
    written: HashMap<u32, u64>,
    /// Segments written since the last sync.
    unsynced: HashSet<u32>,
    /// Sealed segments with no live bytes, to delete after the next durable flush.
    dead: Vec<u32>,
}

/// Holds off segment deletion while a reader follows pointers it read from
/// sled without the store's write lock.
pub struct Pin<'a> {
    _guard: RwLockReadGuard<'a, ()>,
}

impl ValueLog {
    /// Open the log in `dir` (created if missing), given the live-byte
    /// counts recovered from sled. Segment files no count names are
    /// deleted; a counted segment without its file is corruption.
    pub fn open(dir: &Path, live: HashMap<u32, u64>) -> Result<ValueLog, LogError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let mut files = HashMap::default();
        let mut written = HashMap::default();
        let mut max_id = 0u32;
        for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
            let entry = entry.map_err(io_err(dir))?;
            let path = entry.path();
            let Some(id) = segment_id(&path) else { continue };
            max_id = max_id.max(id);
            if live.get(&id).is_some_and(|n| *n > 0) {
                let f = File::open(&path).map_err(io_err(&path))?;
                let len = f.metadata().map_err(io_err(&path))?.len();
                written.insert(id, len);
                files.insert(id, Arc::new(f));
            } else {
                std::fs::remove_file(&path).map_err(io_err(&path))?;
            }
        }
        if let Some(id) = live
            .iter()
            .find(|(id, n)| **n > 0 && !files.contains_key(*id))
            .map(|(id, _)| *id)
        {
            tracing::error!(segment = id, "a value segment the store points into is missing");
            return Err(CorruptJob("value segment missing").into());
        }
        max_id = max_id.max(live.keys().copied().max().unwrap_or(0));
        let log = ValueLog {
            dir: dir.to_path_buf(),
            files: RwLock::new(files),
            pins: RwLock::new(()),
            syncing: Mutex::new(None),
            state: Mutex::new(LogState {
                segment_bytes: SEGMENT_BYTES,
                head: max_id,
                head_len: 0,
                live,
                written,
                unsynced: HashSet::default(),
                dead: Vec::new(),
            }),
        };
        log.roll(&mut log.lock())?;
        Ok(log)
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.locked()
    }

    fn path(&self, id: u32) -> PathBuf {
        self.dir.join(format!("{id:010}.seg"))
    }

    /// Seal the head and start a new one.
    fn roll(&self, st: &mut LogState) -> Result<(), LogError> {
        let id = st.head + 1;
        let path = self.path(id);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(&path))?;
        self.files.writing().insert(id, Arc::new(f));
        if st.live.get(&st.head).is_none_or(|n| *n == 0) && st.written.contains_key(&st.head) {
            st.dead.push(st.head);
        }
        st.head = id;
        st.head_len = 0;
        st.written.insert(id, 0);
        Ok(())
    }

    fn file(&self, id: u32) -> Result<Arc<File>, CorruptJob> {
        self.files
            .reading()
            .get(&id)
            .cloned()
            .ok_or(CorruptJob("value segment missing"))
    }

    /// Start a batch.
    pub fn begin(&self) -> LogBatch<'_> {
        LogBatch::new(self)
    }

    /// The bytes `ptr` names, checked against its CRC.
    pub fn read(&self, ptr: &Ptr) -> Result<Vec<u8>, LogError> {
        let f = self.file(ptr.segment)?;
        let mut buf = vec![0u8; ptr.len as usize];
        f.read_exact_at(&mut buf, ptr.offset)
            .map_err(|source| LogError::Io {
                path: self.path(ptr.segment),
                source,
            })?;
        if crc32fast::hash(&buf) != ptr.crc {
            return Err(CorruptJob("value log checksum").into());
        }
        Ok(buf)
    }

    /// Keep segments from being deleted while the guard lives.
    pub fn pin(&self) -> Pin<'_> {
        Pin {
            _guard: self.pins.reading(),
        }
    }

    /// Fsync every segment written since the last sync. Returns the dead
    /// segments to delete once sled's flush that follows has succeeded.
    pub fn sync(&self) -> Result<Vec<u32>, LogError> {
        let mut failed = self.syncing.locked();
        if let Some((path, why)) = &*failed {
            return Err(LogError::Io {
                path: path.clone(),
                source: std::io::Error::other(format!("an earlier fsync failed: {why}")),
            });
        }
        let (ids, dead) = {
            let mut st = self.lock();
            let ids: Vec<u32> = st.unsynced.drain().collect();
            (ids, std::mem::take(&mut st.dead))
        };
        for id in ids {
            if let Ok(f) = self.file(id) {
                if let Err(e) = f.sync_data() {
                    let path = self.path(id);
                    *failed = Some((path.clone(), e.to_string()));
                    return Err(io_err(&path)(e));
                }
            }
        }
        Ok(dead)
    }

    /// Delete segments [`ValueLog::sync`] returned, after the sled flush
    /// that made their last pointers' removal durable.
    pub fn delete(&self, dead: Vec<u32>) -> Result<(), LogError> {
        if dead.is_empty() {
            return Ok(());
        }
        let _no_readers = self.pins.writing();
        let mut st = self.lock();
        for id in dead {
            // Never true for a segment on the dead list (a sealed segment
            // gains no new bytes); checked because deleting a live one
            // would lose jobs.
            if st.live.get(&id).is_some_and(|n| *n > 0) || id == st.head {
                continue;
            }
            self.files.writing().remove(&id);
            st.written.remove(&id);
            let path = self.path(id);
            std::fs::remove_file(&path).map_err(io_err(&path))?;
        }
        Ok(())
    }

    /// Sealed segments less than half live, least live first, until their
    /// live bytes add up to `max_bytes` (at least one, when any).
    pub fn compaction_candidates(&self, max_bytes: u64) -> Vec<u32> {
        let st = self.lock();
        let mut c: Vec<(u64, u32)> = st
            .written
            .iter()
            .filter(|(id, _)| **id != st.head)
            .filter_map(|(id, w)| {
                let live = st.live.get(id).copied().unwrap_or(0);
                (live > 0 && live * 2 < *w).then_some((live, *id))
            })
            .collect();
        c.sort_unstable();
        let mut total = 0;
        let mut out = Vec::new();
        for (live, id) in c {
            if !out.is_empty() && total + live > max_bytes {
                break;
            }
            total += live;
            out.push(id);
        }
        out
    }

    /// Seal heads at `n` bytes (tests: many segments from few jobs).
    #[cfg(test)]
    pub fn set_segment_bytes(&self, n: u64) {
        self.lock().segment_bytes = n;
    }

    /// Live bytes per segment, as counted.
    #[cfg(test)]
    pub fn live(&self) -> HashMap<u32, u64> {
        self.lock().live.clone()
    }

    /// The directory of the segment files.
    #[cfg(test)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Ids of the segment files.
    #[cfg(test)]
    pub fn segments(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.lock().written.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Bytes on disk and live bytes, over all segments.
    pub fn usage(&self) -> Usage {
        let st = self.lock();
        Usage {
            written: st.written.values().sum(),
            live: st.live.values().sum(),
        }
    }
}

fn segment_id(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    name.strip_suffix(".seg")?.parse().ok()
}

/// The key of a segment's live-byte count in sled.
pub fn live_key(segment: u32) -> [u8; 5] {
    let mut k = [LIVE_KIND; 5];
    k[1..].copy_from_slice(&segment.to_be_bytes());
    k
}

/// The value log's size, over all segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Bytes on disk.
    pub written: u64,
    /// Bytes still named by the store.
    pub live: u64,
}

/// A segment's live-byte count, as kept in sled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveCount {
    /// The segment.
    pub segment: u32,
    /// Its bytes still named by the store.
    pub bytes: u64,
}

/// Read a live-byte count entry.
pub fn decode_live(k: &[u8], v: &[u8]) -> Result<LiveCount, CorruptJob> {
    let id = k.get(1..5).ok_or(CorruptJob("live count key"))?;
    let n: [u8; 8] = v.try_into().map_err(|_| CorruptJob("live count"))?;
    Ok(LiveCount {
        segment: u32::from_be_bytes(id.try_into().expect("4 bytes")),
        bytes: u64::from_be_bytes(n),
    })
}

mod log_batch;
pub use log_batch::LogBatch;
