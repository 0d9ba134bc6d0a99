//! Held keys read back when partitions are assigned: the holds of the
//! claim committed last (see [`crate::worker::hold::claim`]), and in
//! exactly-once mode the partitions' progress (see
//! [`crate::worker::hold::progress`]), written again under a new claim
//! before any job of the partitions is admitted.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tracing::{debug, error, info, warn};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::TopicPartitionList;

use super::keeper;
use super::offsets::claimed;
use super::{Shared, Tp, WorkerError};

use crate::hash::HashMap;
use crate::kafka;
use crate::wire::OwnedRecord;
use crate::worker::hold::{claim, progress, record, HoldWrite};

/// Longest the held topic's partitions may take to read on assignment.
const LOAD_TIMEOUT: Duration = Duration::from_secs(60);

/// Read the holds of newly assigned partitions back from the held topic,
/// before any of their jobs is admitted, and claim them (see
/// [`crate::worker::hold::claim`]): the records of the claim committed
/// last count, they are written again under a new claim, the new claim is
/// committed, and the older record keys are deleted. Returns each holdable
/// partition's new claim. Called on the poll thread, in the assignment
/// callback.
pub(super) fn load<C: ConsumerContext>(
    shared: &Shared,
    consumer: &BaseConsumer<C>,
    tps: &[Tp],
) -> Result<HashMap<Tp, u64>, WorkerError> {
    let tps: Vec<Tp> = tps
        .iter()
        .copied()
        .filter(|tp| shared.topics.holding[tp.0])
        .collect();
    if tps.is_empty() {
        return Ok(HashMap::default());
    }
    let fatal = |what: &str, e: &dyn std::fmt::Display| WorkerError::Fatal(format!("{what}: {e}"));
    let started = std::time::Instant::now();
    let committed =
        committed(shared, consumer, &tps).map_err(|e| fatal("reading the committed claims", &e))?;
    let mut reads: HashMap<Tp, claim::ReadBack> = committed
        .iter()
        .map(|(tp, (_, c))| (*tp, claim::ReadBack::new(*c)))
        .collect();
    // Progress records (exactly once), by partition and claim: the last.
    let mut progress_read: HashMap<(Tp, u64), Option<Vec<u8>>> = HashMap::default();
    let mut partitions: Vec<i32> = tps.iter().map(|tp| tp.1).collect();
    partitions.sort_unstable();
    partitions.dedup();
    // To the log's end: exactly-once workers write the held topic in
    // transactions, and one left open by a killed worker holds back the
    // records committed after it until the broker aborts it.
    kafka::read_to_log_end(
        &shared.cfg.kafka,
        "kairos-worker-holds",
        &shared.cfg.topics.held,
        Some(&partitions),
        load_timeout(shared),
        |m| {
            use rdkafka::Message as _;
            let Some(record_key) = m.key() else { return };
            if let Some((claim, topic)) = progress::split_key(record_key) {
                if let Some(tp) = shared
                    .tp(topic, m.partition())
                    .filter(|tp| reads.contains_key(tp))
                {
                    progress_read.insert((tp, claim), m.payload().map(<[u8]>::to_vec));
                }
                return;
            }
            let Some((claim, topic, key)) = record::split_key(record_key) else {
                return;
            };
            let Some(tp) = shared.tp(topic, m.partition()) else {
                return;
            };
            let Some(read) = reads.get_mut(&tp) else { return };
            let value = record::decode(m.payload());
            if let Err(e) = &value {
                shared.stats.holds_unreadable.fetch_add(1, Ordering::Relaxed);
                error!(topic, key = %String::from_utf8_lossy(key), partition = tp.1,
                    offset = m.offset(), error = %e,
                    "held-topic record unreadable: this key's hold is not known, and its later jobs \
                     may run out of order; the key's last readable hold, if any, stands \
                     (kairos keys release KEY lets the key go)");
            }
            read.record(record_key, claim, key, value);
        },
    )
    .map_err(|e| fatal("reading held keys back", &e))?;
    let read_back = started.elapsed();
    let claims: HashMap<Tp, u64> = tps.iter().map(|tp| (*tp, rand::random())).collect();
    let (mut rewrite, mut deletes, mut written) = (Vec::new(), Vec::new(), Vec::new());
    let mut passed_over = 0;
    {
        let mut st = shared.jobs.lock();
        for (tp, read) in reads {
            let found = read.finish();
            passed_over += found.passed_over;
            let topic = &shared.topics.names[tp.0];
            for (key, hold) in found.holds {
                st.holds.load(tp, &key, Some(hold));
                if let Some(h) = st.holds.get(tp, &key) {
                    let rec = record::record(
                        &shared.cfg.topics.held,
                        Some(claims[&tp]),
                        topic,
                        &key,
                        &HoldWrite::Put(h.to_write()),
                    );
                    rewrite.push((rec, Some(tp.1)));
                    written.push((tp, key));
                }
            }
            deletes.extend(
                found
                    .to_delete
                    .into_iter()
                    .map(|k| (tombstone(shared, k), Some(tp.1))),
            );
        }
        for ((tp, claim), value) in progress_read {
            let topic = &shared.topics.names[tp.0];
            let (offset, committed_claim) = committed[&tp];
            if value.is_some() {
                // Of an earlier claim once this one is committed.
                let key = progress::record_key(claim, topic);
                deletes.push((tombstone(shared, key), Some(tp.1)));
            }
            if committed_claim != Some(claim) {
                continue;
            }
            match progress::decode(value.as_deref()) {
                Ok(Some(done)) if offset.is_some_and(|o| done.to > o) => {
                    let rec = progress::record(&shared.cfg.topics.held, claims[&tp], topic, &done);
                    rewrite.push((rec, Some(tp.1)));
                    st.done_above.insert(tp, done);
                }
                Ok(_) => {}
                Err(e) => error!(topic, partition = tp.1, error = %e,
                    "progress record unreadable: jobs done above the committed offset run again"),
            }
        }
    }
    if !rewrite.is_empty() {
        shared
            .drivers
            .runtime
            .block_on(keeper::send(shared, &rewrite))
            .map_err(|e| fatal("writing held keys back under this worker's claim", &e))?;
        let mut st = shared.jobs.lock();
        for (tp, key) in &written {
            if let Some(h) = st.holds.get_mut(*tp, key) {
                h.skip_written();
            }
        }
    }
    // Kafka takes the commit only from the partition's owner: from here on
    // this worker's records are the ones that count. A commit refused now
    // (the group moved on meanwhile) leaves the claim to the first commit
    // that passes; until then the claim before stands.
    let mut tpl = TopicPartitionList::new();
    for (tp, (offset, _)) in &committed {
        let offset = match offset {
            Some(o) => *o,
            None => {
                consumer
                    .fetch_watermarks(&shared.topics.names[tp.0], tp.1, LOAD_TIMEOUT)
                    .map_err(|e| fatal("reading a work partition's start", &e))?
                    .0
            }
        };
        claimed(&mut tpl, &shared.topics.names[tp.0], tp.1, offset, claims[tp]);
    }
    match consumer.commit(&tpl, CommitMode::Sync) {
        Ok(()) => {
            if !deletes.is_empty() {
                let shared_deletes = deletes;
                let raw = shared.out.raw.clone();
                shared.drivers.runtime.spawn(async move {
                    let sends: Vec<_> = shared_deletes.iter().map(|(r, p)| (r, *p)).collect();
                    for ack in kafka::enqueue_all(&raw, &sends).await {
                        if let Err(e) = ack.await {
                            debug!(error = %e, "deleting a held-topic record of an earlier claim failed (it does not count)");
                        }
                    }
                });
            }
        }
        Err(e) => warn!(error = %e, partitions = ?partitions,
            "committing this worker's claim on its held keys failed; the first commit that passes carries it"),
    }
    let held = shared.jobs.held();
    info!(partitions = ?partitions, held, passed_over, read_back = ?read_back, took = ?started.elapsed(),
        "held keys read back and claimed");
    Ok(claims)
}

/// How long reading back may take: [`LOAD_TIMEOUT`], or longer than the
/// broker takes to abort a transaction a killed worker left open.
fn load_timeout(shared: &Shared) -> Duration {
    LOAD_TIMEOUT.max(shared.cfg.worker.transaction_timeout + Duration::from_secs(30))
}

/// A partition's committed offset (`None`: none) and the claim its
/// metadata names.
type Committed = (Option<i64>, Option<u64>);

/// Each partition's [`Committed`].
fn committed<C: ConsumerContext>(
    shared: &Shared,
    consumer: &BaseConsumer<C>,
    tps: &[Tp],
) -> Result<HashMap<Tp, Committed>, rdkafka::error::KafkaError> {
    let mut tpl = TopicPartitionList::new();
    for tp in tps {
        tpl.add_partition(&shared.topics.names[tp.0], tp.1);
    }
    // A transaction left open with these offsets is waited out too.
    let got = consumer.committed_offsets(tpl, load_timeout(shared))?;
    Ok(tps
        .iter()
        .map(|tp| {
            let e = got.find_partition(&shared.topics.names[tp.0], tp.1);
            let offset = e.as_ref().and_then(|e| e.offset().to_raw()).filter(|o| *o >= 0);
            let claim = e.as_ref().and_then(|e| claim::of_metadata(e.metadata()));
            (*tp, (offset, claim))
        })
        .collect())
}

/// A tombstone for held-topic record key `key`.
fn tombstone(shared: &Shared, key: Vec<u8>) -> OwnedRecord {
    OwnedRecord {
        topic: shared.cfg.topics.held.clone(),
        key,
        value: None,
        headers: Vec::new(),
    }
}
