//! The demo's fair dispatch: one tenant floods a fair topic, then a quiet
//! tenant writes a few jobs; the summary prints how long each tenant's jobs
//! waited from being written to starting.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use super::{failed, DemoError};
use kairos::{Job, Producer};

/// Jobs the flooding tenant writes at once.
const FLOOD: usize = 3_000;
/// Jobs the quiet tenant writes after it, one every 20 ms.
const QUIET: usize = 30;

/// A fair job's start, as the worker reports it.
pub(super) struct FairStart {
    pub(super) tenant: String,
    pub(super) run_at: DateTime<Utc>,
    pub(super) started: DateTime<Utc>,
}

/// Per tenant: jobs started, and their wait from run-at (for these due-now
/// jobs, when they were written) to start, p50 and max, in ms.
pub type TenantWaits = BTreeMap<String, (usize, i64, i64)>;

/// Write the flood and the quiet tenant's jobs to `topic` (a fair topic)
/// and wait for every one to start.
pub(super) async fn show(
    producer: &Producer,
    topic: &str,
    starts: &mut mpsc::UnboundedReceiver<FairStart>,
) -> Result<TenantWaits, DemoError> {
    println!("\nfair       tenant `flood` writes {FLOOD} jobs at once to the fair topic {topic}; then tenant `quiet` writes {QUIET}");
    let flood: Vec<Job> = (0..FLOOD)
        .map(|i| Job::new(topic, format!("flood-{}", i % 100), b"work=5".to_vec()).tenant("flood"))
        .collect();
    for chunk in flood.chunks(500) {
        let writes = chunk.iter().map(|j| producer.enqueue(j.clone()).into_future());
        for r in futures::future::join_all(writes).await {
            r.map_err(failed)?;
        }
    }
    for i in 0..QUIET {
        let job = Job::new(topic, format!("quiet-{}", i % 10), b"work=5".to_vec()).tenant("quiet");
        producer.enqueue(job).await.map_err(failed)?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut waits: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    let mut seen = 0;
    while seen < FLOOD + QUIET {
        match tokio::time::timeout_at(deadline, starts.recv()).await {
            Ok(Some(s)) => {
                seen += 1;
                waits
                    .entry(s.tenant)
                    .or_default()
                    .push((s.started - s.run_at).num_milliseconds());
            }
            _ => {
                return Err(failed(format!(
                    "only {seen} of the fair topic's jobs started within 120 s"
                )))
            }
        }
    }
    let mut out = TenantWaits::new();
    for (tenant, mut w) in waits {
        w.sort_unstable();
        let p50 = w[(w.len() - 1) / 2];
        let max = *w.last().unwrap_or(&0);
        println!(
            "fair       tenant `{tenant}`: {} jobs started, waited from write to start p50 {p50} ms, max {max} ms",
            w.len()
        );
        out.insert(tenant, (w.len(), p50, max));
    }
    println!(
        "           (the scheduler keeps the workers' backlog near what they finish in [fair] backlog_time and picks the tenant\n           \
         with the least recent use: `quiet` does not wait behind `flood`'s jobs)"
    );
    Ok(out)
}
