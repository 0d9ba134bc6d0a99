//! In touch with the group coordinator: a worker that has not heard from
//! it for half the session timeout starts no job, since its partitions may
//! have moved without it knowing yet.

use std::time::Instant;

use super::{drive, Shared, State};

impl Shared {
    /// Whether jobs may start: the group coordinator answered within half
    /// the session timeout. A worker that has not heard from it for longer
    /// may have lost its partitions without knowing yet (its session can
    /// expire on the coordinator while the two cannot reach each other, and
    /// the partitions go to another worker): a job it started then could
    /// run beside the new owner's run of the same key. Such a worker keeps
    /// what it has buffered and starts it once an answer comes.
    pub(super) fn in_touch(&self, st: &mut State) -> bool {
        if !self.out_of_touch(st) {
            return true;
        }
        let window = self.cfg.worker.session_timeout / 2;
        if !st.out_of_touch && !st.owned.is_empty() {
            tracing::warn!(for_at_least = ?window,
                "no answer from the group coordinator: starting no job until one comes (the partitions may have moved)");
        }
        st.out_of_touch = true;
        false
    }

    /// Whether the group coordinator has not answered for half the session
    /// timeout (see [`Shared::in_touch`]).
    pub(super) fn out_of_touch(&self, st: &State) -> bool {
        let window = self.cfg.worker.session_timeout / 2;
        st.heard.is_none_or(|t| t.elapsed() >= window)
    }

    /// The group coordinator answered (a commit was taken): jobs held back
    /// for want of an answer start.
    pub(super) fn heard_from_coordinator(&self) {
        let starts = {
            let mut st = self.state();
            st.heard = Some(Instant::now());
            if std::mem::take(&mut st.out_of_touch) {
                tracing::info!("the group coordinator answered again: starting jobs");
                drive::start_ready(self, &mut st)
            } else {
                Vec::new()
            }
        };
        self.dispatch(starts);
    }
}
