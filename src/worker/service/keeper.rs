//! The keeper: the one task that writes what held keys need, in order:
//! the holds read back whose skipped numbers are not written yet (see
//! `Hold::loaded`), parked jobs to the schedule topic (due no earlier than
//! the job holding their key, marked with their park sequence) and each
//! touched key's hold as it is now to the held topic, once the parked jobs
//! are acknowledged (a hold counts only parks Kafka has). A round's records are all
//! acknowledged before the next round is written, so a key's parked jobs
//! reach the scheduler in the order they were parked; parked jobs' offsets
//! are finished, and waiting settlements answered, only once their round
//! is acknowledged.
//!
//! In exactly-once mode the keeper task writes nothing: parked jobs are
//! staged under the state lock that numbered them, and finished, and
//! changed holds are left to the next transaction ([`hand`], [`write`]; see
//! `held_round`). ([`send`] still writes the holds read back on
//! assignment, under a claim that counts only once committed.)

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::{Shared, Tp, WorkerState};

use crate::hash::HashSet;
use crate::job::Job;
use crate::kafka;
use crate::wire::{self, OwnedRecord};
use crate::worker::hold::{record, HoldWrite, Skip};

/// A job parked behind its held key (its park sequence and run-at are
/// set), or one read before its run-at on a holdable partition, handed to
/// the scheduler (no park sequence).
pub(super) struct ParkedJob {
    pub(super) job: Job,
    pub(super) tp: Tp,
    pub(super) offset: i64,
    /// The ownership of `tp` it was read under.
    pub(super) generation: u64,
    /// Read from the work topic as written, not back from the scheduler
    /// as a parked job: its offset counts in [`Hold::parked_to`].
    ///
    /// [`Hold::parked_to`]: crate::worker::hold::Hold::parked_to
    pub(super) fresh: bool,
    /// When the hold that gave it its park number began
    /// ([`Hold::since_ms`]): its acknowledgement counts for that hold only,
    /// not for one that replaced it meanwhile.
    ///
    /// [`Hold::since_ms`]: crate::worker::hold::Hold::since_ms
    pub(super) hold: Option<i64>,
}

/// What the keeper is asked to write.
pub(super) enum Request {
    /// These jobs, in order, then the holds of their keys.
    Park(Vec<ParkedJob>),
    /// The hold of `key` in `tp` as it is now; `done` hears whether it
    /// was acknowledged.
    Write {
        tp: Tp,
        key: Vec<u8>,
        generation: u64,
        done: oneshot::Sender<bool>,
    },
}

/// Where requests for the keeper go.
pub(super) struct Keeper {
    tx: mpsc::UnboundedSender<Request>,
}

impl Keeper {
    /// The sending side, and the keeper task's inbox.
    pub(super) fn new() -> (Self, mpsc::UnboundedReceiver<Request>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Keeper { tx }, rx)
    }

    /// Park `jobs` (their partitions' in-flight counts already include
    /// them). Called under the state lock that gave them their park
    /// sequence: the keeper writes requests in the order it gets them.
    pub(super) fn park(&self, jobs: Vec<ParkedJob>) {
        if !jobs.is_empty() {
            // The keeper ends only with the worker: then nothing is
            // committed anymore and the jobs are read again by the next owner.
            let _ = self.tx.send(Request::Park(jobs));
        }
    }

    /// Write `key`'s hold in `tp` as it is now; whether it was acknowledged
    /// (false once the partition is gone).
    pub(super) async fn write(&self, tp: Tp, key: Vec<u8>, generation: u64) -> bool {
        let (done, answer) = oneshot::channel();
        let req = Request::Write {
            tp,
            key,
            generation,
            done,
        };
        self.tx.send(req).is_ok() && answer.await.unwrap_or(false)
    }
}

/// Hand parked and handed-over jobs on, under the state lock that gave
/// them their park numbers: to the keeper, or in exactly-once mode staged
/// at their offsets and finished at once, their holds counting them (the
/// next transaction writes both).
pub(super) fn hand(shared: &Shared, st: &mut WorkerState, jobs: Vec<ParkedJob>) {
    if !shared.cfg.worker.exactly_once {
        shared.out.keeper.park(jobs);
        return;
    }
    let mut tally = Tally::default();
    for p in jobs {
        let staged = owned(st, &p.tp, p.generation);
        if staged {
            let rec = wire::encode(&p.job, &shared.cfg.topics.schedule);
            st.keep_staged(p.tp, p.offset, vec![rec]);
            count_sent(st, &p);
            if p.job.parked.is_some() {
                st.dirty.entry(p.tp).or_default().insert(p.job.key.clone());
            }
        }
        let_off(st, &p, staged, &mut tally);
    }
    tally.add_to(shared);
}

/// Write `key`'s hold in `tp` as it is now: through the keeper (whether it
/// was acknowledged), or in exactly-once mode by the next transaction
/// (whether `tp` is still owned as asked).
pub(super) async fn write(shared: &Shared, tp: Tp, key: Vec<u8>, generation: u64) -> bool {
    if shared.cfg.worker.exactly_once {
        let mut st = shared.jobs.lock();
        if !owned(&st, &tp, generation) {
            return false;
        }
        st.dirty.entry(tp).or_default().insert(key);
        return true;
    }
    shared.out.keeper.write(tp, key, generation).await
}

/// The keeper task: one round at a time, everything queued since the last;
/// it ends with `halt` (every partition released).
pub(super) async fn keep(
    shared: Arc<Shared>,
    mut inbox: mpsc::UnboundedReceiver<Request>,
    halt: tokio_util::sync::CancellationToken,
) {
    loop {
        let first = tokio::select! {
            r = inbox.recv() => match r {
                Some(r) => r,
                None => return,
            },
            _ = halt.cancelled() => return,
        };
        let mut round = vec![first];
        while let Ok(more) = inbox.try_recv() {
            round.push(more);
        }
        let written = write_round(&shared, &round).await;
        finish_round(&shared, round, written);
    }
}

/// Write a round until it is acknowledged, or until none of its partitions
/// is owned by the ownership it was asked under (then `false`): first the
/// holds read back among its keys whose skip is not written yet, then its
/// parked jobs, then, once Kafka has them all, the holds of the keys it
/// touched. A hold is never written counting a park Kafka may not have
/// (the two go to different partitions, acknowledged apart: a worker killed
/// between them would leave a hold that says a job was parked when it was
/// not, and the job's next reader would take it as dealt with).
async fn write_round(shared: &Shared, round: &[Request]) -> bool {
    let mut delay = kafka::RetryDelay::new();
    let mut parks_written = false;
    loop {
        let (parks, keys) = parks_of(shared, round);
        if parks.is_empty() && keys.is_empty() {
            return false;
        }
        if !parks_written {
            // A hold read back gives no number past its skip before the
            // skip is written (see `Hold::loaded`).
            let (loaded, skips) = unwritten_skips(shared, &keys);
            if !loaded.is_empty() {
                if let Err(e) = send(shared, &loaded).await {
                    warn!(error = %e, records = loaded.len(), "writing held keys read back failed; retrying");
                    tokio::time::sleep(delay.next_delay()).await;
                } else {
                    skips_written(shared, &skips);
                }
                // The parks again, for partitions still owned as asked.
                continue;
            }
            match send(shared, &parks).await {
                Ok(()) => {
                    mark_sent(shared, round);
                    parks_written = true;
                }
                Err(e) => {
                    warn!(error = %e, records = parks.len(), "writing parked jobs failed; retrying");
                    tokio::time::sleep(delay.next_delay()).await;
                    continue;
                }
            }
        }
        let holds = holds_of(shared, &keys);
        match send(shared, &holds).await {
            Ok(()) => return true,
            Err(e) => warn!(error = %e, records = holds.len(), "writing held keys failed; retrying"),
        }
        tokio::time::sleep(delay.next_delay()).await;
    }
}

/// A record and the partition it must go to (`None`: by its key).
pub(super) type Pinned = (OwnedRecord, Option<i32>);

/// Send records and wait for every acknowledgement; the first error.
pub(super) async fn send(shared: &Shared, records: &[Pinned]) -> Result<(), String> {
    if records.is_empty() {
        return Ok(());
    }
    let sends: Vec<_> = records.iter().map(|(rec, p)| (rec, *p)).collect();
    let acks = kafka::enqueue_all(&shared.out.raw, &sends).await;
    match futures::future::join_all(acks)
        .await
        .into_iter()
        .find_map(Result::err)
    {
        None => Ok(()),
        Some(e) => Err(e.to_string()),
    }
}

/// Whether `tp` is still owned as it was when a request was made.
fn owned(st: &super::WorkerState, tp: &Tp, generation: u64) -> bool {
    st.owned.get(tp).is_some_and(|o| o.generation == generation)
}

/// The round's parked jobs, in order, for partitions still owned as asked
/// (partitioned by key, as every schedule-topic write), and the keys whose
/// holds the round writes (each once).
fn parks_of(shared: &Shared, round: &[Request]) -> (Vec<Pinned>, Vec<(Tp, Vec<u8>)>) {
    let st = shared.jobs.lock();
    let mut out = Vec::new();
    let mut keys: Vec<(Tp, Vec<u8>)> = Vec::new();
    let mut seen: HashSet<(Tp, &[u8])> = HashSet::default();
    for req in round {
        match req {
            Request::Park(jobs) => {
                for p in jobs.iter().filter(|p| owned(&st, &p.tp, p.generation)) {
                    out.push((wire::encode(&p.job, &shared.cfg.topics.schedule), None));
                    if p.job.parked.is_some() && seen.insert((p.tp, &p.job.key)) {
                        keys.push((p.tp, p.job.key.clone()));
                    }
                }
            }
            Request::Write {
                tp, key, generation, ..
            } => {
                if owned(&st, tp, *generation) && seen.insert((*tp, key)) {
                    keys.push((*tp, key.clone()));
                }
            }
        }
    }
    (out, keys)
}

/// The round's parks are acknowledged: their keys' holds may count them.
fn mark_sent(shared: &Shared, round: &[Request]) {
    let mut st = shared.jobs.lock();
    let st = &mut *st;
    for req in round {
        if let Request::Park(jobs) = req {
            for p in jobs {
                if owned(st, &p.tp, p.generation) {
                    count_sent(st, p);
                }
            }
        }
    }
}

/// `p`'s key's hold counts it as written, if `p` is a parked job and the
/// hold that numbered it is still the key's.
fn count_sent(st: &mut WorkerState, p: &ParkedJob) {
    let hold = st.holds.get_mut(p.tp, &p.job.key);
    if let (Some(h), Some(seq)) = (hold.filter(|h| Some(h.since_ms) == p.hold), p.job.parked) {
        h.sent(seq, p.fresh.then_some(p.offset));
    }
}

/// Jobs parked and handed over, to count in the worker's stats.
#[derive(Default)]
struct Tally {
    parked: u64,
    handed: u64,
}

impl Tally {
    fn add_to(&self, shared: &Shared) {
        shared.stats.parked.fetch_add(self.parked, Ordering::Relaxed);
        shared
            .stats
            .handed_to_scheduler
            .fetch_add(self.handed, Ordering::Relaxed);
    }
}

/// `p` is done with: out of its partition's in-flight count and, when
/// `written` (or staged), finished and counted in `tally`.
fn let_off(st: &mut WorkerState, p: &ParkedJob, written: bool, tally: &mut Tally) {
    if let Some(n) = st.in_flight.get_mut(&p.tp) {
        *n = n.saturating_sub(1);
    }
    if written {
        match p.job.parked {
            Some(_) => tally.parked += 1,
            None => tally.handed += 1,
        }
        st.finish(p.tp, p.offset, Some(p.generation));
    }
}

/// Each key's hold as it is now (held-topic partition = work partition),
/// for partitions still owned.
fn holds_of(shared: &Shared, keys: &[(Tp, Vec<u8>)]) -> Vec<Pinned> {
    let st = shared.jobs.lock();
    keys.iter()
        .filter(|(tp, _)| st.owned.contains_key(tp))
        .map(|(tp, key)| {
            let change = match st.holds.get(*tp, key) {
                Some(h) => HoldWrite::Put(h.to_write()),
                None => HoldWrite::Let,
            };
            hold_record(shared, &st, *tp, key, &change)
        })
        .collect()
}

/// A key's hold's latest skip, as written.
type SkipOf = (Tp, Vec<u8>, Option<Skip>);

/// The holds of `keys` read back whose skip no write has carried yet (see
/// `Hold::loaded`), and that skip for each.
fn unwritten_skips(shared: &Shared, keys: &[(Tp, Vec<u8>)]) -> (Vec<Pinned>, Vec<SkipOf>) {
    let st = shared.jobs.lock();
    keys.iter()
        .filter(|(tp, _)| st.owned.contains_key(tp))
        .filter_map(|(tp, key)| {
            let h = st.holds.get(*tp, key).filter(|h| h.skip_unwritten())?;
            let rec = hold_record(shared, &st, *tp, key, &HoldWrite::Put(h.to_write()));
            Some((rec, (*tp, key.clone(), h.skipped().last().copied())))
        })
        .unzip()
}

/// Those holds' skips are written: unless read back again meanwhile, they
/// may give numbers past them.
fn skips_written(shared: &Shared, written: &[SkipOf]) {
    let mut st = shared.jobs.lock();
    for (tp, key, skip) in written {
        if let Some(h) = st
            .holds
            .get_mut(*tp, key)
            .filter(|h| h.skipped().last() == skip.as_ref())
        {
            h.skip_written();
        }
    }
}

/// `key`'s hold record (held-topic partition = work partition), under
/// the partition's claim.
fn hold_record(shared: &Shared, st: &super::WorkerState, tp: Tp, key: &[u8], change: &HoldWrite) -> Pinned {
    let claim = st.owned.get(&tp).and_then(|o| o.claim);
    let rec = record::record(
        &shared.cfg.topics.held,
        claim,
        &shared.topics.names[tp.0],
        key,
        change,
    );
    (rec, Some(tp.1))
}

/// Finish a round: parked and handed-over jobs' offsets (when written),
/// answers to writes.
fn finish_round(shared: &Shared, round: Vec<Request>, written: bool) {
    let mut tally = Tally::default();
    let mut answers = Vec::new();
    {
        let mut st = shared.jobs.lock();
        for req in round {
            match req {
                Request::Park(jobs) => {
                    for p in jobs {
                        let_off(&mut st, &p, written, &mut tally);
                    }
                }
                Request::Write { done, .. } => answers.push(done),
            }
        }
    }
    tally.add_to(shared);
    for done in answers {
        let _ = done.send(written);
    }
    debug!(parked = tally.parked, written, "keeper round");
    shared.jobs.notify_finished();
}
