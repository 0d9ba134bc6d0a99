//! A store batch's side of the value log: the chunk bytes it adds and the
//! ones it drops, staged without any lock and applied with its sled batch.

use super::*;

/// Chunks added and dropped by one store batch, built without any lock
/// and applied, with the sled batch, in one short critical section.
pub struct LogBatch<'a> {
    log: &'a ValueLog,
    bytes: Vec<u8>,
    /// Staged entries: key, where the bytes sit in `bytes`, their CRC.
    puts: Vec<(Vec<u8>, usize, usize, u32)>,
    released: Vec<Ptr>,
}

impl<'a> LogBatch<'a> {
    /// An empty batch on `log`.
    pub(super) fn new(log: &'a ValueLog) -> Self {
        LogBatch {
            log,
            bytes: Vec::new(),
            puts: Vec::new(),
            released: Vec::new(),
        }
    }

    /// Stage the bytes `write` appends to the buffer it is given, to be
    /// pointed at from `key`.
    pub fn put_with(&mut self, key: &[u8], write: impl FnOnce(&mut Vec<u8>)) {
        let at = self.bytes.len();
        write(&mut self.bytes);
        let value = &self.bytes[at..];
        self.puts
            .push((key.to_vec(), at, value.len(), crc32fast::hash(value)));
    }

    /// The entry pointing at `ptr` is being removed or replaced.
    pub fn release(&mut self, ptr: &Ptr) {
        self.released.push(*ptr);
    }

    /// Write the staged bytes to the head segment, then insert each staged
    /// key with its pointer followed by `inline(bytes)`, and the changed
    /// live counts, into `batch`, and apply it to `tree`.
    pub fn apply(
        self,
        tree: &sled::Tree,
        mut batch: sled::Batch,
        inline: impl Fn(&[u8]) -> &[u8],
    ) -> Result<(), LogError> {
        let log = self.log;
        let mut st = log.lock();
        if st.head_len >= st.segment_bytes {
            log.roll(&mut st)?;
        }
        let (segment, start) = (st.head, st.head_len);
        let mut delta: HashMap<u32, i64> = HashMap::default();
        for ptr in &self.released {
            *delta.entry(ptr.segment).or_default() -= ptr.len as i64;
        }
        if !self.bytes.is_empty() {
            let n = self.bytes.len() as u64;
            // The bytes are spent whether or not the write succeeds.
            st.head_len = start + n;
            st.written.insert(segment, start + n);
            st.unsynced.insert(segment);
            *delta.entry(segment).or_default() += n as i64;
            log.file(segment)?
                .write_all_at(&self.bytes, start)
                .map_err(|e| io_err(&log.path(segment))(e))?;
        }
        for (key, at, len, crc) in &self.puts {
            let ptr = Ptr {
                segment,
                offset: start + *at as u64,
                len: *len as u32,
                crc: *crc,
            };
            let body = &self.bytes[*at..*at + *len];
            let extra = inline(body);
            let mut v = Vec::with_capacity(PTR_LEN + extra.len());
            v.extend_from_slice(&ptr.encode());
            v.extend_from_slice(extra);
            batch.insert(&key[..], v);
        }
        let counts: Vec<(u32, u64)> = delta
            .iter()
            .map(|(id, d)| {
                (
                    *id,
                    (st.live.get(id).copied().unwrap_or(0) as i64 + d).max(0) as u64,
                )
            })
            .collect();
        for (id, n) in &counts {
            if *n == 0 {
                batch.remove(&live_key(*id)[..]);
            } else {
                batch.insert(&live_key(*id)[..], &n.to_be_bytes()[..]);
            }
        }
        tree.apply_batch(batch)?;
        for (id, n) in counts {
            if n == 0 {
                st.live.remove(&id);
                if id != st.head {
                    st.dead.push(id);
                }
            } else {
                st.live.insert(id, n);
            }
        }
        Ok(())
    }
}
