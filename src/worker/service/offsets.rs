//! Records read and finished: a record counts as unfinished from when it
//! is read until its outcome is acknowledged by Kafka, and only then may its
//! partition's committed offset move past it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tracing::warn;

use rdkafka::TopicPartitionList;

use super::{Shared, Tp, WorkerCounters, WorkerState};

use crate::worker::hold::claim;

use crate::kafka;

/// Write what a record asks for (a dead letter, a hand-over to the
/// scheduler) off the poll thread. The record counts as unfinished until
/// the write is acknowledged, and its partition's release waits for the
/// write as for a running handler; a write that keeps failing is retried
/// until then, or given up when the partition goes (the record is then
/// re-delivered to the next owner). Does nothing if the partition is not
/// owned.
pub(super) fn write_in_background<F, Fut, T, E>(
    shared: &Arc<Shared>,
    tp: Tp,
    offset: i64,
    counter: fn(&WorkerCounters) -> &AtomicU64,
    mut write: F,
) where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, E>> + Send,
    E: std::fmt::Display,
{
    let (cancel, generation) = {
        let mut st = shared.state();
        let Some(owned) = st.owned.get(&tp) else { return };
        let ours = (owned.cancel.clone(), owned.generation);
        st.tracker.read(tp, offset);
        *st.in_flight.entry(tp).or_insert(0) += 1;
        ours
    };
    let shared = shared.clone();
    shared.runtime.clone().spawn(async move {
        let mut delay = kafka::RetryDelay::new();
        let written = loop {
            match write().await {
                Ok(_) => break true,
                Err(e) => warn!(partition = tp.1, offset, error = %e, "write failed; retrying"),
            }
            tokio::select! {
                _ = tokio::time::sleep(delay.next_delay()) => {}
                _ = cancel.cancelled() => break false,
            }
        };
        {
            let mut st = shared.state();
            if let Some(n) = st.in_flight.get_mut(&tp) {
                *n = n.saturating_sub(1);
            }
            if written {
                counter(&shared.stats).fetch_add(1, Ordering::Relaxed);
                finish_in(&mut st, tp, offset, Some(generation));
            }
        }
        shared.notify_finished();
    });
}

/// Mark a record finished; if it belongs to the current ownership of its
/// partition, its commit point may advance.
pub(super) fn finish_in(st: &mut WorkerState, tp: Tp, offset: i64, generation: Option<u64>) {
    let current = st.owned.get(&tp).map(|o| o.generation);
    if current.is_none() || (generation.is_some() && generation != current) {
        return;
    }
    if let Some(c) = st.tracker.finish(tp, offset) {
        st.to_store.insert(tp, c);
    }
}

/// Add `tp`'s commit offset `offset` to `tpl`, with its claim when it has
/// one: every commit of a holdable partition names its owner's claim.
pub(super) fn offset_to_commit(
    shared: &Shared,
    st: &WorkerState,
    tpl: &mut TopicPartitionList,
    tp: Tp,
    offset: i64,
) {
    let topic = &shared.topics[tp.0];
    match st.owned.get(&tp).and_then(|o| o.claim) {
        Some(claim) => claimed(tpl, topic, tp.1, offset, claim),
        None => {
            let _ = tpl.add_partition_offset(topic, tp.1, rdkafka::Offset::Offset(offset));
        }
    }
}

/// Add `topic`/`partition` at commit offset `offset` to `tpl`, carrying
/// `claim` in its metadata.
pub(super) fn claimed(tpl: &mut TopicPartitionList, topic: &str, partition: i32, offset: i64, claim: u64) {
    let mut e = tpl.add_partition(topic, partition);
    // The offset of a partition just added is always settable.
    let _ = e.set_offset(rdkafka::Offset::Offset(offset));
    e.set_metadata(claim::metadata(claim));
}
