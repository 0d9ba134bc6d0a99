//! Probes: the end offsets of the schedule partitions whose due jobs wait
//! to have their partition read up to their run-at.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use tracing::warn;

use super::Shared;

use crate::kafka;

/// Look up the end offsets of the schedule partitions whose due jobs wait
/// (see [`CaughtUp`](crate::scheduler::caught_up::CaughtUp)), one request for all of them, whenever the dispatcher
/// asks. Runs on its own thread: the look-up blocks.
pub(super) fn probe_loop(shared: &Arc<Shared>, inbox: Receiver<()>) {
    let mut cfg = shared.kafka.reader_config.clone();
    cfg.set("group.id", "kairos-probe");
    let create = || {
        cfg.create::<BaseConsumer>()
            .map_err(|e| shared.fail(format!("creating the schedule probe client: {e}")))
    };
    let Ok(mut consumer) = create() else { return };
    let topic = &shared.cfg.topics.schedule;
    let mut delay = kafka::RetryDelay::new();
    while !shared.signals.stop.is_cancelled() {
        match inbox.recv_timeout(Duration::from_millis(200)) {
            Ok(()) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        let at = shared.clock.now().timestamp_millis();
        let parts = shared.reads.caught_up().take_wanted(at);
        if parts.is_empty() {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        for p in &parts {
            // The end offset ("latest"), asked for as a timestamp.
            if let Err(e) = tpl.add_partition_offset(topic, *p, Offset::End) {
                warn!(partition = p, error = %e, "schedule probe");
            }
        }
        let answer = consumer.offsets_for_times(tpl, shared.cfg.kafka.produce_timeout);
        let mut gate = shared.reads.caught_up();
        let mut failed = Vec::new();
        let mut moved = false;
        match answer {
            Ok(ends) => {
                for e in ends.elements() {
                    match (e.offset(), e.error()) {
                        (Offset::Offset(end), Ok(())) => moved |= gate.probed(e.partition(), at, end),
                        _ => failed.push(e.partition()),
                    }
                }
            }
            Err(e) => {
                warn!(partitions = ?parts, error = %e, "cannot look up the schedule partitions' ends; due jobs wait");
                failed = parts;
            }
        }
        if !failed.is_empty() {
            gate.probe_failed(&failed, at);
        }
        drop(gate);
        if moved {
            shared.signals.wake.notify_one();
        }
        if failed.is_empty() {
            delay = kafka::RetryDelay::new();
        } else {
            std::thread::sleep(delay.next_delay());
            // A client with no subscription refreshes its metadata only
            // every `topic.metadata.refresh.interval.ms` (5 minutes): after
            // a broker was lost, its look-ups kept failing with "unknown
            // partition" that long. A new client asks afresh.
            let Ok(fresh) = create() else { return };
            consumer = fresh;
        }
    }
}
