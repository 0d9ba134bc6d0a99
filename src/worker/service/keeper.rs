//! The keeper: the one task that writes what held keys need, in order:
//! parked jobs to the schedule topic (due no earlier than the job holding
//! their key, marked with their park sequence) and each touched key's hold
//! as it is now to the held topic. A round's records are all acknowledged
//! before the next round is written, so a key's parked jobs reach the
//! scheduler in the order they were parked; parked jobs' offsets are
//! finished, and waiting settlements answered, only once their round is
//! acknowledged.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};

use super::{Shared, Tp};

use crate::hash::HashSet;
use crate::job::Job;
use crate::kafka;
use crate::wire::{self, OwnedRecord};
use crate::worker::hold::{record, Change};
use crate::worker::service::offsets::finish_in;

/// A job parked behind its held key: its park sequence and run-at are set.
pub(super) struct ParkedJob {
    pub(super) job: Job,
    pub(super) tp: Tp,
    pub(super) offset: i64,
    /// The ownership of `tp` it was read under.
    pub(super) generation: u64,
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
    rx: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Request>>>,
}

impl Keeper {
    pub(super) fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Keeper {
            tx,
            rx: std::sync::Mutex::new(Some(rx)),
        }
    }

    /// The keeper's inbox, taken once when the worker runs.
    pub(super) fn take_inbox(&self) -> Option<mpsc::UnboundedReceiver<Request>> {
        self.rx.lock().unwrap_or_else(|e| e.into_inner()).take()
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
/// is owned by the ownership it was asked under (then `false`).
async fn write_round(shared: &Shared, round: &[Request]) -> bool {
    let mut delay = kafka::RetryDelay::new();
    loop {
        let records = records_of(shared, round);
        if records.is_empty() {
            return false;
        }
        let sends: Vec<_> = records.iter().map(|(rec, p)| (rec, *p)).collect();
        let acks = kafka::enqueue_all(&shared.raw, &sends).await;
        let failed = futures::future::join_all(acks)
            .await
            .into_iter()
            .find_map(Result::err);
        match failed {
            None => return true,
            Some(e) => warn!(error = %e, records = records.len(),
                "writing parked jobs or held keys failed; retrying"),
        }
        tokio::time::sleep(delay.next_delay()).await;
    }
}

/// The round's records, with the partition each must go to, for
/// partitions still owned as asked: parked jobs in order (partitioned by
/// key, as every schedule-topic write), then each touched key's hold once,
/// as it is now (held-topic partition = work partition).
fn records_of(shared: &Shared, round: &[Request]) -> Vec<(OwnedRecord, Option<i32>)> {
    let mut st = shared.state();
    let st = &mut *st;
    let owned = |tp: &Tp, generation: u64| st.owned.get(tp).is_some_and(|o| o.generation == generation);
    let mut out = Vec::new();
    let mut keys: Vec<(Tp, &[u8])> = Vec::new();
    let mut seen: HashSet<(Tp, &[u8])> = HashSet::default();
    for req in round {
        match req {
            Request::Park(jobs) => {
                for p in jobs.iter().filter(|p| owned(&p.tp, p.generation)) {
                    out.push((wire::encode(&p.job, &shared.cfg.topics.schedule), None));
                    if let (Some(h), Some(seq)) = (st.holds.get_mut(p.tp, &p.job.key), p.job.parked) {
                        h.sent(seq);
                    }
                    if seen.insert((p.tp, &p.job.key)) {
                        keys.push((p.tp, &p.job.key));
                    }
                }
            }
            Request::Write {
                tp, key, generation, ..
            } => {
                if owned(tp, *generation) && seen.insert((*tp, key)) {
                    keys.push((*tp, key));
                }
            }
        }
    }
    for (tp, key) in keys {
        let change = match st.holds.get(tp, key) {
            Some(h) => Change::Put(h.to_write()),
            None => Change::Let,
        };
        let rec = record::record(&shared.cfg.topics.held, &shared.topics[tp.0], key, &change);
        out.push((rec, Some(tp.1)));
    }
    out
}

/// Finish a round: parked jobs' offsets (when written), answers to writes.
fn finish_round(shared: &Shared, round: Vec<Request>, written: bool) {
    let mut parked = 0u64;
    let mut answers = Vec::new();
    {
        let mut st = shared.state();
        for req in round {
            match req {
                Request::Park(jobs) => {
                    for p in jobs {
                        if let Some(n) = st.in_flight.get_mut(&p.tp) {
                            *n = n.saturating_sub(1);
                        }
                        if written {
                            parked += 1;
                            finish_in(&mut st, p.tp, p.offset, Some(p.generation));
                        }
                    }
                }
                Request::Write { done, .. } => answers.push(done),
            }
        }
    }
    shared.stats.parked.fetch_add(parked, Ordering::Relaxed);
    for done in answers {
        let _ = done.send(written);
    }
    debug!(parked, written, "keeper round");
    shared.notify_finished();
}
