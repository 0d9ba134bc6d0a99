//! Drivers: tasks that run the handlers of the jobs taken from the lock
//! table, settle finished jobs in batches and start the jobs they unblock.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use tracing::{warn, Instrument};

use super::held;
use super::keeper;
use super::pace;
use super::ready::{start_ready, Start};
use super::transactions::StageIn;
use super::{Entry, Shared, Tp};

use crate::worker::handler::{run_caught, JobContext};
use crate::worker::settle::{Origin, Settled};

/// A job whose handler run is over.
pub(super) struct Finished {
    pub(super) key: Vec<u8>,
    pub(super) tp: Tp,
    pub(super) offset: i64,
    pub(super) generation: u64,
    /// Its outcome is acknowledged by Kafka: its offset may be committed.
    pub(super) settled: bool,
    /// It took no concurrency slot: it was settled without running its
    /// handler (see [`Entry::instead`]).
    pub(super) no_slot: bool,
}

impl Finished {
    /// A run whose outcome was not written (its partition was taken away):
    /// the record stays unfinished and is re-delivered.
    fn unsettled(job: crate::job::Job, tp: Tp, offset: i64, generation: u64) -> Self {
        Finished {
            key: job.key,
            tp,
            offset,
            generation,
            settled: false,
            no_slot: false,
        }
    }
}

/// A driver: runs the handlers of the jobs it is given, settles finished
/// jobs in batches and starts the jobs they unblock. Once `halt` is
/// cancelled (every partition was released) it ends when its last handler
/// does: a handler deaf to cancellation runs on past the worker's stop, as a
/// spawned task would (the documented overlap).
pub(super) async fn drive(
    shared: Arc<Shared>,
    mut inbox: tokio::sync::mpsc::UnboundedReceiver<Vec<Start>>,
    halt: CancellationToken,
) {
    let mut running = FuturesUnordered::new();
    let mut done: Vec<Finished> = Vec::new();
    let mut halted = false;
    loop {
        if halted && running.is_empty() {
            return;
        }
        // The inbox never closes while a driver runs: its senders live in
        // `Shared`, which the driver holds.
        tokio::select! {
            _ = halt.cancelled(), if !halted => halted = true,
            Some(starts) = inbox.recv() => {
                running.extend(starts.into_iter().map(|s| run_job(shared.clone(), s)));
            }
            Some(f) = running.next(), if !running.is_empty() => done.push(f),
        }
        // Whatever else finished meanwhile is settled in the same lock.
        while let Some(Some(f)) = running.next().now_or_never() {
            done.push(f);
        }
        if !done.is_empty() {
            let starts = settle_finished(&shared, &mut done);
            running.extend(starts.into_iter().map(|s| run_job(shared.clone(), s)));
        }
    }
}

/// Mark finished jobs done in the lock table and offset tracker; returns the
/// jobs that may start now. A key that became held has its buffered jobs
/// parked instead.
pub(super) fn settle_finished(shared: &Shared, done: &mut Vec<Finished>) -> Vec<Start> {
    let mut parks = Vec::new();
    let starts = {
        let mut st = shared.jobs.lock();
        for f in done.drain(..) {
            if f.no_slot {
                st.no_slot = st.no_slot.saturating_sub(1);
            }
            if f.settled {
                held::park_buffered(&mut st, f.tp, &f.key, &mut parks);
            }
            st.table.complete(&f.key);
            if let Some(n) = st.in_flight.get_mut(&f.tp) {
                *n = n.saturating_sub(1);
            }
            if f.settled {
                st.finish(f.tp, f.offset, Some(f.generation));
            }
        }
        // Handed to the keeper under the lock that gave them their park
        // sequence, so that the keeper writes them in that order.
        keeper::hand(shared, &mut st, std::mem::take(&mut parks));
        start_ready(shared, &mut st)
    };
    shared.jobs.notify_finished();
    starts
}

pub(super) async fn run_job(shared: Arc<Shared>, start: Start) -> Finished {
    let no_slot = start.entry.instead.is_some();
    Finished {
        no_slot,
        ..run(shared, start).await
    }
}

async fn run(shared: Arc<Shared>, start: Start) -> Finished {
    let Start {
        entry:
            Entry {
                job,
                tp,
                offset,
                instead,
                ..
            },
        cancel,
        generation,
    } = start;
    let ctx = JobContext {
        topic: shared.topics.names[tp.0].clone(),
        partition: tp.1,
        offset,
        cancel: cancel.clone(),
    };
    // A job slightly early (within the tolerance) waits here: it never starts
    // before its run-at, less its early allowance if it has one.
    let early = job.earliest_start() - shared.clock.now();
    if early > chrono::Duration::zero() && instead.is_none() {
        let wait = early.to_std().unwrap_or_default();
        // Boxed, as it is rare: a timer inline would grow every job's future.
        Box::pin(async {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancel.cancelled() => {}
            }
        })
        .await;
    }
    if cancel.is_cancelled() {
        return Finished::unsettled(job, tp, offset, generation);
    }
    shared.stats.started.fetch_add(1, Ordering::Relaxed);
    let by_topic = shared.stats.by_topic.get(tp.0);
    if let Some(t) = by_topic {
        t.started.fetch_add(1, Ordering::Relaxed);
    }
    let span = tracing::debug_span!("job", job_id = %job.id, key = %job.key_lossy(), topic = %ctx.topic,
        partition = tp.1, offset, attempt = job.attempt);
    let outcome = match instead {
        // Settled without running (a released key's blocker).
        Some(outcome) => outcome,
        None => {
            let started = std::time::Instant::now();
            let delay = shared.clock.now() - job.run_at;
            shared.stats.start_delay.observe_ms(delay.num_milliseconds());
            let (outcome, panic) =
                run_caught(shared.handler.call(job.clone(), ctx).instrument(span.clone())).await;
            shared.stats.duration.observe(started.elapsed());
            if let Some(msg) = panic {
                shared.stats.panicked.fetch_add(1, Ordering::Relaxed);
                warn!(parent: &span, panic = %msg, "handler panicked");
            }
            if let crate::worker::Outcome::RateLimited { until } = &outcome {
                pace::pause(&shared, tp, job.pacing_key(), until.timestamp_millis());
            }
            outcome
        }
    };
    let origin = Origin {
        topic: &shared.topics.names[tp.0],
        partition: tp.1,
        offset,
        generation,
    };
    // Used in exactly-once mode only (the settler's `staged` says which).
    let stage = StageIn(&shared);
    // Boxed: the settling future is large and rarely more than one
    // write; inline, it would make every job's future kilobytes big.
    let settled = Box::pin(
        shared
            .out
            .settler
            .settle(&job, origin, outcome, &cancel, Some(&stage)),
    )
    .instrument(span.clone())
    .await;
    let settled = match settled {
        // Its key's hold, if it has one, is written before it counts as finished.
        Some(s)
            if held::settled(&shared, &job, (tp, offset, generation), &s)
                .instrument(span)
                .await =>
        {
            Some(s)
        }
        _ => None,
    };
    let (counter, topic_counter) = match &settled {
        Some(Settled::Done { .. }) => (&shared.stats.succeeded, by_topic.map(|t| &t.succeeded)),
        Some(Settled::Retried { .. }) => (&shared.stats.retried, by_topic.map(|t| &t.retried)),
        Some(Settled::Deferred { .. }) => (&shared.stats.deferred, by_topic.map(|t| &t.deferred)),
        Some(Settled::DeadLettered { .. }) => {
            (&shared.stats.dead_lettered, by_topic.map(|t| &t.dead_lettered))
        }
        None => {
            if let Some(t) = by_topic {
                t.unsettled.fetch_add(1, Ordering::Relaxed);
            }
            return Finished::unsettled(job, tp, offset, generation);
        }
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if let Some(c) = topic_counter {
        c.fetch_add(1, Ordering::Relaxed);
    }
    Finished {
        key: job.key,
        tp,
        offset,
        generation,
        settled: true,
        no_slot: false,
    }
}
