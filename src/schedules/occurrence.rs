//! An occurrence's job: its id from the schedule's id and the occurrence's
//! nominal time, so that enqueuing it again gives the same job.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{Overlap, Schedule};
use crate::job::{Job, JobId};

/// The UUID namespace of occurrence ids (a version 5 UUID, so any client
/// can compute one: `uuid5(OCCURRENCE_NAMESPACE, "<schedule id>@<nominal ms>")`).
pub const OCCURRENCE_NAMESPACE: Uuid = Uuid::from_u128(0x6b61_6972_6f73_4a00_8000_7265_6375_7272);

/// The id of `schedule_id`'s occurrence at `nominal`.
pub fn occurrence_id(schedule_id: &str, nominal: DateTime<Utc>) -> JobId {
    let name = format!("{schedule_id}@{}", nominal.timestamp_millis());
    JobId::from_bytes(*Uuid::new_v5(&OCCURRENCE_NAMESPACE, name.as_bytes()).as_bytes())
}

/// The job `schedule`'s occurrence at `nominal` enqueues: its run-at is the
/// nominal time plus the schedule's jitter for that occurrence.
pub fn occurrence_job(schedule: &Schedule, nominal: DateTime<Utc>) -> Job {
    let t = &schedule.job;
    let key = match schedule.overlap {
        Overlap::Queue | Overlap::Skip => schedule.key().to_string(),
        Overlap::Parallel => format!("{}@{}", schedule.key(), nominal.timestamp_millis()),
    };
    let mut job = Job::new(t.topic.clone(), key, t.payload.clone().into_bytes())
        .at(nominal + jitter(schedule, nominal));
    job.id = occurrence_id(&schedule.id, nominal);
    job.tenant = t.tenant.clone();
    job.priority = t.priority;
    job.max_attempts = t.max_attempts;
    job.skip_if_busy = schedule.overlap == Overlap::Skip;
    job.headers = t
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), Some(v.clone().into_bytes())))
        .collect();
    job
}

/// The occurrence's delay within the schedule's jitter: the same on every
/// instance (a hash of the schedule id and the nominal time).
fn jitter(schedule: &Schedule, nominal: DateTime<Utc>) -> chrono::Duration {
    let span = schedule.jitter.as_millis() as u64;
    if span == 0 {
        return chrono::Duration::zero();
    }
    let h = u64::from_be_bytes(
        occurrence_id(&schedule.id, nominal).as_bytes()[8..]
            .try_into()
            .expect("8 bytes"),
    );
    chrono::Duration::milliseconds((h % span) as i64)
}
