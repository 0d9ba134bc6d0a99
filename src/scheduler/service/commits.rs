//! Where the schedule partitions' offsets go once records are handled:
//! stored in the consumer and committed by it, or, in exactly-once mode,
//! handed to the next transaction only (a plain commit racing a
//! transaction's could move the committed offset back).

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use tracing::{debug, warn};

use super::Shared;

impl Shared {
    /// Hand every partition's committable offset that moved to what commits
    /// it: the next transaction in exactly-once mode, else the consumer.
    pub(super) fn store_offsets<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
        for (p, offset) in self.jobs.offsets_to_store() {
            // librdkafka commits one past the stored offset.
            if let Some(t) = &self.kafka.txn {
                t.stored(p, offset + 1);
                continue;
            }
            if let Err(e) = consumer.store_offset(&self.cfg.topics.schedule, p, offset) {
                // The partition was revoked meanwhile: its next owner
                // re-reads these records and applies them again
                // (idempotent by job id).
                debug!(partition = p, error = %e, "offset not stored");
            }
        }
    }

    /// Commit the offsets stored, now (`when`: for the log), unless only
    /// transactions commit them (exactly-once mode).
    pub(super) fn commit_stored<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, when: &str) {
        if self.kafka.txn.is_some() {
            return;
        }
        match consumer.commit_consumer_state(CommitMode::Sync) {
            Ok(()) | Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => warn!(error = %e, "commit {when} failed"),
        }
    }
}
