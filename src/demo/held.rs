//! The demo's held key: on a `hold_key` topic, job 2 of key `order-7`
//! fails twice; the key's later jobs wait (parked through the scheduler)
//! while another key runs, then run in order.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use super::{failed, DemoError};
use kairos::worker::Outcome;
use kairos::{Job, Producer};

/// The held key, and a key beside it.
const HELD: &str = "order-7";
const OTHER: &str = "order-8";
/// Jobs per key.
const JOBS: u32 = 5;

/// A start on the held-key topic, as the worker reports it.
pub(super) struct HeldStart {
    pub(super) key: String,
    pub(super) n: u32,
    pub(super) attempt: u32,
    pub(super) at: DateTime<Utc>,
}

/// What the demo's handler does on the held-key topic: job 2 of the held
/// key fails on its first two attempts.
pub(super) fn outcome(job: &Job) -> Outcome {
    if job.key == HELD.as_bytes() && job.payload == b"2" && job.attempt <= 2 {
        Outcome::retry_after(Duration::from_millis(400), "payment gateway timeout")
    } else {
        Outcome::done()
    }
}

/// Write both keys' jobs to `topic` and print the starts; returns the held
/// key's starts (job numbers, in order).
pub(super) async fn show(
    producer: &Producer,
    topic: &str,
    starts: &mut mpsc::UnboundedReceiver<HeldStart>,
) -> Result<Vec<u32>, DemoError> {
    println!(
        "\nheld key   on {topic} (on_failure = \"hold_key\"): jobs 1-{JOBS} of {HELD} and of {OTHER}; \
         {HELD}'s job 2 fails twice"
    );
    for n in 1..=JOBS {
        for key in [HELD, OTHER] {
            let job = Job::new(topic, key, n.to_string().into_bytes());
            producer.enqueue(job).await.map_err(failed)?;
        }
    }
    let (mut held, mut other_done_at, mut held_again_at) = (Vec::new(), None, None);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while held.len() < 7 || other_done_at.is_none() {
        let s = match tokio::time::timeout_at(deadline, starts.recv()).await {
            Ok(Some(s)) => s,
            _ => return Err(failed("the held-key jobs did not all start within 60 s")),
        };
        if s.key == HELD {
            let what = match (s.n, s.attempt) {
                (2, 1) => "fails: the key is held, its later jobs parked",
                (2, 2) => "fails again: still held",
                (2, _) => "succeeds: the parked jobs come back in order",
                _ => "done",
            };
            println!(
                "held key   {}  {HELD} job {} attempt {}: {what}",
                s.at.format("%H:%M:%S%.3f"),
                s.n,
                s.attempt
            );
            if s.n == 2 && s.attempt == 3 {
                held_again_at = Some(s.at);
            }
            held.push(s.n);
        } else if s.n == JOBS {
            other_done_at = Some(s.at);
        }
    }
    println!(
        "held key   {HELD} ran {:?}; {OTHER} ran all {JOBS} jobs meanwhile{}",
        held,
        match (other_done_at, held_again_at) {
            (Some(o), Some(h)) if o < h =>
                format!(", done {} ms before job 2's last try", (h - o).num_milliseconds()),
            _ => String::new(),
        }
    );
    Ok(held)
}
