//! The demo's closing summary, as printed.

use super::DemoSummary;

/// What the summary needs beyond [`DemoSummary`].
pub(super) struct Tally {
    /// Jobs written and never finished.
    pub(super) lost: usize,
    /// Runs of cancelled jobs.
    pub(super) ran_cancelled: usize,
    /// Rescheduled jobs that ran once, at their new time.
    pub(super) moved_ran: usize,
    /// Runs the main worker started.
    pub(super) started: u64,
    /// Partitions the main worker owned at the end.
    pub(super) owned: usize,
}

/// Print the summary of `s`.
pub(super) fn print(s: &DemoSummary, t: Tally) {
    println!(
        "\nsummary    {} jobs written: {} done, {} dead-lettered, {} retries\n           \
         {} lost, {} ran early, {} keys out of order, {} same-key overlaps (the worker's lock table)\n           \
         delayed jobs started after their run-at by p50 {} ms, p99 {} ms, max {} ms\n           \
         {} cancelled before their run-at, {} of them ran; {} rescheduled, {} ran once at the new time ({} at the old time or twice)\n           \
         held key ran {:?} (job 2 failing twice held it; the key's later jobs waited, in order)\n           \
         exactly once: {} of {} jobs' follow-ups read back once, {} more than once; its held key ran {:?}\n           \
         recurring: {} of {} occurrences fired once, {} more than once, {} skipped while the one before ran\n           \
         worker: {} runs started, {} partitions owned at the end",
        s.written,
        s.done,
        s.dead,
        s.retries,
        t.lost,
        s.early,
        s.out_of_order,
        s.overlaps,
        s.lateness_ms.0,
        s.lateness_ms.1,
        s.lateness_ms.2,
        s.cancelled,
        t.ran_cancelled,
        s.rescheduled,
        t.moved_ran,
        s.changes_ignored - t.ran_cancelled,
        s.held_key,
        s.exactly_once.once,
        s.exactly_once.jobs,
        s.exactly_once.extra,
        s.exactly_once.held_key,
        s.recurring.once,
        s.recurring.occurrences,
        s.recurring.extra,
        s.recurring.skipped,
        t.started,
        t.owned
    );
}
