//! The compact binary form of a job at rest: in sled and in the changelog.
//!
//! Hand-written rather than derived so that the format is explicit, versioned
//! and cheap: a 10-million-job store pays for every byte. Decoding checks
//! every length and never panics.

use chrono::{TimeZone, Utc};

use crate::job::{Job, JobId, Priority};

/// Format version written first; bump on any change. Version 2 is version 1
/// followed by the priority class (1 byte) and the early-start allowance
/// (ms, 8 bytes, 0 for none); a job with neither is written as version 1,
/// so stores and changelogs of jobs without them read as before. Version 3
/// is version 2 followed by the limit key (optional bytes) and the park
/// sequence (4 bytes, 0 for none), written only for jobs with either.
/// Version 4 is version 3 with an 8-byte park sequence, written only for a
/// park number above `u32::MAX` (so that a store of narrow numbers reads in
/// the versions before). Version 5 is version 4 followed by a flags byte
/// (bit 0: [`Job::skip_if_busy`]), written only for a job with a flag set.
/// The id field holds the id a job is stored under ([`Job::stored_id`]: a
/// park's id of its own, as schedulers have written parks since parks got
/// ids of their own); decoding gives a park its job's id back.
const FORMAT: u8 = 1;
const FORMAT_2: u8 = 2;
const FORMAT_3: u8 = 3;
const FORMAT_4: u8 = 4;
const FORMAT_5: u8 = 5;

/// Format 5's flag bits.
const FLAG_SKIP_IF_BUSY: u8 = 1;

/// A job as the scheduler holds it: the job and its arrival sequence (the
/// schedule-topic offset it came from), which orders jobs of equal run-at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredJob {
    /// The job.
    pub job: Job,
    /// Arrival order within its schedule partition.
    pub seq: u64,
}

/// Stored bytes that do not decode (a corrupt file, or a format from a newer version).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored job is corrupt: {0}")]
pub struct CorruptJob(pub &'static str);

/// What [`StoredJob::peek`] reads of encoded bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peeked {
    /// The id it is stored under ([`Job::stored_id`]).
    pub id: JobId,
    /// Its arrival order in its partition.
    pub seq: u64,
    /// Its run-at, in ms since the epoch.
    pub run_at_ms: i64,
}

impl StoredJob {
    /// Encode to bytes.
    pub fn encode(&self) -> Vec<u8> {
        let j = &self.job;
        let mut out = Vec::with_capacity(64 + j.key.len() + j.payload.len() + j.topic.len());
        let flags = if j.skip_if_busy { FLAG_SKIP_IF_BUSY } else { 0 };
        let v5 = flags != 0;
        let v4 = v5 || j.parked.is_some_and(|n| n > u64::from(u32::MAX));
        let v3 = v4 || j.limit_key.is_some() || j.parked.is_some();
        let v2 = v3 || j.priority != Priority::Normal || j.early.is_some();
        out.push(match (v5, v4, v3, v2) {
            (true, ..) => FORMAT_5,
            (false, true, ..) => FORMAT_4,
            (false, false, true, _) => FORMAT_3,
            (false, false, false, true) => FORMAT_2,
            (false, false, false, false) => FORMAT,
        });
        out.extend_from_slice(j.stored_id().as_bytes());
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&j.run_at.timestamp_millis().to_be_bytes());
        out.extend_from_slice(&j.attempt.to_be_bytes());
        out.extend_from_slice(&j.max_attempts.unwrap_or(0).to_be_bytes());
        put_bytes(&mut out, &j.key);
        put_bytes(&mut out, &j.payload);
        put_bytes(&mut out, j.topic.as_bytes());
        put_opt(&mut out, j.tenant.as_deref().map(str::as_bytes));
        put_opt(&mut out, j.last_error.as_deref().map(str::as_bytes));
        out.extend_from_slice(&(j.headers.len() as u32).to_be_bytes());
        for (k, v) in &j.headers {
            put_bytes(&mut out, k.as_bytes());
            put_opt(&mut out, v.as_deref());
        }
        if v2 {
            out.push(j.priority.class() as u8);
            let early_ms = j.early.map_or(0, |d| d.as_millis().min(u64::MAX as u128) as u64);
            out.extend_from_slice(&early_ms.to_be_bytes());
        }
        if v3 {
            put_opt(&mut out, j.limit_key.as_deref());
            let parked = j.parked.unwrap_or(0);
            match u32::try_from(parked) {
                Ok(narrow) if !v4 => out.extend_from_slice(&narrow.to_be_bytes()),
                _ => out.extend_from_slice(&parked.to_be_bytes()),
            }
        }
        if v5 {
            out.push(flags);
        }
        out
    }

    /// The id ([`Job::stored_id`]), seq and run-at of encoded bytes, without
    /// decoding the rest (`None` when the bytes are not a job of this format).
    pub fn peek(bytes: &[u8]) -> Option<Peeked> {
        if !matches!(
            bytes.first(),
            Some(&FORMAT | &FORMAT_2 | &FORMAT_3 | &FORMAT_4 | &FORMAT_5)
        ) {
            return None;
        }
        let id: [u8; 16] = bytes.get(1..17)?.try_into().ok()?;
        let seq = u64::from_be_bytes(bytes.get(17..25)?.try_into().ok()?);
        let run_at_ms = i64::from_be_bytes(bytes.get(25..33)?.try_into().ok()?);
        Some(Peeked {
            id: JobId::from_bytes(id),
            seq,
            run_at_ms,
        })
    }

    /// Decode bytes written by [`StoredJob::encode`].
    pub fn decode(bytes: &[u8]) -> Result<StoredJob, CorruptJob> {
        let mut r = Reader(bytes);
        let version = r.take(1)?[0];
        if !matches!(version, FORMAT | FORMAT_2 | FORMAT_3 | FORMAT_4 | FORMAT_5) {
            return Err(CorruptJob("unknown format version"));
        }
        let stored_id = JobId::from_bytes(r.array()?);
        let seq = u64::from_be_bytes(r.array()?);
        let run_at_ms = i64::from_be_bytes(r.array()?);
        let attempt = u32::from_be_bytes(r.array()?);
        let max = u32::from_be_bytes(r.array()?);
        let key = r.bytes()?.to_vec();
        let payload = r.bytes()?.to_vec();
        let topic = r.text()?;
        let tenant = r.opt()?.map(text).transpose()?;
        let last_error = r.opt()?.map(text).transpose()?;
        let n = u32::from_be_bytes(r.array()?) as usize;
        let mut headers = Vec::with_capacity(n.min(64));
        for _ in 0..n {
            let k = r.text()?;
            let v = r.opt()?.map(<[u8]>::to_vec);
            headers.push((k, v));
        }
        let (priority, early) = if version >= FORMAT_2 {
            let priority = Priority::from_class(r.take(1)?[0]).ok_or(CorruptJob("bad priority class"))?;
            let ms = u64::from_be_bytes(r.array()?);
            (priority, (ms > 0).then(|| std::time::Duration::from_millis(ms)))
        } else {
            (Priority::Normal, None)
        };
        let (limit_key, parked) = if version >= FORMAT_3 {
            let limit_key = r.opt()?.map(<[u8]>::to_vec);
            let parked = if version >= FORMAT_4 {
                u64::from_be_bytes(r.array()?)
            } else {
                u64::from(u32::from_be_bytes(r.array()?))
            };
            (limit_key, (parked > 0).then_some(parked))
        } else {
            (None, None)
        };
        let skip_if_busy = match version {
            FORMAT_5 => match r.take(1)?[0] {
                f if f & !FLAG_SKIP_IF_BUSY != 0 => return Err(CorruptJob("unknown flags")),
                f => f & FLAG_SKIP_IF_BUSY != 0,
            },
            _ => false,
        };
        if !r.0.is_empty() {
            return Err(CorruptJob("trailing bytes"));
        }
        let run_at = Utc
            .timestamp_millis_opt(run_at_ms)
            .single()
            .ok_or(CorruptJob("run-at out of range"))?;
        Ok(StoredJob {
            job: Job {
                id: parked.map_or(stored_id, |n| stored_id.of_park(n)),
                key,
                payload,
                run_at,
                topic,
                attempt,
                max_attempts: (max != 0).then_some(max),
                tenant,
                priority,
                early,
                last_error,
                limit_key,
                parked,
                skip_if_busy,
                headers,
            },
            seq,
        })
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

fn put_opt(out: &mut Vec<u8>, b: Option<&[u8]>) {
    match b {
        None => out.push(0),
        Some(b) => {
            out.push(1);
            put_bytes(out, b);
        }
    }
}

fn text(b: &[u8]) -> Result<String, CorruptJob> {
    String::from_utf8(b.to_vec()).map_err(|_| CorruptJob("text is not UTF-8"))
}

/// A cursor over stored bytes that fails instead of panicking.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CorruptJob> {
        if self.0.len() < n {
            return Err(CorruptJob("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CorruptJob> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn bytes(&mut self) -> Result<&'a [u8], CorruptJob> {
        let n = u32::from_be_bytes(self.array()?) as usize;
        self.take(n)
    }

    fn text(&mut self) -> Result<String, CorruptJob> {
        text(self.bytes()?)
    }

    fn opt(&mut self) -> Result<Option<&'a [u8]>, CorruptJob> {
        match self.take(1)?[0] {
            0 => Ok(None),
            1 => self.bytes().map(Some),
            _ => Err(CorruptJob("bad option flag")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> StoredJob {
        let mut job = Job::new("jobs", "user-1", b"payload".to_vec())
            .tenant("acme")
            .max_attempts(3)
            .header("a", "b");
        job.headers.push(("null".into(), None));
        job.last_error = Some("boom".into());
        StoredJob { job, seq: 42 }
    }

    #[test]
    fn peeks_id_seq_and_run_at_without_decoding() {
        let s = sample();
        let run_at = s.job.run_at.timestamp_millis();
        let want = Peeked {
            id: s.job.stored_id(),
            seq: s.seq,
            run_at_ms: run_at,
        };
        assert_eq!(StoredJob::peek(&s.encode()), Some(want));
        assert_eq!(StoredJob::peek(&[]), None);
        assert_eq!(StoredJob::peek(&s.encode()[..30]), None);
        let mut other = s.encode();
        other[0] = FORMAT_5 + 1;
        assert_eq!(StoredJob::peek(&other), None);
        let mut v2 = s.clone();
        v2.job = v2.job.early(std::time::Duration::from_secs(5));
        assert_eq!(StoredJob::peek(&v2.encode()), Some(want));
    }

    #[test]
    fn round_trips() {
        let s = sample();
        assert_eq!(StoredJob::decode(&s.encode()).unwrap(), s);
        assert_eq!(
            s.encode()[0],
            FORMAT,
            "a job without priority or allowance is written as version 1"
        );
        let mut v2 = sample();
        v2.job = v2
            .job
            .priority(Priority::Low)
            .early(std::time::Duration::from_millis(1500));
        let bytes = v2.encode();
        assert_eq!(bytes[0], FORMAT_2);
        assert_eq!(bytes.len(), s.encode().len() + 9);
        assert_eq!(StoredJob::decode(&bytes).unwrap(), v2);
        let mut bad = bytes.clone();
        let at = bad.len() - 9;
        bad[at] = 7;
        assert!(StoredJob::decode(&bad).is_err(), "priority class 7");
    }

    #[test]
    fn a_limit_key_or_a_park_sequence_is_written_as_version_3() {
        let s = sample();
        let mut v3 = sample();
        v3.job = v3.job.limit_key("example.com");
        v3.job.parked = Some(7);
        let bytes = v3.encode();
        assert_eq!(bytes[0], FORMAT_3);
        assert_eq!(bytes.len(), s.encode().len() + 9 + 1 + 4 + 11 + 4);
        assert_eq!(StoredJob::decode(&bytes).unwrap(), v3);
        // A park is stored under an id of its own (as schedulers have
        // written parks since they gave them ids of their own) and decodes
        // with its job's id.
        let stored = v3.job.id.for_park(7);
        assert_eq!(&bytes[1..17], stored.as_bytes());
        assert_eq!(StoredJob::peek(&bytes).map(|p| p.id), Some(stored));
        assert_ne!(stored, v3.job.id);
        let mut parked_only = sample();
        parked_only.job.parked = Some(1);
        assert_eq!(StoredJob::decode(&parked_only.encode()).unwrap(), parked_only);
    }

    #[test]
    fn a_wide_park_number_is_written_as_version_4() {
        let mut narrow = sample();
        narrow.job.parked = Some(u64::from(u32::MAX));
        let narrow_bytes = narrow.encode();
        assert_eq!(
            narrow_bytes[0], FORMAT_3,
            "a number that fits 4 bytes keeps version 3"
        );
        let mut wide = sample();
        wide.job.parked = Some((7 << 32) | 3);
        let bytes = wide.encode();
        assert_eq!(bytes[0], FORMAT_4);
        assert_eq!(bytes.len(), narrow_bytes.len() + 4);
        assert_eq!(StoredJob::decode(&bytes).unwrap(), wide);
        assert_eq!(
            StoredJob::peek(&bytes).map(|p| p.id),
            Some(wide.job.id.for_park((7 << 32) | 3))
        );
        for n in 0..bytes.len() {
            assert!(StoredJob::decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
    }

    #[test]
    fn a_job_that_skips_when_busy_is_written_as_version_5_and_only_it() {
        let plain = sample();
        let mut skipping = sample();
        skipping.job.skip_if_busy = true;
        let bytes = skipping.encode();
        assert_eq!(bytes[0], FORMAT_5);
        assert_ne!(plain.encode()[0], FORMAT_5, "other jobs keep their versions");
        assert_eq!(StoredJob::decode(&bytes).unwrap(), skipping);
        assert_eq!(StoredJob::peek(&bytes).map(|p| p.id), Some(skipping.job.id));
        for n in 0..bytes.len() {
            assert!(StoredJob::decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut unknown = bytes.clone();
        *unknown.last_mut().unwrap() |= 0x80;
        assert_eq!(StoredJob::decode(&unknown), Err(CorruptJob("unknown flags")));
    }

    #[test]
    fn truncation_anywhere_is_an_error_not_a_panic() {
        let mut v3 = sample();
        v3.job = v3.job.priority(Priority::High).limit_key("host");
        v3.job.parked = Some(3);
        for v in [v3.clone(), {
            let mut v2 = sample();
            v2.job = v2.job.priority(Priority::High);
            v2
        }] {
            let bytes = v.encode();
            for n in 0..bytes.len() {
                assert!(StoredJob::decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
            }
        }
        let mut v2 = sample();
        v2.job = v2.job.priority(Priority::High);
        let bytes = v2.encode();
        for n in 0..bytes.len() {
            assert!(StoredJob::decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(StoredJob::decode(&longer).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = StoredJob::decode(&bytes);
        }
    }
}
