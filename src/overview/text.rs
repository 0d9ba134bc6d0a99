//! `kairos stats` as a table for people.

use std::fmt::Write;

use super::{SchedulerFigures, TopicFigures, WorkerFigures, DUE_SPANS};

/// What `kairos stats` prints without `--json`: per topic, records and lag;
/// the jobs the schedulers hold by when they come due (and per work topic,
/// when asked); the jobs the workers hold and run.
pub fn text(figures: &[TopicFigures], held: &SchedulerFigures, busy: &WorkerFigures) -> String {
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "{:<12} {:<40} {:>10} {:>10}  group",
        "role", "topic", "records", "lag"
    );
    for f in figures {
        let lag = f.lag.map_or("-".into(), |l| l.to_string());
        let group = f.group.as_deref().unwrap_or("-");
        let _ = writeln!(
            w,
            "{:<12} {:<40} {:>10} {lag:>10}  {group}",
            f.role, f.topic, f.records
        );
    }
    if held.asked.is_empty() {
        let _ = writeln!(
            w,
            "\njobs waiting in the scheduler: no admin endpoint known ([scheduler.admin] listen, or --admin)"
        );
    } else {
        let _ = writeln!(
            w,
            "\njobs waiting in the scheduler: {} (asked {})",
            held.pending,
            held.asked.join(", ")
        );
        for span in DUE_SPANS {
            let n = held.pending_by_due.get(span).copied().unwrap_or(0);
            let _ = writeln!(w, "  due {span:<6} {n:>10}");
        }
        for (topic, spans) in held.by_topic.iter().flatten() {
            let shown: Vec<String> = DUE_SPANS
                .iter()
                .map(|d| format!("{d} {}", spans.get(*d).copied().unwrap_or(0)))
                .collect();
            let _ = writeln!(w, "  {topic}: {}", shown.join(", "));
        }
        for u in &held.unreachable {
            let _ = writeln!(w, "  not answering: {u}");
        }
    }
    if busy.asked.is_empty() {
        let _ = writeln!(
            w,
            "\njobs in the workers: no admin endpoint known ([worker.admin] listen, or --worker-admin)"
        );
    } else {
        let _ = writeln!(
            w,
            "\njobs in the workers: {} buffered or running (asked {})",
            busy.open,
            busy.asked.join(", ")
        );
        for (topic, n) in &busy.running_by_topic {
            let _ = writeln!(w, "  {topic}: {n} running");
        }
        for u in &busy.unreachable {
            let _ = writeln!(w, "  not answering: {u}");
        }
    }
    out
}
