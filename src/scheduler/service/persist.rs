//! Persisting a batch: changelog records and dead letters acknowledged by
//! Kafka (retried in order per partition), then the store, flushed.

use tracing::warn;

use super::batch::PartitionBatch;
use super::transactions::{Applying, Committed, Pending};
use super::{SchedulerError, Shared};

use crate::hash::HashMap;
use crate::kafka;
use crate::scheduler::changelog;
use crate::scheduler::store::{Applied, Change, PartitionWrite};
use crate::wire::OwnedRecord;
use rdkafka::producer::future_producer::Delivery;

/// Write the batch's changelog records and dead letters (acknowledged by
/// Kafka), then apply its changes to the store and flush it. Returns what
/// changed in the near range.
pub(super) fn persist(
    shared: &Shared,
    parts: &HashMap<i32, PartitionBatch>,
    dead: &[OwnedRecord],
) -> Result<Vec<Applied>, SchedulerError> {
    let cfg = &shared.cfg;
    // 1. Changelog and dead letters, acknowledged by Kafka.
    let topic = &cfg.topics.changelog;
    let records: Vec<(i32, OwnedRecord)> = parts
        .iter()
        .flat_map(|(p, pb)| {
            let changes = pb.changes.iter().map(|c| match c {
                Change::Put(s) => changelog::put_record(topic, s),
                Change::Delete(id) | Change::Fired(id, _) => changelog::tombstone(topic, id),
            });
            // After the changes it covers, in the same partition.
            let handled = pb
                .schedule_next
                .map(|n| changelog::schedule_next_record(topic, n));
            changes.chain(handled).map(move |r| (*p, r))
        })
        .collect();
    let mut sends: Vec<(Option<i32>, &OwnedRecord)> = records.iter().map(|(p, r)| (Some(*p), r)).collect();
    sends.extend(dead.iter().map(|r| (None, r)));
    // Exactly once: `applying` holds other writers' checkpoints below these
    // records until this batch's store write is done.
    let (delivered, applying) = send_all_retrying(shared, &sends)?;
    let mut changelog_next: HashMap<i32, i64> = HashMap::default();
    // Partitions whose records were left out (exactly once: no longer
    // owned): nothing of them goes to the store either.
    let mut left_out: crate::hash::HashSet<i32> = Default::default();
    for ((p, rec), d) in sends.iter().zip(&delivered) {
        match (p, d) {
            (Some(p), None) => {
                left_out.insert(*p);
            }
            (Some(p), Some(d)) if rec.topic == cfg.topics.changelog => {
                let e = changelog_next.entry(*p).or_insert(0);
                *e = (*e).max(d.offset + 1);
            }
            _ => {}
        }
    }
    if let Some(a) = &applying {
        for (p, next) in changelog_next.iter_mut() {
            *next = a.applicable(*p, *next);
        }
    }
    // 2. The store, flushed to disk (nothing to do for a batch of direct
    // jobs), for the partitions still owned (see `draining`).
    let owned = shared.reads.owned.read();
    let writes: Vec<PartitionWrite> = parts
        .iter()
        .filter(|(p, pb)| !pb.changes.is_empty() || changelog_next.contains_key(p))
        .filter(|(p, _)| !left_out.contains(*p) && owned_or_log(&owned, **p))
        .map(|(p, pb)| PartitionWrite {
            changelog_next: changelog_next.get(p).copied(),
            schedule_next: pb.schedule_next,
            ..PartitionWrite::new(*p, &pb.changes)
        })
        .collect();
    let mut applied = Vec::new();
    if !writes.is_empty() {
        applied = shared.store.apply_all(&writes)?;
        shared.store.flush()?;
    }
    drop(applying);
    Ok(applied)
}

/// Whether `p` is among the `owned` partitions; logs a store write left out
/// because its partition was let go meanwhile (past the revocation deadline).
pub(super) fn owned_or_log(owned: &crate::hash::HashSet<i32>, p: i32) -> bool {
    let ok = owned.contains(&p);
    if !ok {
        warn!(
            partition = p,
            "store write left out: the partition was let go meanwhile (its changelog records stand)"
        );
    }
    ok
}

/// Send records and wait for every acknowledgement, retrying the failed ones
/// (the writes are idempotent by job id) until they succeed or the scheduler
/// stops. Records pinned to a partition are retried from the first failure
/// on, in their order. Each record's acknowledgement; `None` for those of
/// a partition no longer owned, left out in exactly-once mode.
pub(super) fn send_all_retrying<'a>(
    shared: &'a Shared,
    records: &[(Option<i32>, &OwnedRecord)],
) -> Result<(Vec<Option<Delivery>>, Option<Applying<'a>>), SchedulerError> {
    if records.is_empty() {
        return Ok((Vec::new(), None));
    }
    if let Some(txn) = &shared.kafka.txn {
        let (acks, pending) = send_in_transactions(shared, txn, records)?;
        return Ok((acks, Some(txn.applying(pending))));
    }
    let mut out: Vec<Option<Delivery>> = (0..records.len()).map(|_| None).collect();
    let mut delay = kafka::RetryDelay::new();
    loop {
        let pending: Vec<usize> = (0..records.len()).filter(|i| out[*i].is_none()).collect();
        if pending.is_empty() {
            return Ok((out, None));
        }
        // Handed to librdkafka under the changelog order lock, so that the
        // finisher's tombstones and these records keep one order (see
        // `finish`); acknowledged without it.
        let sends: Vec<_> = pending.iter().map(|i| (records[*i].1, records[*i].0)).collect();
        let acks = {
            let _order = shared.kafka.changelog_order.blocking_lock();
            futures::executor::block_on(kafka::enqueue_all(&shared.kafka.producer, &sends))
        };
        let results = futures::executor::block_on(futures::future::join_all(acks));
        let mut failed = Vec::new();
        for (i, r) in pending.into_iter().zip(results) {
            match r {
                Ok(d) => out[i] = Some(d),
                Err(e) => {
                    failed.push(i);
                    warn!(topic = %records[i].1.topic, error = %e, "write failed; retrying");
                }
            }
        }
        let parts: Vec<Option<i32>> = records.iter().map(|(p, _)| *p).collect();
        for i in written_again(&parts, &failed) {
            out[i] = None;
        }
        if !failed.is_empty() {
            if shared.signals.stop.is_cancelled() {
                return Err(SchedulerError::Fatal(
                    "stopped with writes unacknowledged; their records will be re-read".into(),
                ));
            }
            std::thread::sleep(delay.next_delay());
        }
    }
}

/// Exactly once: write the records in one transaction, again until one
/// commits (or the scheduler stops, or the producer fails for good). The
/// records of partitions no longer owned are left out (their next owner
/// reads their schedule records again; no transaction of this instance
/// commits for them): their acknowledgement is `None`.
fn send_in_transactions(
    shared: &Shared,
    txn: &super::transactions::Transactions,
    records: &[(Option<i32>, &OwnedRecord)],
) -> Result<(Vec<Option<Delivery>>, Pending), SchedulerError> {
    let mut left_out: Vec<i32> = Vec::new();
    loop {
        let kept: Vec<usize> = (0..records.len())
            .filter(|i| records[*i].0.is_none_or(|p| !left_out.contains(&p)))
            .collect();
        let mut out: Vec<Option<Delivery>> = (0..records.len()).map(|_| None).collect();
        if kept.is_empty() {
            return Ok((out, Pending::none()));
        }
        let owned = kept
            .iter()
            .map(|i| (records[*i].1.clone(), records[*i].0))
            .collect();
        // Submitted under the changelog order lock, as `send_all_retrying`.
        let answer = {
            let _order = shared.kafka.changelog_order.blocking_lock();
            txn.submit(owned)
        };
        match answer.wait_blocking() {
            Ok(Committed { acks, pending }) => {
                for (i, d) in kept.into_iter().zip(acks) {
                    out[i] = Some(d);
                }
                return Ok((out, pending));
            }
            Err(e) if !e.not_owned.is_empty() => {
                warn!(partitions = ?e.not_owned, "schedule partitions no longer owned: their records are left to their next owner");
                left_out.extend(e.not_owned);
                continue;
            }
            Err(e) if !e.fatal => warn!(error = %e, "transaction aborted; writing again"),
            Err(e) => return Err(SchedulerError::Fatal(format!("writing in a transaction: {e}"))),
        }
        if shared.signals.stop.is_cancelled() {
            return Err(SchedulerError::Fatal(
                "stopped with writes not committed; their records will be re-read".into(),
            ));
        }
        std::thread::sleep(super::transactions::AFTER_ABORT);
    }
}

/// Of records pinned to partitions `parts`, those to write again after the
/// records `failed` failed: every one after a failure in its partition, so
/// that the changelog keeps each job's records in order (compaction keeps the
/// last one, and a put retried after its own tombstone would revive the job).
pub(super) fn written_again(parts: &[Option<i32>], failed: &[usize]) -> Vec<usize> {
    let mut first: HashMap<i32, usize> = HashMap::default();
    for &i in failed {
        if let Some(p) = parts[i] {
            let f = first.entry(p).or_insert(i);
            *f = (*f).min(i);
        }
    }
    parts
        .iter()
        .enumerate()
        .filter(|(i, p)| p.and_then(|p| first.get(&p)).is_some_and(|f| i > f))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_changelog_write_rewrites_the_rest_of_its_partition_in_order() {
        let parts = [Some(0), Some(0), Some(1), None, Some(0), Some(1), None];
        assert_eq!(written_again(&parts, &[]), Vec::<usize>::new());
        assert_eq!(written_again(&parts, &[1]), vec![4], "after 1 in partition 0");
        assert_eq!(
            written_again(&parts, &[4, 0]),
            vec![1, 4],
            "from the first failure"
        );
        assert_eq!(
            written_again(&parts, &[2, 3]),
            vec![5],
            "dead letters (None) stand alone"
        );
    }
}
