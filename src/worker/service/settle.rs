//! Settlement: carrying out a handler's outcome (retry through the
//! scheduler, dead letter, follow-ups) and marking records finished so
//! their offsets may be committed.

use std::future::{Future, IntoFuture};
use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Shared, State, Tp};

use crate::job::Job;
use crate::wire::DeadLetter;
use crate::worker::handler::Outcome;
use crate::{kafka, wire};

/// Note a record as read and unfinished, if its partition is owned.
pub(super) fn begin(shared: &Shared, tp: Tp, offset: i64) -> bool {
    let mut st = shared.state();
    if !st.owned.contains_key(&tp) {
        return false;
    }
    st.tracker.read(tp, offset);
    true
}

/// Retry a write until it succeeds; false if the worker stopped first (the
/// record then stays unfinished and is re-delivered).
pub(super) fn write_until_done<F, Fut, T, E>(
    shared: &Shared,
    cancel: Option<&CancellationToken>,
    f: F,
) -> bool
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut delay = kafka::RetryDelay::new();
    loop {
        match futures::executor::block_on(f()) {
            Ok(_) => return true,
            Err(e) => warn!(error = %e, "write failed; retrying"),
        }
        if shared.stop.is_cancelled() || cancel.is_some_and(|c| c.is_cancelled()) {
            return false;
        }
        std::thread::sleep(delay.next_delay());
    }
}

/// Mark a record finished; if it belongs to the current ownership of its
/// partition, its commit point may advance.
pub(super) fn finish_offset(shared: &Shared, tp: Tp, offset: i64, generation: Option<u64>) {
    finish_in(&mut shared.state(), tp, offset, generation);
}

pub(super) fn finish_in(st: &mut State, tp: Tp, offset: i64, generation: Option<u64>) {
    let current = st.owned.get(&tp).map(|o| o.generation);
    if current.is_none() || (generation.is_some() && generation != current) {
        return;
    }
    if let Some(c) = st.tracker.finish(tp, offset) {
        st.to_store.insert(tp, c);
    }
}

/// Carry out an outcome; true once its effects are acknowledged by Kafka.
pub(super) async fn settle(
    shared: &Shared,
    job: &Job,
    tp: Tp,
    offset: i64,
    outcome: Outcome,
    cancel: &CancellationToken,
) -> bool {
    let mut delay = kafka::RetryDelay::new();
    loop {
        let result: Result<(), String> = match &outcome {
            Outcome::Done { follow_ups } => {
                let writes = follow_ups
                    .iter()
                    .map(|f| shared.producer.enqueue(f.clone()).into_future());
                let results = futures::future::join_all(writes).await;
                match results.into_iter().find_map(Result::err) {
                    None => {
                        shared.stats.succeeded.fetch_add(1, Ordering::Relaxed);
                        debug!(job_id = %job.id, follow_ups = follow_ups.len(), "done");
                        Ok(())
                    }
                    // A follow-up that can never be written fails the job for
                    // good (retrying the job would hit the same wall).
                    Some(e) if e.is_permanent() => {
                        let reason = format!("follow-up rejected: {e}");
                        dead_letter(shared, job, tp, offset, &reason, None).await
                    }
                    Some(e) => Err(e.to_string()),
                }
            }
            Outcome::Retry { after, error } => {
                let max = job.max_attempts.unwrap_or(shared.cfg.worker.max_attempts);
                if job.attempt >= max {
                    let reason = format!("gave up after {} attempts: {error}", job.attempt);
                    dead_letter(shared, job, tp, offset, &reason, Some(error)).await
                } else {
                    let delay =
                        after.unwrap_or_else(|| shared.backoff.delay(job.attempt, &mut rand::thread_rng()));
                    let mut next = job.clone();
                    next.attempt += 1;
                    next.last_error = Some(error.clone());
                    let now = shared.clock.now();
                    next.run_at = now + chrono::Duration::from_std(delay).unwrap_or_default();
                    next.run_at = crate::job::truncate_to_millis(next.run_at);
                    match shared.producer.enqueue(next).await {
                        Ok(_) => {
                            shared.stats.retried.fetch_add(1, Ordering::Relaxed);
                            debug!(job_id = %job.id, attempt = job.attempt, delay = ?delay, error = %error, "retry scheduled");
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
            }
            Outcome::Dead { reason } => dead_letter(shared, job, tp, offset, reason, None).await,
        };
        match result {
            Ok(()) => return true,
            Err(e) => warn!(job_id = %job.id, error = %e, "writing the outcome failed; retrying"),
        }
        if cancel.is_cancelled() {
            return false; // re-delivered to the partition's next owner
        }
        tokio::time::sleep(delay.next_delay()).await;
    }
}

pub(super) async fn dead_letter(
    shared: &Shared,
    job: &Job,
    tp: Tp,
    offset: i64,
    reason: &str,
    last_error: Option<&String>,
) -> Result<(), String> {
    let mut j = job.clone();
    if let Some(e) = last_error {
        j.last_error = Some(e.clone());
    }
    let dead = DeadLetter {
        reason: reason.to_string(),
        origin_topic: shared.topics[tp.0].clone(),
        origin_partition: tp.1,
        origin_offset: offset,
    };
    let rec = wire::dead_job_record(&j, &dead, &shared.cfg.topics.dead_letter);
    kafka::send(&shared.raw, &rec, None)
        .await
        .map_err(|e| e.to_string())?;
    shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
    warn!(job_id = %job.id, key = %job.key_lossy(), reason, "job dead-lettered");
    Ok(())
}
