//! The job: what a producer asks to have run, for which entity, and when.
//!
//! A [`Job`] is the in-memory form of one Kafka record on a work or schedule
//! topic. [`crate::wire`] turns it into a record (key, value, headers) and
//! back.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use uuid::Uuid;

/// FNV-1a's starting state (128 bits).
pub(crate) const FNV_OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
const FNV_PRIME: u128 = 0x0000000001000000000000000000013B;

/// FNV-1a (128 bits) of `bytes`, from state `h` ([`FNV_OFFSET`] to start).
pub(crate) fn fnv1a<'a>(mut h: u128, bytes: impl Iterator<Item = &'a u8>) -> u128 {
    for b in bytes {
        h ^= u128::from(*b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

thread_local! {
    /// The last topic [`JobId::derived`] hashed on this thread, and the FNV state after it.
    static TOPIC_HASH: std::cell::RefCell<Option<(String, u128)>> = const { std::cell::RefCell::new(None) };
}

/// A job's identity: a UUID, time-ordered (version 7) when Kairos makes it.
///
/// The id stays the same across retries, re-deliveries and the hop through
/// the scheduler, so handlers can deduplicate on it (delivery is
/// at-least-once).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct JobId(Uuid);

impl JobId {
    /// A fresh time-ordered id (UUIDv7: milliseconds since the epoch, then random bits).
    pub fn new() -> Self {
        JobId(Uuid::now_v7())
    }

    /// The id of a record that came without a `kairos-id` header.
    ///
    /// It is derived from where the record sits (topic, partition, offset)
    /// and when it was written, so every re-delivery of that record gets the
    /// same id, and ids still sort by time: the UUIDv7 layout with the
    /// record's timestamp in the time field and a hash of its coordinates in
    /// the random bits.
    pub fn derived(topic: &str, partition: i32, offset: i64, timestamp_ms: i64) -> Self {
        // FNV-1a, 128 bits wide enough for our purpose, stable across Rust versions
        // (unlike std's DefaultHasher, which may change between releases). The
        // state after the topic is the same for every record of a topic: it is
        // kept for the last topic seen on this thread (a consumer reads a few
        // topics, record after record).
        let after_topic = TOPIC_HASH.with(|last| {
            let mut last = last.borrow_mut();
            match &*last {
                Some((t, h)) if t == topic => *h,
                _ => {
                    let h = fnv1a(FNV_OFFSET, topic.as_bytes().iter().chain(&[0u8]));
                    *last = Some((topic.to_string(), h));
                    h
                }
            }
        });
        let h = fnv1a(
            after_topic,
            partition.to_be_bytes().iter().chain(&offset.to_be_bytes()),
        );
        let ms = (timestamp_ms.max(0) as u128) & 0xFFFF_FFFF_FFFF;
        let mut bits = (ms << 80) | (h & ((1u128 << 80) - 1));
        // version 7 and the RFC 4122 variant
        bits = (bits & !(0xF << 76)) | (0x7 << 76);
        bits = (bits & !(0x3 << 62)) | (0x2 << 62);
        JobId(Uuid::from_u128(bits))
    }

    /// The id as 16 big-endian bytes (the form used as a storage key).
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// Rebuild an id from the 16 bytes of [`JobId::as_bytes`].
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        JobId(Uuid::from_bytes(bytes))
    }

    /// The underlying UUID.
    pub fn uuid(&self) -> Uuid {
        self.0
    }

    /// The id under which the scheduler keeps park number `seq` of this job
    /// (a copy a worker parked behind its held key). The scheduler keeps
    /// each id once, so each park gets an id of its own: two parks of one
    /// job, or a park and the job's retry, never replace each other there
    /// (a replaced park's number would never come back to its key). The
    /// park number is mixed into the id's random bits (its low 62 bits into
    /// the last 62, its top two into two bits of the first random field)
    /// and the variant bits are flipped (an id Kairos makes, RFC 4122,
    /// cannot be one of them); applied again, it gives the job's own id
    /// back ([`JobId::of_park`]).
    pub fn for_park(self, seq: u64) -> JobId {
        let seq = u128::from(seq);
        let mixed = (seq & ((1 << 62) - 1)) | ((seq >> 62) << 64);
        JobId(Uuid::from_u128(self.0.as_u128() ^ (0b11 << 62) ^ mixed))
    }

    /// The job's own id, from the id [`JobId::for_park`] gave its park
    /// number `seq`.
    pub fn of_park(self, seq: u64) -> JobId {
        self.for_park(seq)
    }
}

impl Default for JobId {
    fn default() -> Self {
        Self::new()
    }
}

impl From<Uuid> for JobId {
    fn from(u: Uuid) -> Self {
        JobId(u)
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobId({})", self.0.hyphenated())
    }
}

impl FromStr for JobId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(JobId)
    }
}

/// Record headers in order: name and value (`None` for a null value, which
/// Kafka allows).
pub type HeaderList = Vec<(String, Option<Vec<u8>>)>;

/// A job's priority class on a fairly dispatched topic: `High` jobs are
/// released before `Normal` ones, `Normal` before `Low` (see docs/fair-dispatch.md,
/// priorities).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// Released first.
    High,
    /// The default.
    #[default]
    Normal,
    /// Released when nothing of a higher class waits (and at least once
    /// every few releases while something does).
    Low,
}

impl Priority {
    /// Its name on the wire (`kairos-priority`).
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// Its class number, 0 the highest.
    pub fn class(self) -> usize {
        self as usize
    }

    /// From its wire name (`high`, `normal`, `low`; `None` for anything else).
    pub fn parse(text: &str) -> Option<Priority> {
        match text {
            "high" => Some(Priority::High),
            "normal" => Some(Priority::Normal),
            "low" => Some(Priority::Low),
            _ => None,
        }
    }

    /// Its stored byte.
    pub(crate) fn from_class(class: u8) -> Option<Priority> {
        [Priority::High, Priority::Normal, Priority::Low]
            .get(class as usize)
            .copied()
    }
}

/// One unit of work for one entity.
///
/// Build one with [`Job::new`] and the chained setters:
///
/// ```
/// use kairos::Job;
/// use std::time::Duration;
///
/// let job = Job::new("emails", "user-42", b"welcome".to_vec())
///     .tenant("acme")
///     .max_attempts(5)
///     .header("trace-id", "abc123");
/// assert_eq!(job.key, b"user-42");
/// assert_eq!(job.attempt, 1);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// Identity across retries and re-deliveries; handlers deduplicate on it.
    pub id: JobId,
    /// The entity the job is about (a user, a tenant, a host). Jobs of one
    /// key never run at the same time and run in the order they were written
    /// to their work topic. Becomes the Kafka record key.
    pub key: Vec<u8>,
    /// Opaque bytes for the handler. Becomes the Kafka record value.
    pub payload: Vec<u8>,
    /// Not to be run before this instant (UTC, millisecond precision on the wire).
    pub run_at: DateTime<Utc>,
    /// The work topic the job runs from. The scheduler fires the job into it.
    pub topic: String,
    /// Which attempt this is, starting at 1; a retry carries `attempt + 1`.
    pub attempt: u32,
    /// How many attempts in all before the job is dead-lettered; `None`
    /// leaves the choice to the worker's configuration.
    pub max_attempts: Option<u32>,
    /// The tenant the job is billed to, for fair dispatch across tenants.
    pub tenant: Option<String>,
    /// Its priority class, for fair dispatch (higher classes go first).
    pub priority: Priority,
    /// How long before its run-at the job may run, when workers are idle
    /// (`None`: never early). Retries never carry it.
    pub early: Option<Duration>,
    /// Why the previous attempt failed, carried on retries and dead letters.
    pub last_error: Option<String>,
    /// The key its pacing rule counts it under (`[worker.pacing]`), e.g. the
    /// host of a URL while the entity key is the URL; `None`: its entity key.
    pub limit_key: Option<Vec<u8>>,
    /// Set by a worker on a job it parked behind a held key (the park's
    /// sequence number in that key's hold); never set by producers.
    pub parked: Option<u64>,
    /// Skip a first attempt that a worker reads while a job of the same key
    /// is running or waiting there (settled without running, counted as
    /// skipped) instead of queueing it: for periodic work where a missed
    /// run is better than runs piling up (`kairos-if-busy: skip`).
    pub skip_if_busy: bool,
    /// Headers the producer set for its own use, in order, passed through
    /// untouched (`None` is a header with a null value, which Kafka allows).
    pub headers: HeaderList,
}

impl Job {
    /// A job for `key` on work topic `topic`, due now, first attempt.
    pub fn new(topic: impl Into<String>, key: impl Into<Vec<u8>>, payload: impl Into<Vec<u8>>) -> Self {
        Job {
            id: JobId::new(),
            key: key.into(),
            payload: payload.into(),
            run_at: truncate_to_millis(Utc::now()),
            topic: topic.into(),
            attempt: 1,
            max_attempts: None,
            tenant: None,
            priority: Priority::Normal,
            early: None,
            last_error: None,
            limit_key: None,
            parked: None,
            skip_if_busy: false,
            headers: Vec::new(),
        }
    }

    /// The id a scheduler keeps this job under: its id, and for a park (a
    /// copy a worker parked behind its held key, [`Job::parked`] set) an id
    /// of that park's own ([`JobId::for_park`]), so that two parks of a
    /// job, or a park and the job's retry, never replace each other there.
    pub fn stored_id(&self) -> JobId {
        self.parked.map_or(self.id, |seq| self.id.for_park(seq))
    }

    /// Run no earlier than `when` (kept to millisecond precision, as on the wire).
    pub fn at(mut self, when: DateTime<Utc>) -> Self {
        self.run_at = truncate_to_millis(when);
        self
    }

    /// Run no earlier than `delay` from now.
    pub fn after(self, delay: Duration) -> Self {
        let delay = chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX);
        let when = Utc::now()
            .checked_add_signed(delay)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        self.at(when)
    }

    /// Use this id instead of a fresh one (for idempotent producers that
    /// derive ids from their own data).
    pub fn id(mut self, id: JobId) -> Self {
        self.id = id;
        self
    }

    /// Release the job in priority class `priority` (fair topics).
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Let the job run up to `allowance` before its run-at when workers are
    /// idle (kept to millisecond precision, as on the wire).
    pub fn early(mut self, allowance: Duration) -> Self {
        self.early = Some(Duration::from_millis(
            allowance.as_millis().min(u64::MAX as u128) as u64
        ));
        self
    }

    /// The earliest instant the job may start: its run-at, less its early
    /// allowance if it has one.
    pub fn earliest_start(&self) -> DateTime<Utc> {
        let allowance = self
            .early
            .and_then(|d| chrono::Duration::from_std(d).ok())
            .unwrap_or_default();
        self.run_at
            .checked_sub_signed(allowance)
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// Bill the job to `tenant`.
    pub fn tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
        self
    }

    /// Pace the job under `key` instead of its entity key (see
    /// `[worker.pacing]`: e.g. the host of a URL).
    pub fn limit_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.limit_key = Some(key.into());
        self
    }

    /// The key its pacing rule counts it under: its limit key, else its entity key.
    pub fn pacing_key(&self) -> &[u8] {
        self.limit_key.as_deref().unwrap_or(&self.key)
    }

    /// Allow at most `n` attempts before the job is dead-lettered.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    /// Add a user header (any name not starting with `kairos-`).
    pub fn header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), Some(value.into())));
        self
    }

    /// The key as text, with invalid UTF-8 replaced, for logs and displays.
    pub fn key_lossy(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.key)
    }

    /// Whether the job may run at `now`.
    pub fn is_due(&self, now: DateTime<Utc>) -> bool {
        self.run_at <= now
    }
}

/// Drop sub-millisecond precision, the precision of the wire format.
pub fn truncate_to_millis(t: DateTime<Utc>) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(t.timestamp_millis())
        .single()
        .unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_ids_are_stable_and_distinct() {
        let a = JobId::derived("jobs", 0, 10, 1_700_000_000_000);
        let b = JobId::derived("jobs", 0, 10, 1_700_000_000_000);
        let c = JobId::derived("jobs", 0, 11, 1_700_000_000_000);
        let d = JobId::derived("jobs", 1, 10, 1_700_000_000_000);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        assert_eq!(a.uuid().get_version_num(), 7);
    }

    #[test]
    fn a_park_is_stored_under_an_id_of_its_own_and_a_job_under_its_id() {
        let mut job = Job::new("jobs", "k", "p");
        assert_eq!(job.stored_id(), job.id);
        job.parked = Some(5);
        assert_eq!(job.stored_id(), job.id.for_park(5));
        let mut again = job.clone();
        again.parked = Some(6);
        assert_ne!(again.stored_id(), job.stored_id(), "two parks of one job");
    }

    #[test]
    fn each_park_of_a_job_has_an_id_of_its_own_that_leads_back_to_the_job() {
        let id = JobId::new();
        let (one, two) = (id.for_park(1), id.for_park(2));
        assert_ne!(one, id);
        assert_ne!(one, two);
        assert_ne!(one.uuid().get_variant(), uuid::Variant::RFC4122);
        assert_eq!(one.of_park(1), id);
        assert_eq!(two.of_park(2), id);
        // Any id, RFC 4122 or not, has parks of their own that lead back to it.
        let other = JobId::from(Uuid::from_u128(0x5a << 56));
        assert_ne!(other.for_park(3), other);
        assert_ne!(other.for_park(3), other.for_park(4));
        assert_eq!(other.for_park(3).of_park(3), other);
        // Wide park numbers (a hold's identity in the top bits) too, up to
        // the largest: none gives an RFC 4122 id, none gives another's.
        let wide = [1u64 << 32 | 1, 1 << 32 | 2, 2 << 32 | 1, (1 << 62) - 1, u64::MAX];
        for n in wide {
            assert_eq!(id.for_park(n).of_park(n), id, "{n:#x}");
            assert_ne!(
                id.for_park(n).uuid().get_variant(),
                uuid::Variant::RFC4122,
                "{n:#x}"
            );
        }
        let ids: std::collections::HashSet<_> = wide.iter().map(|n| id.for_park(*n)).collect();
        assert_eq!(ids.len(), wide.len());
    }

    #[test]
    fn derived_ids_never_change_whichever_topic_came_before() {
        // Pinned values (computed independently): a derived id must be the
        // same in every release, or a re-read record would become a new job.
        let jobs = "018bcfe5-6800-7337-8c97-6c9649c9b805";
        let other = "00000000-0005-7a63-8777-3a7de4fe8cf3";
        for _ in 0..2 {
            assert_eq!(JobId::derived("jobs", 0, 10, 1_700_000_000_000).to_string(), jobs);
            assert_eq!(JobId::derived("other", 3, 7, 5).to_string(), other);
        }
        assert_eq!(JobId::derived("jobs", 0, 10, 1_700_000_000_000).to_string(), jobs);
    }

    #[test]
    fn derived_ids_sort_by_timestamp() {
        let early = JobId::derived("jobs", 5, 999, 1_000);
        let late = JobId::derived("jobs", 0, 0, 2_000);
        assert!(early < late);
    }

    #[test]
    fn generated_ids_are_v7_and_round_trip_as_text_and_bytes() {
        let id = JobId::new();
        assert_eq!(id.uuid().get_version_num(), 7);
        assert_eq!(id.to_string().parse::<JobId>().unwrap(), id);
        assert_eq!(JobId::from_bytes(*id.as_bytes()), id);
    }

    #[test]
    fn after_saturates_instead_of_overflowing() {
        let job = Job::new("t", "k", "p").after(Duration::from_secs(u64::MAX));
        assert!(job.run_at.timestamp_millis() > 0);
    }
}
