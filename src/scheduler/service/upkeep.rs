//! Upkeep off the firing path: the cascader, which keeps every owned
//! partition's cascade point three windows ahead (the one place it moves
//! while partitions are owned), the value log compacted, and the fair
//! topics' tenants forgotten once their recent service has decayed away.

use std::sync::Arc;
use std::time::Duration;

use super::{blocking_store, Shared};

/// Keep every owned partition's cascade point three windows ahead, off the
/// dispatcher's path: moving far jobs into the near range rewrites their
/// chunks, and done inside a refill it held up the fires (by up to 100 ms
/// with a short window). The refill then finds the near range ready; one
/// that does not (the clock jumped, a partition just came) asks for a round
/// now, and the dispatcher is woken after it. The window has nothing to
/// follow: cascaded jobs are beyond its horizons.
pub(super) async fn cascade_loop(shared: Arc<Shared>) {
    let every = (shared.cfg.scheduler.window / 4).clamp(Duration::from_millis(50), Duration::from_secs(15));
    loop {
        let parts = shared.jobs.partitions();
        let until = cascade_until(&shared);
        let mut moved_any = false;
        for p in parts {
            let moved = blocking_store(&shared, "cascade", move |s| {
                let from = s.store.checkpoint(p)?.cascaded_to;
                loop {
                    let t = s.store.cascade(p, until)?;
                    if t >= until || s.signals.stop.is_cancelled() {
                        return Ok(t > from);
                    }
                }
            })
            .await;
            match moved {
                Ok(moved) => moved_any |= moved,
                Err(e) => {
                    shared.fail(format!("cascading partition {p}: {e}"));
                    return;
                }
            }
        }
        if moved_any {
            shared.signals.wake.notify_one();
        }
        // A tenant seen once is held until its service decays away, then
        // forgotten: the table follows the tenants active lately, not all
        // the tenants ever seen.
        let now = shared.clock.now().timestamp_millis();
        shared.jobs.sweep_fair(now);
        // Stragglers (jobs due far ahead) keep old value-log segments alive:
        // copy them forward so the segments can go.
        if let Err(e) = blocking_store(&shared, "compact", |s| {
            // Flushed now so that the emptied segments go now.
            if s.store.compact(COMPACT_BYTES)? > 0 {
                s.store.flush()?;
            }
            Ok(())
        })
        .await
        {
            shared.fail(format!("compacting the store's value log: {e}"));
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = shared.signals.cascade_wanted.notified() => {}
            _ = shared.signals.stop.cancelled() => return,
        }
    }
}

/// Most bytes one compaction pass copies (one pass per cascade round).
pub(super) const COMPACT_BYTES: u64 = 32 << 20;

/// Where the cascade point is kept: three windows ahead of now.
pub(super) fn cascade_until(shared: &Shared) -> i64 {
    let window = shared.cfg.scheduler.window.as_millis() as i64;
    shared.clock.now().timestamp_millis().saturating_add(3 * window)
}
