//! The example handler's event log (`kairos worker --events FILE`), read
//! back: runs per key as time intervals, for overlap and order checks.

use std::collections::HashMap;
use std::path::Path;

use kairos::JobId;

/// One line: a run of a job started or ended in some process.
#[derive(Clone, Debug)]
pub struct Event {
    /// Start (true) or end (false) of a run.
    pub start: bool,
    /// The job's key.
    pub key: String,
    /// The job.
    pub id: JobId,
    /// Its attempt.
    pub attempt: u32,
    /// Wall-clock time, Unix nanoseconds.
    pub nanos: u128,
    /// The worker process.
    pub pid: u32,
}

/// Every complete line of the log (a line being written is skipped).
pub fn read(path: &Path) -> Vec<Event> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.len() == 6).then_some(())?;
            Some(Event {
                start: f[0] == "start",
                key: f[1].to_string(),
                id: f[2].parse().ok()?,
                attempt: f[3].parse().ok()?,
                nanos: f[4].parse().ok()?,
                pid: f[5].parse().ok()?,
            })
        })
        .collect()
}

/// One run of a job: when it started and ended, in which process.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Run {
    /// Start, Unix nanoseconds.
    pub start: u128,
    /// End, Unix nanoseconds (the process's death for a run cut by SIGKILL).
    pub end: u128,
    /// The worker process.
    pub pid: u32,
    /// The job.
    pub id: JobId,
    /// Its attempt.
    pub attempt: u32,
}

/// A start with no end yet, by (process, job, attempt): its start times.
type Open = HashMap<(u32, JobId, u32), Vec<u128>>;

/// Pair each start with the next end of the same process, job and attempt
/// (the same job can run twice in a process when it was delivered twice):
/// the finished runs, and the starts with no end.
fn pair(events: &[Event]) -> (Vec<Run>, Open) {
    let mut sorted: Vec<&Event> = events.iter().collect();
    sorted.sort_by_key(|e| (e.nanos, !e.start));
    let mut open: Open = HashMap::new();
    let mut done = Vec::new();
    for e in &sorted {
        let slot = open.entry((e.pid, e.id, e.attempt)).or_default();
        if e.start {
            slot.push(e.nanos);
        } else if !slot.is_empty() {
            done.push(Run {
                start: slot.remove(0),
                end: e.nanos,
                pid: e.pid,
                id: e.id,
                attempt: e.attempt,
            });
        }
    }
    open.retain(|_, starts| !starts.is_empty());
    (done, open)
}

/// Runs still going in processes that were not killed (a duplicate delivery
/// can still be running when the last job first succeeds).
pub fn in_flight(events: &[Event], deaths: &HashMap<u32, u128>) -> usize {
    open_runs(events, deaths).len()
}

/// The runs [`in_flight`] counts: (process, job, attempt, start nanos).
pub fn open_runs(events: &[Event], deaths: &HashMap<u32, u128>) -> Vec<(u32, JobId, u32, u128)> {
    pair(events)
        .1
        .into_iter()
        .filter(|((pid, _, _), _)| !deaths.contains_key(pid))
        .flat_map(|((pid, id, attempt), starts)| starts.into_iter().map(move |s| (pid, id, attempt, s)))
        .collect()
}

/// Runs per key. A start is paired with the next end of the same process,
/// job and attempt; a start with no end belongs to a process that was
/// killed, and ends at its death, taken from `deaths` (pid → Unix nanos).
/// Panics on a run with no end in a process that was not killed.
pub fn runs_by_key(events: &[Event], deaths: &HashMap<u32, u128>) -> HashMap<String, Vec<Run>> {
    let key_of: HashMap<JobId, &str> = events.iter().map(|e| (e.id, e.key.as_str())).collect();
    let (mut runs, open) = pair(events);
    for ((pid, id, attempt), starts) in open {
        for start in starts {
            let end = *deaths.get(&pid).unwrap_or_else(|| {
                panic!("run of {id} (attempt {attempt}) in live process {pid} never ended")
            });
            runs.push(Run {
                start,
                end,
                pid,
                id,
                attempt,
            });
        }
    }
    let mut out: HashMap<String, Vec<Run>> = HashMap::new();
    for r in runs {
        out.entry(key_of[&r.id].to_string()).or_default().push(r);
    }
    for runs in out.values_mut() {
        runs.sort();
    }
    out
}

/// Pairs of runs of one key that overlapped in time.
pub fn overlaps(runs: &HashMap<String, Vec<Run>>) -> Vec<(String, Run, Run)> {
    let mut out = Vec::new();
    for (key, rs) in runs {
        // Runs are sorted by start; compare each with the latest end so far.
        let mut latest: Option<&Run> = None;
        for r in rs {
            if let Some(l) = latest {
                if r.start < l.end {
                    out.push((key.clone(), l.clone(), r.clone()));
                }
            }
            if latest.is_none_or(|l| r.end > l.end) {
                latest = Some(r);
            }
        }
    }
    out
}
