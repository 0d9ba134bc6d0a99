//! Records read and finished: a record counts as unfinished from when it
//! is read until its outcome is acknowledged by Kafka, and only then may its
//! partition's committed offset move past it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tracing::warn;

use rdkafka::TopicPartitionList;

use super::round::CommitPoint;
use super::{Shared, Tp, WorkerCounters};

use crate::worker::hold::claim;

use crate::kafka;
use crate::wire::OwnedRecord;

/// Write what a record of `tp` at `offset` asks (a dead letter, a
/// hand-over to the scheduler) off the poll thread: `write` writes it, or
/// returns the records to stage in its place ([`send_or_stage`]). The
/// record counts as unfinished until the write is acknowledged (or
/// staged), and its partition's release waits for the write as for a
/// running handler; a write that keeps failing is retried until then, or
/// given up when the partition goes (the record is then re-delivered to
/// the next owner). Does nothing if the partition is not owned.
pub(super) fn write_in_background<F, Fut>(
    shared: &Arc<Shared>,
    tp: Tp,
    offset: i64,
    counter: fn(&WorkerCounters) -> &AtomicU64,
    mut write: F,
) where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = Result<Vec<OwnedRecord>, String>> + Send,
{
    let Some((cancel, generation)) = shared.jobs.begin_write(tp, offset) else {
        return;
    };
    let shared = shared.clone();
    shared.drivers.runtime.clone().spawn(async move {
        let mut delay = kafka::RetryDelay::new();
        let written = loop {
            match write().await {
                Ok(records) => break Some(records),
                Err(e) => warn!(partition = tp.1, offset, error = %e, "write failed; retrying"),
            }
            tokio::select! {
                _ = tokio::time::sleep(delay.next_delay()) => {}
                _ = cancel.cancelled() => break None,
            }
        };
        if written.is_some() {
            counter(&shared.stats).fetch_add(1, Ordering::Relaxed);
        }
        shared.jobs.write_done(tp, offset, generation, written);
    });
}

/// Write `rec` and wait for its acknowledgement; in exactly-once mode,
/// return it to be staged instead.
pub(super) async fn send_or_stage(shared: &Shared, rec: OwnedRecord) -> Result<Vec<OwnedRecord>, String> {
    if shared.cfg.worker.exactly_once {
        return Ok(vec![rec]);
    }
    kafka::send(&shared.out.raw, &rec, None)
        .await
        .map(|_| Vec::new())
        .map_err(|e| e.to_string())
}

/// Add a commit point to `tpl`, with its claim when it has one: every
/// commit of a holdable partition names its owner's claim.
pub(super) fn offset_to_commit(
    shared: &Shared,
    tpl: &mut TopicPartitionList,
    (tp, offset, claim): CommitPoint,
) {
    let topic = &shared.topics.names[tp.0];
    match claim {
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
