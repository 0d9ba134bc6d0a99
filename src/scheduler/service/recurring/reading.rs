//! The recurring schedules' reading side: partition N of the schedules and
//! cursors topics read into the state when schedule partition N is
//! assigned (up to their ends, open transactions waited out), then
//! followed; let go when it is revoked.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::{Offset, TopicPartitionList};
use tracing::{debug, info, warn};

use super::state::Defined;
use super::{write, Engine};
use crate::schedules;
use crate::sync::Lock;
use crate::wire;

impl Engine<'_> {
    /// Read partition `p` of both topics from their start; returns the ends to reach.
    pub(super) fn start_reading(&self, p: i32) -> Result<[i64; 2], String> {
        self.state.clear(p).map_err(|e| e.to_string())?;
        let timeout = Duration::from_secs(10);
        let mut ends = [0; 2];
        let mut tpl = TopicPartitionList::new();
        for (i, t) in self.topics.iter().enumerate() {
            let (low, high) = self
                .ends
                .fetch_watermarks(t, p, timeout)
                .map_err(|e| format!("ends of `{t}` [{p}]: {e}"))?;
            // Nothing left to read (all deleted): nothing to wait for.
            ends[i] = if low >= high { 0 } else { high };
            tpl.add_partition_offset(t, p, Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
        self.reader.incremental_assign(&tpl).map_err(|e| e.to_string())?;
        Ok(ends)
    }

    pub(super) fn stop_reading(&self, p: i32) {
        let mut tpl = TopicPartitionList::new();
        for t in &self.topics {
            tpl.add_partition(t, p);
        }
        if let Err(e) = self.reader.incremental_unassign(&tpl) {
            debug!(partition = p, error = %e, "schedules reader: unassign");
        }
    }

    /// Partitions read up to their ends as of their assignment start running.
    pub(super) fn check_caught_up(&self, owned: &mut BTreeMap<i32, Option<[i64; 2]>>) {
        if owned.values().all(Option::is_none) {
            return;
        }
        let Ok(pos) = self.reader.position() else { return };
        for (p, catching_up) in owned.iter_mut() {
            let Some(ends) = catching_up else { continue };
            let done = self.topics.iter().zip(ends.iter()).all(|(t, end)| {
                *end == 0
                    || matches!(pos.find_partition(t, *p).map(|e| e.offset()),
                        Some(Offset::Offset(o)) if o >= *end)
            });
            if done {
                match self.state.orphans(*p) {
                    Ok(n) => info!(
                        partition = p,
                        orphaned_cursors = n,
                        "recurring schedules caught up"
                    ),
                    Err(e) => {
                        warn!(partition = p, error = %e, "recurring schedules: orphaned cursors not looked for")
                    }
                }
                *catching_up = None;
            }
        }
    }

    /// Read for up to `wait`; apply what came.
    pub(super) fn read(&mut self, wait: Duration) {
        let mut first = Some(wait);
        for _ in 0..1000 {
            let Some(msg) = self.reader.poll(first.take().unwrap_or(Duration::ZERO)) else {
                return;
            };
            match msg {
                Ok(m) => {
                    if let Err(e) = self.apply(&m) {
                        warn!(error = %e, "recurring schedules: record not applied");
                    }
                }
                Err(e) => debug!(error = %e, "recurring schedules: reading"),
            }
        }
    }

    fn apply(&self, m: &BorrowedMessage<'_>) -> Result<(), String> {
        let p = m.partition();
        let c = self.shared.schedules.control.locked();
        let Some(catching_up) = c.owned.get(&p) else {
            return Ok(()); // no longer owned
        };
        let running = catching_up.is_none();
        let Some(id) = m.key().and_then(|k| std::str::from_utf8(k).ok()) else {
            return Ok(());
        };
        if m.topic() == self.topics[1] {
            match m.payload() {
                None => self.state.uncursor(p, id).map_err(|e| e.to_string())?,
                Some(v) => {
                    if let Some(c) = schedules::decode_cursor(v) {
                        self.state.merge_cursor(p, id, &c).map_err(|e| e.to_string())?;
                    }
                }
            }
            return Ok(());
        }
        if let Some(id) = id.strip_suffix(schedules::BACKFILL_SUFFIX) {
            let asked = self
                .state
                .ask_backfill(p, id, m.payload())
                .map_err(|e| e.to_string())?;
            if !asked && m.payload().is_some() {
                warn!(
                    schedule = id,
                    partition = p,
                    offset = m.offset(),
                    "backfill request refused: not a backfill"
                );
            }
            return Ok(());
        }
        let written = m
            .timestamp()
            .to_millis()
            .unwrap_or_else(|| self.shared.clock.now().timestamp_millis());
        let did = self
            .state
            .define(p, id, m.payload(), written)
            .map_err(|e| e.to_string())?;
        if did != Defined::Unchanged {
            self.shared.schedules.updates.fetch_add(1, Ordering::Relaxed);
        }
        // A catch-up reads every definition of the partition again: one
        // line each only when read live (a take-over of a million
        // schedules would log a million).
        match did {
            Defined::Changed | Defined::Deleted if running => {
                let what = match did {
                    Defined::Deleted => "deleted",
                    _ => "defined",
                };
                info!(
                    schedule = id,
                    partition = p,
                    offset = m.offset(),
                    "recurring schedule {what}"
                )
            }
            Defined::Changed | Defined::Deleted => {
                debug!(schedule = id, partition = p, offset = m.offset(), change = ?did, "recurring schedule read")
            }
            Defined::Unchanged => {}
            Defined::Invalid(reason) => {
                warn!(schedule = id, partition = p, offset = m.offset(), reason = %reason,
                    "recurring schedule definition refused; the schedule stops");
                // Dead-lettered when read live, not again at each catch-up.
                if running {
                    let dead = wire::DeadLetter {
                        reason: format!("recurring schedule definition: {reason}"),
                        origin_topic: m.topic().to_string(),
                        origin_partition: p,
                        origin_offset: m.offset(),
                    };
                    let cfg = &self.shared.cfg;
                    let view = wire::RecordView::from_message(m);
                    let rec = wire::dead_letter_record(&view, &dead, &cfg.topics.dead_letter, &cfg.limits);
                    drop(c);
                    write(self.shared, vec![(rec, None)])?;
                    self.shared.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }
}
