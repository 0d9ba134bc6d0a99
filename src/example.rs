//! The example job handler behind `kairos worker` and `kairos demo`.
//!
//! It reads its instructions from the payload, so that a demo or a test can
//! say what each job does: `work=MS` sleeps that long, `fail=N` fails the
//! first N attempts (then succeeds), `dead` declares the job dead at once,
//! `then=TOPIC` writes a follow-up job to TOPIC when done (same key,
//! payload `follow-up of JOB-ID`). Anything else is simply done. With an event file it appends one line per
//! start and end of a run (`start|end KEY JOB-ID ATTEMPT UNIX-NANOS PID`), in
//! one `write` each, so several worker processes can share the file and a
//! checker can prove that no two runs of a key overlapped.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kairos::job::Job;
use kairos::worker::{JobContext, Outcome};

/// What the payload asks of the example handler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instructions {
    /// How long to work.
    pub work: Duration,
    /// Attempts to fail before succeeding.
    pub fail: u32,
    /// Declare the job dead.
    pub dead: bool,
    /// Write a follow-up job to this topic when done.
    pub then: Option<String>,
}

impl Instructions {
    /// Parse `key=value` words of a payload; unknown words are ignored.
    pub fn parse(payload: &[u8]) -> Self {
        let text = String::from_utf8_lossy(payload);
        let mut out = Instructions::default();
        for word in text.split_whitespace() {
            match word.split_once('=') {
                Some(("work", ms)) => out.work = Duration::from_millis(ms.parse().unwrap_or(0)),
                Some(("fail", n)) => out.fail = n.parse().unwrap_or(0),
                Some(("then", topic)) if !topic.is_empty() => out.then = Some(topic.to_string()),
                None if word == "dead" => out.dead = true,
                _ => {}
            }
        }
        out
    }
}

/// Appends start and end events to a file shared by processes.
#[derive(Clone)]
pub struct EventLog {
    file: Arc<Mutex<std::fs::File>>,
}

impl EventLog {
    /// Open `path` for appending.
    pub fn open(path: &PathBuf) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(EventLog {
            file: Arc::new(Mutex::new(file)),
        })
    }

    fn record(&self, what: &str, job: &Job) {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let line = format!(
            "{what} {} {} {} {nanos} {}\n",
            job.key_lossy(),
            job.id,
            job.attempt,
            std::process::id()
        );
        if let Ok(mut f) = self.file.lock() {
            // One write call per line: O_APPEND keeps lines whole across processes.
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// The example handler: follows the payload's instructions, logs events.
pub async fn handle(job: Job, ctx: JobContext, log: Option<EventLog>) -> Outcome {
    let ins = Instructions::parse(&job.payload);
    if let Some(l) = &log {
        l.record("start", &job);
    }
    tracing::info!(job_id = %job.id, key = %job.key_lossy(), attempt = job.attempt, partition = ctx.partition,
        offset = ctx.offset, "running job");
    if !ins.work.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(ins.work) => {}
            _ = ctx.cancel.cancelled() => {}
        }
    }
    let outcome = if ins.dead {
        Outcome::dead("the payload asked to be dead")
    } else if job.attempt <= ins.fail {
        Outcome::retry(format!(
            "failing as asked (attempt {} of {} failures)",
            job.attempt, ins.fail
        ))
    } else if let Some(topic) = &ins.then {
        let payload = format!("follow-up of {}", job.id);
        Outcome::done_with(vec![Job::new(topic.as_str(), job.key.clone(), payload)])
    } else {
        Outcome::done()
    };
    if let Some(l) = &log {
        l.record("end", &job);
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_instructions() {
        assert_eq!(
            Instructions::parse(b"job 7 work=20 fail=2"),
            Instructions {
                work: Duration::from_millis(20),
                fail: 2,
                dead: false,
                then: None,
            }
        );
        assert_eq!(
            Instructions::parse(b"then=emails.sent").then.as_deref(),
            Some("emails.sent")
        );
        assert!(Instructions::parse(b"dead").dead);
        assert_eq!(Instructions::parse(&[0xff, b' ', b'x']), Instructions::default());
    }
}
