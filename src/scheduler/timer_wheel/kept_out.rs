//! Jobs the window does not hold: those of the topics kept out (fair
//! topics, whose due jobs wait in the fair lanes, see
//! `scheduler/service/jobs/fair.rs`). The window still answers for them
//! what it answers for its own jobs: whether one is being fired (a change
//! of it comes too late) and whether an ingest batch is changing it (it is
//! not released until the change is applied).

use super::TimerWheel;

use crate::job::JobId;

impl TimerWheel {
    /// Keep the jobs of `topics` out of the window: they are followed,
    /// refilled and put back elsewhere.
    pub fn keep_out(&mut self, topics: &[String]) {
        self.kept_out.extend(topics.iter().cloned());
    }

    /// Whether the jobs of `topic` are kept out of the window.
    pub fn keeps_out(&self, topic: &str) -> bool {
        !self.kept_out.is_empty() && self.kept_out.contains(topic)
    }

    /// Whether an ingest batch is changing job `id` of `partition`.
    pub fn is_changing(&self, partition: i32, id: &JobId) -> bool {
        !self.changing.is_empty() && self.changing.contains_key(&(partition, *id))
    }

    /// Job `id` of `partition`, released from outside the window, is
    /// being fired: until [`TimerWheel::fired`], as a job taken from it.
    pub fn firing_from_elsewhere(&mut self, partition: i32, id: JobId) {
        *self.firing.entry((partition, id)).or_default() += 1;
    }
}
