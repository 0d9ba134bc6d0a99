//! The demo's sample jobs: every 5th due now, the rest delayed; some fail
//! once, a few always; a few delayed ones cancelled or moved later before
//! their run-at.

use std::collections::{HashMap, HashSet};
use std::future::IntoFuture;

use chrono::{DateTime, Utc};

use super::{failed, DemoError, DemoOptions, MOVED_BY_MS};
use kairos::{Job, JobId, Producer};

/// The jobs written, and what was changed of them.
pub(super) struct Sample {
    pub(super) jobs: Vec<Job>,
    /// Jobs due at or after this were written delayed.
    pub(super) delayed_from: DateTime<Utc>,
    pub(super) cancelled: HashSet<JobId>,
    /// The new run-at of each job moved.
    pub(super) moved: HashMap<JobId, DateTime<Utc>>,
}

/// Write `opts.jobs` jobs to `work`, cancel and move a few, and say so.
pub(super) async fn write(producer: &Producer, work: &str, opts: &DemoOptions) -> Result<Sample, DemoError> {
    let start = Utc::now();
    let delayed_from = start + chrono::Duration::seconds(2);
    let mut jobs = Vec::new();
    let (mut flaky, mut doomed) = (0, 0);
    for i in 0..opts.jobs {
        let key = format!("user-{:03}", i % opts.keys.max(1));
        let at = if i % 5 == 0 {
            Utc::now()
        } else {
            let ms = (i as u64 * 7919) % (opts.max_delay.as_millis() as u64).max(1);
            delayed_from + chrono::Duration::milliseconds(ms as i64)
        };
        let mut payload = format!("job#{i} work=20");
        if i % 50 == 7 {
            payload.push_str(" fail=99");
            doomed += 1;
        } else if i % 10 == 3 {
            payload.push_str(" fail=1");
            flaky += 1;
        }
        jobs.push(
            Job::new(work, key, payload.into_bytes())
                .tenant(format!("tenant-{}", i % 3))
                .at(at),
        );
    }
    let writes = jobs.iter().map(|j| producer.enqueue(j.clone()).into_future());
    for r in futures::future::join_all(writes).await {
        r.map_err(failed)?;
    }
    // A few delayed jobs that would succeed: cancelled, or moved later.
    let steady: Vec<&Job> = jobs
        .iter()
        .filter(|j| j.run_at >= delayed_from && !String::from_utf8_lossy(&j.payload).contains("fail"))
        .collect();
    let cancelled: HashSet<JobId> = steady.iter().step_by(20).map(|j| j.id).collect();
    let moved: HashMap<JobId, DateTime<Utc>> = steady
        .iter()
        .skip(10)
        .step_by(20)
        .map(|j| {
            let at = kairos::job::truncate_to_millis(j.run_at + chrono::Duration::milliseconds(MOVED_BY_MS));
            (j.id, at)
        })
        .collect();
    for id in &cancelled {
        producer.cancel(*id).await.map_err(failed)?;
    }
    for (id, at) in &moved {
        producer.reschedule(*id, *at).await.map_err(failed)?;
    }
    println!(
        "producer   wrote {} jobs for {} keys: {} due now, {} delayed up to {:?}; {} fail once, {} always fail;\n           \
         then cancelled {} and moved {} others {} s later, all before their run-at\n",
        jobs.len(),
        opts.keys,
        jobs.len().div_ceil(5),
        jobs.len() - jobs.len().div_ceil(5),
        opts.max_delay,
        flaky,
        doomed,
        cancelled.len(),
        moved.len(),
        MOVED_BY_MS / 1000
    );
    Ok(Sample {
        jobs,
        delayed_from,
        cancelled,
        moved,
    })
}
