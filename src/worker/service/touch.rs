//! In touch with the group coordinator: a worker that has not heard from
//! it for half the session timeout starts no job, since its partitions may
//! have moved without it knowing yet; a keep-alive thread commits to hear
//! from it when nothing else has lately.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::TopicPartitionList;
use tracing::debug;

use super::offsets::offset_to_commit;
use super::{ready, Shared, WorkerState};

impl Shared {
    /// Whether jobs may start: the group coordinator answered within half
    /// the session timeout. A worker that has not heard from it for longer
    /// may have lost its partitions without knowing yet (its session can
    /// expire on the coordinator while the two cannot reach each other, and
    /// the partitions go to another worker): a job it started then could
    /// run beside the new owner's run of the same key. Such a worker keeps
    /// what it has buffered and starts it once an answer comes.
    pub(super) fn in_touch(&self, st: &mut WorkerState) -> bool {
        if !self.out_of_touch(st) {
            return true;
        }
        let window = self.cfg.worker.session_timeout / 2;
        if !st.out_of_touch && !st.owned.is_empty() {
            tracing::warn!(for_at_least = ?window,
                "no answer from the group coordinator: starting no job until one comes (the partitions may have moved)");
        }
        st.out_of_touch = true;
        false
    }

    /// Whether the group coordinator has not answered for half the session
    /// timeout (see [`Shared::in_touch`]).
    pub(super) fn out_of_touch(&self, st: &WorkerState) -> bool {
        let window = self.cfg.worker.session_timeout / 2;
        st.heard.is_none_or(|t| t.elapsed() >= window)
    }

    /// The group coordinator answered (a commit was taken): jobs held back
    /// for want of an answer start.
    pub(super) fn heard_from_coordinator(&self) {
        let starts = {
            let mut st = self.jobs.lock();
            st.heard = Some(Instant::now());
            if std::mem::take(&mut st.out_of_touch) {
                tracing::info!("the group coordinator answered again: starting jobs");
                ready::start_ready(self, &mut st)
            } else {
                Vec::new()
            }
        };
        self.dispatch(starts);
    }
}

/// The keep-alive thread: every `every` until the worker stops,
/// [`hear_from_coordinator`]. A thread of its own, since a synchronous
/// commit waits for the coordinator, and while none answers the poll thread
/// must go on serving rebalances (a partition lost is let go, its handlers
/// cancelled, at once).
pub(super) fn keep_alive<C: ConsumerContext>(shared: &Shared, consumer: &BaseConsumer<C>, every: Duration) {
    while !shared.signals.stop.is_cancelled() {
        std::thread::sleep(every);
        hear_from_coordinator(shared, consumer);
    }
}

/// When the coordinator's last answer is a sixth of the session old, or
/// jobs wait for one (see [`Shared::in_touch`]): commit where the partitions
/// stand, synchronously (librdkafka reports the outcome of a manual
/// asynchronous commit to no callback, only its own timer's).
fn hear_from_coordinator<C: ConsumerContext>(shared: &Shared, consumer: &BaseConsumer<C>) {
    let _committing = shared.jobs.committing();
    let Some(points) = shared
        .jobs
        .keep_alive_points(shared.cfg.worker.session_timeout / 6)
    else {
        return;
    };
    let mut tpl = TopicPartitionList::new();
    for point in points {
        offset_to_commit(shared, &mut tpl, point);
    }
    if tpl.count() > 0 {
        // Stored too, so that librdkafka's own commits never go below.
        let _ = consumer.store_offsets(&tpl);
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => shared.heard_from_coordinator(),
            Err(e) => debug!(error = %e, "offset commit to hear from the group coordinator failed"),
        }
    }
}
