//! What a job handler is and what it returns.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::job::Job;

/// What became of a job. Expected outcomes are values, not errors.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Finished. The follow-up jobs are written (and acknowledged by Kafka)
    /// before the job counts as done.
    Done {
        /// Jobs to schedule, at any run-at.
        follow_ups: Vec<Job>,
    },
    /// Failed; try again later through the scheduler, or dead-letter it if
    /// this was the last attempt.
    Retry {
        /// Delay before the next attempt; `None` uses the worker's backoff.
        after: Option<Duration>,
        /// Why it failed (carried in `kairos-last-error`).
        error: String,
    },
    /// Failed for good: dead-letter it now, whatever attempts are left.
    Dead {
        /// Why (carried in `kairos-dead-reason`).
        reason: String,
    },
    /// Not run now: a remote service said to wait (an HTTP 429 with
    /// `Retry-After`, a crawl delay). The job runs again at `until` without
    /// spending an attempt; on a paced topic its limiter key pauses until
    /// then too, and its key is held meanwhile.
    RateLimited {
        /// When to run it again.
        until: DateTime<Utc>,
    },
}

impl Outcome {
    /// Done, nothing to follow.
    pub fn done() -> Self {
        Outcome::Done {
            follow_ups: Vec::new(),
        }
    }

    /// Done; schedule these jobs.
    pub fn done_with(follow_ups: Vec<Job>) -> Self {
        Outcome::Done { follow_ups }
    }

    /// Failed; retry with the worker's backoff.
    pub fn retry(error: impl Into<String>) -> Self {
        Outcome::Retry {
            after: None,
            error: error.into(),
        }
    }

    /// Failed; retry after `delay`.
    pub fn retry_after(delay: Duration, error: impl Into<String>) -> Self {
        Outcome::Retry {
            after: Some(delay),
            error: error.into(),
        }
    }

    /// Failed for good.
    pub fn dead(reason: impl Into<String>) -> Self {
        Outcome::Dead {
            reason: reason.into(),
        }
    }

    /// Rate limited: run again at `until`, without spending an attempt.
    pub fn rate_limited(until: DateTime<Utc>) -> Self {
        Outcome::RateLimited {
            until: crate::job::truncate_to_millis(until),
        }
    }

    /// Rate limited: run again `wait` from now, without spending an attempt.
    pub fn rate_limited_for(wait: Duration) -> Self {
        let until = chrono::Duration::from_std(wait)
            .ok()
            .and_then(|d| Utc::now().checked_add_signed(d))
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        Self::rate_limited(until)
    }
}

/// Where a job came from and how to know it should stop.
#[derive(Clone, Debug)]
pub struct JobContext {
    /// Work topic the job was read from.
    pub topic: String,
    /// Partition it was read from.
    pub partition: i32,
    /// Offset it was read from.
    pub offset: i64,
    /// Cancelled when the job's partition is revoked or the worker shuts
    /// down. A handler that runs long should watch it and return soon after
    /// (any outcome); past the revocation deadline the partition is released
    /// anyway and the job may run again elsewhere.
    pub cancel: CancellationToken,
}

/// A boxed handler future.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Outcome> + Send + 'static>>;

/// A job handler: any `Fn(Job, JobContext) -> impl Future<Output = Outcome>`.
pub trait Handler: Send + Sync + 'static {
    /// Run one job.
    fn call(&self, job: Job, ctx: JobContext) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(Job, JobContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    fn call(&self, job: Job, ctx: JobContext) -> HandlerFuture {
        Box::pin((self)(job, ctx))
    }
}

/// Run a handler's future, turning a panic into a failed attempt: the
/// outcome, and the panic's message when it panicked.
pub(crate) async fn run_caught(run: impl Future<Output = Outcome>) -> (Outcome, Option<String>) {
    use futures::FutureExt;
    match std::panic::AssertUnwindSafe(run).catch_unwind().await {
        Ok(o) => (o, None),
        Err(panic) => {
            let msg = panic_message(&*panic).unwrap_or_else(|| "unknown panic".into());
            (Outcome::retry(format!("handler panicked: {msg}")), Some(msg))
        }
    }
}

/// A panic's message, when it carries one (`panic!` with a string).
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> Option<String> {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
}

/// Exponential backoff with jitter: attempt `n` (from 1) waits a random
/// time between half and all of `min(max, base * 2^(n-1))`, so that failed
/// jobs do not all come back at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failure (before jitter).
    pub base: Duration,
    /// Longest delay.
    pub max: Duration,
}

impl Backoff {
    /// The delay before the attempt after failed attempt `attempt`.
    pub fn delay(&self, attempt: u32, rng: &mut impl rand::Rng) -> Duration {
        let exp = attempt.saturating_sub(1).min(62);
        let full = self.base.saturating_mul(1u32 << exp.min(31)).min(self.max);
        let full = if exp > 31 { self.max } else { full };
        let half = full / 2;
        half + full.saturating_sub(half).mul_f64(rng.gen::<f64>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_with_jitter_and_is_capped() {
        let b = Backoff {
            base: Duration::from_secs(1),
            max: Duration::from_secs(60),
        };
        let mut rng = rand::thread_rng();
        for _ in 0..100 {
            let d1 = b.delay(1, &mut rng);
            assert!(
                d1 >= Duration::from_millis(500) && d1 <= Duration::from_secs(1),
                "{d1:?}"
            );
            let d4 = b.delay(4, &mut rng);
            assert!(
                d4 >= Duration::from_secs(4) && d4 <= Duration::from_secs(8),
                "{d4:?}"
            );
            let d30 = b.delay(30, &mut rng);
            assert!(
                d30 >= Duration::from_secs(30) && d30 <= Duration::from_secs(60),
                "{d30:?}"
            );
            assert!(b.delay(u32::MAX, &mut rng) <= Duration::from_secs(60));
        }
    }
}
