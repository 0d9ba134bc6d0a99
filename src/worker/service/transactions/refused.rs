//! Writes Kafka refuses for good (a follow-up larger than its topic takes,
//! a topic the worker may not write): retried, such a write would abort
//! every transaction of the worker, and no offset of it would move again.
//! The job it belongs to is dead-lettered instead, with the refusal as the
//! reason, and the rest of the round commits.
//!
//! librdkafka fails every record of a refused record's batch with the same
//! error, so a job whose write failed so is only a suspect. Each suspect is
//! tried in a transaction of its own that is always aborted (read_committed
//! readers never see it), halving the suspects that fail together until
//! each refused job stands alone.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::error::KafkaError;
use tracing::{debug, error, warn};

use super::{abort, write_jobs, Round};
use crate::kafka::{self, Transactional, TxnError};
use crate::wire::{self, Command, Context, DeadLetter, RecordView};
use crate::worker::service::Shared;

/// How many tries in a row that fail otherwise than by a refusal the
/// search for refused jobs makes before it leaves them to the next round.
const TRIES: u32 = 4;

/// How long reading a refused job's record back may take.
const READ_BACK: Duration = Duration::from_secs(30);

/// Replace the writes of the jobs among `suspects` (indices in
/// `round.records`) that Kafka refuses for good by their dead letters; how
/// many were replaced. A transaction must not be open.
pub(super) fn dead_letter(
    shared: &Shared,
    producer: &mut Transactional,
    round: &mut Round,
    suspects: Vec<usize>,
) -> Result<usize, TxnError> {
    let (found, complete) = refused(producer, round, suspects)?;
    if found.is_empty() && complete {
        error!(
            "Kafka refuses a batch of records that it takes one job at a time: a topic's \
            max.message.bytes is below the producer's batch.size ([kafka.producer] batch.size)"
        );
    }
    let dlq = &shared.cfg.topics.dead_letter;
    let mut jobs = Vec::new();
    for (i, refusal) in found {
        let (tp, offset, records) = &round.records[i];
        let (topic, partition, offset) = (shared.topics.names[tp.0].as_str(), tp.1, *offset);
        if records.iter().all(|r| &r.topic == dlq) {
            error!(topic, partition, offset, error = %refusal,
                "the dead-letter topic refuses a job's dead letter: no offset of this worker moves until it takes it");
            continue;
        }
        let dead = DeadLetter {
            reason: format!("a write of the job was refused by Kafka: {refusal}"),
            origin_topic: topic.to_string(),
            origin_partition: partition,
            origin_offset: offset,
        };
        jobs.push((i, refusal, dead));
    }
    // Read back together: one reader for all of them.
    let positions: Vec<(&str, i32, i64)> = jobs
        .iter()
        .map(|(_, _, d)| (d.origin_topic.as_str(), d.origin_partition, d.origin_offset))
        .collect();
    let read = kafka::read_each(
        &shared.cfg.kafka,
        "kairos-worker-refused",
        &positions,
        READ_BACK,
        |m| {
            // Records come per partition in offset order, not in the jobs'
            // order: the job is found by its position.
            use rdkafka::Message as _;
            let at = (m.topic(), m.partition(), m.offset());
            let dead = jobs
                .iter()
                .map(|(_, _, d)| d)
                .find(|d| (d.origin_topic.as_str(), d.origin_partition, d.origin_offset) == at);
            let view = RecordView::from_message(m);
            let id = match wire::decode(&view, Context::Work, &shared.cfg.limits) {
                Ok(Command::Schedule(job)) => Some(job.id),
                _ => None,
            };
            dead.map(|d| (id, wire::dead_letter_record(&view, d, dlq, &shared.cfg.limits)))
        },
    );
    let read = match read {
        Ok(read) => read,
        Err(e) => {
            warn!(jobs = jobs.len(), error = %e,
                "reading jobs whose writes were refused back failed; the next round tries again");
            return Ok(0);
        }
    };
    let mut replaced = 0;
    for ((i, refusal, dead), got) in jobs.into_iter().zip(read) {
        let (topic, partition, offset) = (&dead.origin_topic, dead.origin_partition, dead.origin_offset);
        match got.flatten() {
            Some((id, rec)) => {
                warn!(job_id = ?id, topic, partition, offset, error = %refusal,
                    "a write of the job was refused by Kafka for good: the job is dead-lettered instead");
                round.records[i].2 = vec![rec];
                replaced += 1;
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
            None => error!(topic, partition, offset, error = %refusal,
                "a write of the job was refused by Kafka for good, and its record is gone: it cannot be dead-lettered"),
        }
    }
    Ok(replaced)
}

/// The jobs among `suspects` whose writes Kafka refuses on their own, each
/// with the refusal, and whether every suspect was tried: the search stops
/// when tries fail otherwise (a broker lost), and those left are suspects
/// of the next round.
fn refused(
    producer: &mut Transactional,
    round: &Round,
    suspects: Vec<usize>,
) -> Result<(Vec<(usize, KafkaError)>, bool), TxnError> {
    search(suspects, |group| try_alone(producer, round, group))
}

/// [`refused`], trying groups of suspects with `try_group` (`Some`: one of
/// the group is refused): a refused group is halved until each refused
/// job stands alone.
fn search<E>(
    suspects: Vec<usize>,
    mut try_group: impl FnMut(&[usize]) -> Result<Option<E>, TxnError>,
) -> Result<(Vec<(usize, E)>, bool), TxnError> {
    let mut found = Vec::new();
    let mut groups = vec![suspects];
    let mut failed = 0;
    while let Some(group) = groups.pop() {
        let tried = try_group(&group);
        if tried.is_ok() {
            failed = 0;
        }
        match tried {
            Ok(None) => {}
            Ok(Some(e)) if group.len() == 1 => found.push((group[0], e)),
            Ok(Some(_)) => {
                let (a, b) = group.split_at(group.len() / 2);
                groups.push(b.to_vec());
                groups.push(a.to_vec());
            }
            // The first transaction after one with failed records fails
            // too: the producer's sequence numbers skipped the failed
            // records, and the broker asks for a new epoch (given by the
            // abort). The same group is tried again, a few times in a row
            // at most.
            Err(TxnError::Abortable(e)) if failed < TRIES => {
                debug!(error = %e, "trying refused writes apart: asked again");
                failed += 1;
                groups.push(group);
            }
            Err(TxnError::Abortable(e)) => {
                warn!(error = %e, "trying refused writes apart failed; the next round tries again");
                return Ok((found, false));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((found, true))
}

/// Write the records of `group`'s jobs in a transaction of their own and
/// abort it: the refusal of one of them, if any. An error other than a
/// refusal (and none) leaves the question open.
fn try_alone(
    producer: &mut Transactional,
    round: &Round,
    group: &[usize],
) -> Result<Option<KafkaError>, TxnError> {
    producer.begin()?;
    let mut refused = Vec::new();
    let written = write_jobs(producer, round, group.iter().copied(), &mut refused);
    abort(producer)?;
    match written {
        Ok(()) => Ok(None),
        Err(TxnError::Abortable(e)) if !refused.is_empty() => Ok(Some(e)),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    //! The search alone, against a stand-in for Kafka's answers (which
    //! jobs it refuses, and when a try fails otherwise): pure logic.

    use super::*;

    /// `try_group` for refused jobs `bad`: a group holding one is refused;
    /// after each refused try, the next try fails otherwise (as the first
    /// transaction after one with failed records does).
    fn kafka(bad: &[usize]) -> impl FnMut(&[usize]) -> Result<Option<usize>, TxnError> + '_ {
        let mut after_refusal = false;
        move |group| {
            if std::mem::take(&mut after_refusal) {
                return Err(TxnError::Abortable(KafkaError::Canceled));
            }
            let hit = group.iter().copied().find(|j| bad.contains(j));
            after_refusal = hit.is_some();
            Ok(hit)
        }
    }

    #[test]
    fn each_refused_job_is_found_alone_and_no_other() {
        let bad = [7, 57, 107, 299];
        let mut tries = 0;
        let mut try_group = kafka(&bad);
        let (found, complete) = search((0..300).collect(), |g| {
            tries += 1;
            try_group(g)
        })
        .unwrap();
        assert!(complete);
        let mut jobs: Vec<usize> = found.iter().map(|(j, _)| *j).collect();
        jobs.sort_unstable();
        assert_eq!(jobs, bad);
        // Halving: about 2 log2(300) tries per refused job, each refusal
        // followed by one failed try.
        assert!(tries < 4 * 2 * 2 * 9 + 10, "{tries} tries");
    }

    #[test]
    fn a_search_that_keeps_failing_stops_and_says_so() {
        let (found, complete) = search::<usize>((0..10).collect(), |_| {
            Err(TxnError::Abortable(KafkaError::Canceled))
        })
        .unwrap();
        assert!(found.is_empty());
        assert!(!complete);
        let fatal = search::<usize>(vec![1], |_| Err(TxnError::Fatal(KafkaError::Canceled)));
        assert!(matches!(fatal, Err(TxnError::Fatal(_))));
    }

    #[test]
    fn no_refused_job_alone_is_a_complete_search_that_finds_none() {
        // Refused only together (a batch over the topic's limit).
        let (found, complete) =
            search::<usize>((0..8).collect(), |g| Ok((g.len() > 4).then_some(0))).unwrap();
        assert!(found.is_empty());
        assert!(complete);
    }
}
