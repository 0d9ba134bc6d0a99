//! The poll thread: reads the work topics into the lock table, serves
//! rebalances (a revoked partition is drained before it goes), stores the
//! offsets that may be committed, and dead-letters or hands back records
//! it cannot run (those writes run on the runtime, not on this thread).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientContext, Message, TopicPartitionList};
use tracing::{debug, info, warn};

use super::held;
use super::held_load;
use super::keeper;
use super::offsets::{offset_to_commit, send_or_stage, write_in_background};
use super::ready::start_ready;
use super::touch::keep_alive;
use super::transactions::{self, WorkerTxn};
use super::{Entry, Shared, Tp, WorkerError, WorkerState};

use crate::job::Job;
use crate::kafka::TxnError;
use crate::wire::{Command, Context, DeadLetter, RecordView};
use crate::{kafka, wire};

pub(super) struct WorkerContext {
    pub(super) shared: Arc<Shared>,
    /// Exactly-once mode: the producer whose transactions commit offsets.
    pub(super) txn: Option<Arc<WorkerTxn>>,
}

impl ClientContext for WorkerContext {}

impl ConsumerContext for WorkerContext {
    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, offsets: &TopicPartitionList) {
        kafka::log_commit("worker", &result, offsets);
        if result.is_ok() {
            self.shared.heard_from_coordinator();
        }
    }

    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            self.shared
                .stats
                .revoked
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tps: Vec<Tp> = tpl
                .elements()
                .iter()
                .filter_map(|e| self.shared.tp(e.topic(), e.partition()))
                .collect();
            let committer = Committer::of(self.txn.as_deref(), consumer.assignment_lost());
            release(&self.shared, consumer, committer, &tps);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                self.shared
                    .stats
                    .assigned
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let tps: Vec<Tp> = tpl
                    .elements()
                    .iter()
                    .filter_map(|e| self.shared.tp(e.topic(), e.partition()))
                    .collect();
                // Held keys first: no job of these partitions is read before.
                let claims = match held_load::load(&self.shared, consumer, &tps) {
                    Ok(claims) => claims,
                    Err(e) => {
                        warn!(error = %e, "stopping: the held keys of assigned partitions could not be read");
                        self.shared.fail(e.to_string());
                        return;
                    }
                };
                self.shared.jobs.assign(&tps, &claims, &self.shared.signals.stop);
                info!(partitions = ?tpl.elements().iter().map(|e| (e.topic().to_string(), e.partition())).collect::<Vec<_>>(),
                    "work partitions assigned");
            }
            Rebalance::Error(e) => warn!(error = %e, "rebalance error"),
            Rebalance::Revoke(_) => {}
        }
    }
}

/// What commits the work of partitions let go.
pub(super) enum Committer<'a> {
    /// The consumer (at-least-once mode).
    Consumer,
    /// A transaction with the jobs' writes (exactly-once mode).
    Transactions(&'a WorkerTxn),
    /// Nothing: exactly-once mode, and the partitions were lost with the
    /// group session (another member may own them already). Their finished
    /// jobs' writes are dropped and the jobs run again on the next owner.
    Lost,
}

impl<'a> Committer<'a> {
    /// What commits partitions let go, by the mode (`txn`: exactly once)
    /// and whether the assignment was `lost` (the session expired: the
    /// partitions may be another member's already).
    pub(super) fn of(txn: Option<&'a WorkerTxn>, lost: bool) -> Committer<'a> {
        match (txn, lost) {
            (Some(_), true) => Committer::Lost,
            (Some(t), false) => Committer::Transactions(t),
            (None, _) => Committer::Consumer,
        }
    }
}

/// Let go of partitions: drop their buffered jobs, cancel their running
/// handlers, wait for them up to the revocation deadline, commit what is
/// finished (see [`Committer`]), forget them.
pub(super) fn release(
    shared: &Shared,
    consumer: &BaseConsumer<WorkerContext>,
    txn: Committer<'_>,
    tps: &[Tp],
) {
    let deadline = Instant::now() + shared.cfg.worker.revocation_deadline;
    let dropped = shared.jobs.drop_partitions(tps);
    let stuck = shared.jobs.wait_idle(tps, deadline);
    if !stuck.is_empty() {
        warn!(partitions = ?stuck, deadline = ?shared.cfg.worker.revocation_deadline,
            "handlers still running past the revocation deadline; releasing anyway (their jobs may run again elsewhere)");
    }
    // The commit lock before the state lock, as the keep-alive thread takes
    // them: no keep-alive commit read before this one lands after it.
    let _committing = shared.jobs.committing();
    let mut round = shared.jobs.let_go(tps);
    match txn {
        _ if round.points.is_empty() => {}
        Committer::Lost => warn!(partitions = ?tps, records = round.record_count(),
            "work partitions lost with the group session: nothing of them commits; the jobs finished since the last commit run again elsewhere"),
        Committer::Transactions(txn) => match txn.commit(shared, consumer, &mut round) {
            Ok(()) => {}
            Err(TxnError::Abortable(e)) => warn!(error = %e,
                "transaction on release aborted; the jobs finished since the last commit run again elsewhere"),
            Err(e) => shared.fail(format!("worker transactions: {e}")),
        },
        Committer::Consumer => {
            let mut tpl = TopicPartitionList::new();
            for point in round.points {
                offset_to_commit(shared, &mut tpl, point);
            }
            // Store it too: librdkafka commits the stored offsets once
            // more when the partition goes (auto-commit), and a stale
            // stored offset would move the committed one back.
            let _ = consumer.store_offsets(&tpl);
            if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
                warn!(error = %e, "commit on release failed");
            }
        }
    }
    info!(partitions = ?tps, dropped_buffered = dropped, "work partitions released");
}

pub(super) fn poll_loop(shared: &Arc<Shared>) -> Result<(), WorkerError> {
    let txn = match shared.cfg.worker.exactly_once {
        true => Some(Arc::new(WorkerTxn::open(shared)?)),
        false => None,
    };
    let member = kafka::Membership {
        group: &shared.cfg.worker.group_id,
        session_timeout: shared.cfg.worker.session_timeout,
        instance_id: None,
        // The worker commits every `commit_interval` itself (`store_offsets`);
        // librdkafka's timer only commits again what a failed commit left.
        // In exactly-once mode only transactions commit.
        auto_commit_every: txn.is_none().then_some(Duration::from_secs(1)),
    };
    let consumer: Arc<BaseConsumer<WorkerContext>> = Arc::new(kafka::consumer(
        &shared.cfg.kafka,
        &member,
        "kairos-worker",
        WorkerContext {
            shared: shared.clone(),
            txn: txn.clone(),
        },
    )?);
    let topics: Vec<&str> = shared.topics.names.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    // The keep-alive commits, or in exactly-once mode the transactions.
    let keep_alive = {
        let (shared, consumer, txn) = (shared.clone(), consumer.clone(), txn.clone());
        let (name, what) = match txn {
            Some(_) => ("kairos-worker-txn", "transaction"),
            None => ("kairos-keep-alive", "keep-alive"),
        };
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || match txn {
                Some(txn) => transactions::run(&shared, &consumer, &txn, shared.cfg.worker.commit_interval),
                None => keep_alive(&shared, &consumer, KEEP_ALIVE_EVERY),
            })
            .map_err(|e| WorkerError::Fatal(format!("starting the {what} thread: {e}")))?
    };
    let max_buffered = shared.cfg.worker.max_buffered.max(1);
    let mut commits = Commits::default();
    let mut swept = Instant::now();
    while !shared.signals.stop.is_cancelled() {
        store_offsets(shared, &consumer, &mut commits);
        if swept.elapsed() >= Duration::from_secs(1) {
            swept = Instant::now();
            held::park_overdue_waiting(shared);
        }
        // Back-pressure: with the buffer full, stop reading until it has
        // drained to three quarters (reading again after every finished job
        // would wake this thread once per job). Pausing the partitions
        // instead would make librdkafka drop what it had fetched and stall
        // for most of a second after the resume. librdkafka's own read-ahead
        // is bounded by `queued.max.messages.kbytes`. One poll a second still
        // serves rebalances (each may add one record beyond the bound).
        let mut polled_at_most = Duration::from_millis(50);
        {
            let mut st = shared.jobs.lock();
            if st.buffered() >= max_buffered {
                let resume_below = (max_buffered - max_buffered / 4).max(1);
                let until = Instant::now() + Duration::from_secs(1);
                while st.buffered() >= resume_below && !shared.signals.stop.is_cancelled() {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    st = shared.jobs.wait_finished(st, left);
                    // Commit points move while the buffer drains: store them
                    // now, not after the wait (a worker kept busy would
                    // otherwise store offsets about once a second, and a
                    // kill would re-run a second of work instead of the
                    // commit interval's).
                    if !st.to_store.is_empty() {
                        drop(st);
                        store_offsets(shared, &consumer, &mut commits);
                        st = shared.jobs.lock();
                    }
                }
                if st.buffered() >= max_buffered {
                    polled_at_most = Duration::ZERO;
                } else {
                    continue;
                }
            }
        }
        let room = max_buffered.saturating_sub(shared.jobs.buffered()).clamp(1, 1024);
        let mut batch: Vec<BorrowedMessage<'_>> = Vec::new();
        let mut next = consumer.poll(polled_at_most);
        while let Some(r) = next {
            match r {
                Ok(m) => batch.push(m),
                Err(e) => warn!(error = %e, "work topic consumer"),
            }
            // Take what is already fetched, up to the free room in the buffer.
            if polled_at_most.is_zero() || batch.len() >= room {
                break;
            }
            next = consumer.poll(Duration::ZERO);
        }
        if !batch.is_empty() {
            accept_batch(shared, &batch);
        }
    }
    // Shutdown: drain everything we own, as on a revocation (the keep-alive
    // thread, which sees the stop too, commits nothing meanwhile).
    if keep_alive.join().is_err() {
        warn!("the keep-alive thread panicked");
    }
    let owned = shared.jobs.owned();
    release(shared, &consumer, Committer::of(txn.as_deref(), false), &owned);
    consumer.unsubscribe();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !consumer.assignment().map(|a| a.count() == 0).unwrap_or(true) && Instant::now() < deadline {
        consumer.poll(Duration::from_millis(50));
    }
    Ok(())
}

/// Store the commit points that moved, and commit them at most every
/// `[worker] commit_interval`.
///
/// librdkafka's own auto-commit skips every round while the group
/// rebalances, and a rebalance after a member died lasts until the dead
/// member's session expires: seconds in which no member's offsets moved, so
/// a second kill re-ran all that work. Kafka accepts a commit from a member
/// of the current generation while the group prepares a rebalance, so the
/// worker commits what it stored itself; librdkafka's timer, set to a
/// second, only retries what a failed commit left (with both at 100 ms a
/// busy worker sent up to twenty commits a second, each a write of the
/// group on the coordinator).
///
/// In exactly-once mode offsets are never stored: transactions commit them.
pub(super) fn store_offsets(shared: &Shared, consumer: &BaseConsumer<WorkerContext>, commits: &mut Commits) {
    if shared.cfg.worker.exactly_once {
        return;
    }
    let mut tpl = TopicPartitionList::new();
    for point in shared.jobs.take_commit_points() {
        offset_to_commit(shared, &mut tpl, point);
    }
    if tpl.count() > 0 {
        match consumer.store_offsets(&tpl) {
            Ok(()) => commits.stored = true,
            Err(e) => debug!(error = %e, "offsets not stored (partitions gone)"),
        }
    }
    if commits.stored && commits.last.elapsed() >= shared.cfg.worker.commit_interval {
        commits.stored = false;
        commits.last = Instant::now();
        // The result goes to the commit callback.
        let _ = consumer.commit_consumer_state(CommitMode::Async);
    }
}

/// How often the keep-alive thread looks whether the group coordinator was
/// heard from lately.
const KEEP_ALIVE_EVERY: Duration = Duration::from_millis(100);

/// Whether offsets were stored since the last commit, and when that was.
pub(super) struct Commits {
    stored: bool,
    last: Instant,
}

impl Default for Commits {
    fn default() -> Self {
        Commits {
            stored: false,
            last: Instant::now(),
        }
    }
}

/// Take a batch of records from the work topics: decode them outside the
/// lock, then buffer the runnable ones and start what may start, under one
/// lock for the whole batch.
pub(super) fn accept_batch(shared: &Arc<Shared>, msgs: &[BorrowedMessage<'_>]) {
    let now = shared.clock.now();
    let tolerance = chrono::Duration::from_std(shared.cfg.worker.early_tolerance).unwrap_or_default();
    let decoded: Vec<_> = msgs
        .iter()
        .filter_map(|m| {
            let tp = shared.tp(m.topic(), m.partition())?;
            let view = RecordView::from_message(m);
            let d = wire::decode(&view, Context::Work, &shared.cfg.limits);
            Some((m, tp, view, d))
        })
        .collect();
    // Exactly once: records whose writes the partition's last owner
    // committed above its commit point are done already.
    let decoded = shared.jobs.skip_done(decoded, |(m, tp, ..)| (*tp, m.offset()));
    let is_job = |d: &Result<Command, _>| matches!(d, Ok(Command::Schedule(_)));
    // Every record of the batch counts as unfinished before any of it can
    // finish: a release or a dead letter at a higher offset, done first,
    // would otherwise move the commit point past a job still to run, and a
    // job finished past a release not yet begun would make an exactly-once
    // partition's progress count the release as done. (A batch of jobs only
    // is tracked once, below.)
    if decoded.iter().any(|(.., d)| !is_job(d)) {
        shared
            .jobs
            .track_read(decoded.iter().map(|(m, tp, ..)| (*tp, m.offset())));
    }
    let mut jobs: Vec<Entry> = Vec::with_capacity(decoded.len());
    for (m, tp, view, d) in decoded {
        let offset = m.offset();
        match d {
            Ok(Command::Schedule(job)) => jobs.push(Entry::new(job, tp, offset)),
            Ok(Command::Release { key, id }) => held::release(shared, tp, offset, key, id),
            // Decoding allows neither on a work topic.
            Ok(Command::Cancel(_) | Command::Reschedule { .. }) => shared.jobs.finish_now(tp, offset),
            Err(e) => dead_letter_record(shared, m, &view, &e, tp),
        }
    }
    let now_ms = now.timestamp_millis();
    let mut parks = Vec::new();
    let mut early = Vec::new();
    let starts = {
        let mut st = shared.jobs.lock();
        for e in jobs {
            if !st.owned.contains_key(&e.tp) {
                continue;
            }
            // Unfinished from now on: a parked job until the keeper wrote
            // it, an early one until the scheduler has it.
            st.tracker.read(e.tp, e.offset);
            let Some(e) = held::admit(shared, &mut st, e, now_ms, &mut parks) else {
                continue;
            };
            // A job may start from its run-at less its early allowance.
            if e.instead.is_none() && e.job.earliest_start() > now + tolerance {
                if shared.topics.holding[e.tp.0] {
                    // Through the keeper, in order with the partition's
                    // parks: a hold that counts a later park then never
                    // counts past a hand-over Kafka may not have.
                    parks.push(held::handed_over(&mut st, e));
                } else {
                    early.push(e);
                }
                continue;
            }
            if e.job.skip_if_busy && e.job.attempt == 1 && e.instead.is_none() && st.table.busy(&e.job.key) {
                skip(shared, &mut st, e);
                continue;
            }
            st.table.push(e);
        }
        // Handed to the keeper under the lock that gave them their park
        // sequence, so that the keeper writes them in that order.
        keeper::hand(shared, &mut st, std::mem::take(&mut parks));
        start_ready(shared, &mut st)
    };
    for e in early {
        hand_to_scheduler(shared, e.job, e.tp, e.offset);
    }
    shared.dispatch(starts);
}

/// A first attempt that asks to be skipped while its key is busy (a
/// recurring schedule's occurrence whose previous one still runs) is
/// finished without running: nothing is written for it.
fn skip(shared: &Shared, st: &mut WorkerState, e: Entry) {
    info!(job_id = %e.job.id, key = %e.job.key_lossy(), partition = e.tp.1, offset = e.offset,
        "skipped: a job of its key is running or waiting");
    shared.stats.skipped.fetch_add(1, Ordering::Relaxed);
    st.finish(e.tp, e.offset, None);
}

/// A record that does not decode goes to the dead-letter topic with the reason.
pub(super) fn dead_letter_record(
    shared: &Arc<Shared>,
    m: &BorrowedMessage<'_>,
    view: &RecordView<'_>,
    e: &wire::DecodeError,
    tp: Tp,
) {
    let offset = m.offset();
    warn!(topic = m.topic(), partition = tp.1, offset, reason = %e, "work record dead-lettered");
    let dead = DeadLetter {
        reason: e.to_string(),
        origin_topic: m.topic().to_string(),
        origin_partition: tp.1,
        origin_offset: offset,
    };
    let rec = wire::dead_letter_record(view, &dead, &shared.cfg.topics.dead_letter, &shared.cfg.limits);
    let s = shared.clone();
    write_in_background(
        shared,
        tp,
        offset,
        |s| &s.dead_lettered,
        move || {
            let (s, rec) = (s.clone(), rec.clone());
            async move { send_or_stage(&s, rec).await }
        },
    );
}

/// A job read before its run-at goes back to the scheduler.
pub(super) fn hand_to_scheduler(shared: &Arc<Shared>, job: Job, tp: Tp, offset: i64) {
    debug!(job_id = %job.id, key = %job.key_lossy(), partition = tp.1, offset, "read before its run-at; handed to the scheduler");
    let s = shared.clone();
    write_in_background(
        shared,
        tp,
        offset,
        |s| &s.handed_to_scheduler,
        move || {
            let (s, job) = (s.clone(), job.clone());
            async move {
                let (rec, _) = s.out.producer.route(job).await.map_err(|e| e.to_string())?;
                send_or_stage(&s, rec).await
            }
        },
    );
}
