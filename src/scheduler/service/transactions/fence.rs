//! What fences the scheduler's transactions: the schedule partitions this
//! instance owns, their offsets, and the consumer group generation the
//! offsets commit with (KIP-447: a member the group moved on from cannot
//! commit). No transaction commits records for a partition not owned.

use std::sync::Arc;

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};

use crate::hash::HashMap;
use crate::wire::OwnedRecord;

/// What the commit of offsets needs, kept up to date by ingest and the
/// rebalance callbacks.
#[derive(Default)]
pub(super) struct Fence {
    /// The ingest consumer's group generation (taken anew at every
    /// rebalance); `None` while the instance is not a member (before its
    /// first assignment, and from a lost assignment to the next one).
    group: Option<Arc<ConsumerGroupMetadata>>,
    /// Per owned partition, the next schedule offset to read once
    /// everything stored is committed.
    offsets: HashMap<i32, i64>,
}

impl Fence {
    /// The group generation at a rebalance.
    pub(super) fn set_group(&mut self, group: Option<ConsumerGroupMetadata>) {
        self.group = group.map(Arc::new);
    }

    /// The group generation as ingest polls: taken only while the instance
    /// is a member (after a lost assignment the consumer rejoins, and its
    /// metadata names no member until the next assignment).
    pub(super) fn refresh_group(&mut self, group: Option<ConsumerGroupMetadata>) {
        if self.group.is_some() {
            self.set_group(group);
        }
    }

    /// The assignment was lost (the group session expired): `parts` may be
    /// another member's already; nothing more commits for them, nor with
    /// this membership.
    pub(super) fn lost(&mut self, parts: &[i32]) {
        self.group = None;
        self.revoked(parts);
    }

    /// Partition `p` is owned, read from `next` on.
    pub(super) fn assigned(&mut self, p: i32, next: i64) {
        self.offsets.insert(p, next);
    }

    /// Partition `p`'s records below `next` are handled.
    pub(super) fn stored(&mut self, p: i32, next: i64) {
        if let Some(o) = self.offsets.get_mut(&p) {
            *o = (*o).max(next);
        }
    }

    /// Partitions `parts` are no longer owned.
    pub(super) fn revoked(&mut self, parts: &[i32]) {
        for p in parts {
            self.offsets.remove(p);
        }
    }

    /// Of `partitions` (those a transaction's records write for, see
    /// [`written_for`]), the ones no transaction may commit for now: not
    /// owned, or owned with no group generation to fence the commit with.
    /// A transaction whose offsets named none of its partitions would
    /// commit unfenced: a scheduler that lost its partitions (its session
    /// expired) could then write records for jobs their new owner handles.
    pub(super) fn missing(&self, partitions: &[i32]) -> Vec<i32> {
        partitions
            .iter()
            .copied()
            .filter(|p| self.group.is_none() || !self.offsets.contains_key(p))
            .collect()
    }

    /// The owned partitions' offsets in `topic` and the group generation
    /// to commit them with; `None` when nothing is owned or no generation
    /// is known (a transaction then carries no offsets, and
    /// [`Fence::missing`] let no partition's records into it).
    pub(super) fn to_send(
        &self,
        topic: &str,
    ) -> Result<Option<(TopicPartitionList, Arc<ConsumerGroupMetadata>)>, KafkaError> {
        let Some(group) = self.group.clone() else {
            return Ok(None);
        };
        if self.offsets.is_empty() {
            return Ok(None);
        }
        let mut tpl = TopicPartitionList::new();
        for (p, next) in &self.offsets {
            tpl.add_partition_offset(topic, *p, Offset::Offset(*next))?;
        }
        Ok(Some((tpl, group)))
    }
}

/// The partitions `records` write for: those of their records in the
/// `pinned` topics (the changelog and the cursors, which mirror the
/// schedule partitions), sorted, once each.
pub(super) fn written_for(records: &[(OwnedRecord, Option<i32>)], pinned: &[String; 2]) -> Vec<i32> {
    let mut out: Vec<i32> = records
        .iter()
        .filter(|(r, _)| pinned.contains(&r.topic))
        .filter_map(|(_, p)| *p)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::{BaseConsumer, Consumer};

    use super::*;

    /// A consumer's group metadata; no broker is reached.
    fn metadata() -> ConsumerGroupMetadata {
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", "127.0.0.1:9")
            .set("group.id", "fence-test")
            .create()
            .unwrap();
        c.group_metadata().expect("a consumer of a group has metadata")
    }

    fn record(topic: &str) -> OwnedRecord {
        OwnedRecord {
            topic: topic.into(),
            key: b"k".to_vec(),
            value: Some(b"v".to_vec()),
            headers: Default::default(),
        }
    }

    const PINNED: [&str; 2] = ["changelog", "cursors"];

    fn pinned() -> [String; 2] {
        PINNED.map(String::from)
    }

    #[test]
    fn records_of_partitions_not_owned_or_without_a_generation_are_refused() {
        let mut f = Fence::default();
        let records = vec![
            (record("changelog"), Some(1)),
            (record("cursors"), Some(2)),
            (record("work"), None),
            (record("dead"), None),
        ];
        assert_eq!(
            f.missing(&written_for(&records, &pinned())),
            vec![1, 2],
            "nothing owned yet"
        );
        f.assigned(1, 10);
        f.assigned(2, 20);
        assert_eq!(
            f.missing(&written_for(&records, &pinned())),
            vec![1, 2],
            "owned, no generation"
        );
        f.set_group(Some(metadata()));
        assert!(f.missing(&written_for(&records, &pinned())).is_empty());
        let (tpl, _) = f.to_send("schedule").unwrap().expect("offsets to send");
        assert_eq!(tpl.count(), 2);
        f.revoked(&[2]);
        assert_eq!(f.missing(&written_for(&records, &pinned())), vec![2], "let go");
        let unpinned = vec![(record("work"), None), (record("dead"), None)];
        assert!(
            f.missing(&written_for(&unpinned, &pinned())).is_empty(),
            "records placed by key"
        );
    }

    #[test]
    fn a_lost_assignment_fences_everything_until_the_next_assignment() {
        let mut f = Fence::default();
        f.assigned(0, 5);
        f.assigned(1, 7);
        f.set_group(Some(metadata()));
        f.lost(&[0, 1]);
        let records = vec![(record("changelog"), Some(0))];
        assert_eq!(f.missing(&written_for(&records, &pinned())), vec![0]);
        assert_eq!(f.missing(&[0, 1]), vec![0, 1], "checked again at the commit");
        assert!(
            f.to_send("schedule").unwrap().is_none(),
            "no offsets, no generation"
        );
        // Ingest polling meanwhile does not make the instance a member again.
        f.refresh_group(Some(metadata()));
        f.assigned(0, 5);
        assert_eq!(
            f.missing(&written_for(&records, &pinned())),
            vec![0],
            "no generation until assigned"
        );
        f.set_group(Some(metadata()));
        assert!(f.missing(&written_for(&records, &pinned())).is_empty());
    }
}
