//! `kairos schedules`: define, list, pause, resume and delete recurring
//! schedules from a shell.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Subcommand;
use kairos::config::Config;
use kairos::schedules::{JobTemplate, Misfire, Overlap, Schedule, ScheduleView, Schedules};

// Parsed once per run: the size of the flags' variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum SchedulesCommand {
    /// Define a schedule (or replace its definition): from a JSON file
    /// (`--file`, `-` for stdin) or from flags. Writing the same definition
    /// again changes nothing.
    Upsert {
        /// The definition as JSON (the schedules topic's format).
        #[arg(long, conflicts_with_all = ["cron", "every"])]
        file: Option<PathBuf>,
        /// Schedule id (with flags).
        #[arg(required_unless_present = "file")]
        id: Option<String>,
        /// Cron pattern (5 fields, or 6 with seconds first).
        #[arg(long, conflicts_with = "every")]
        cron: Option<String>,
        /// Fixed interval (e.g. `30s`, `1h`), counted from `--start`.
        #[arg(long, value_parser = humantime::parse_duration)]
        every: Option<Duration>,
        /// Work topic each occurrence runs from.
        #[arg(long)]
        topic: Option<String>,
        /// Payload of each occurrence's job.
        #[arg(long)]
        payload: Option<String>,
        /// Entity key of each occurrence's job (default: the schedule id).
        #[arg(long)]
        key: Option<String>,
        /// IANA time zone of the cron pattern.
        #[arg(long, default_value = "UTC")]
        time_zone: String,
        /// Missed occurrences: `all`, `latest` or `none`.
        #[arg(long, default_value = "latest", value_parser = ["all", "latest", "none"])]
        misfire: String,
        /// Occurrences may run side by side (each with a key of its own).
        #[arg(long)]
        parallel: bool,
        /// No occurrence before this time (RFC 3339).
        #[arg(long)]
        start: Option<String>,
        /// No occurrence after this time (RFC 3339).
        #[arg(long)]
        end: Option<String>,
    },
    /// Every schedule: its recurrence, next and last occurrences, paused.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// One schedule, as JSON.
    Get {
        /// Schedule id.
        id: String,
    },
    /// Pause a schedule: no occurrence until it is resumed.
    Pause {
        /// Schedule id.
        id: String,
        /// Why (shown by `list`).
        #[arg(long)]
        note: Option<String>,
    },
    /// Resume a paused schedule; occurrences missed while paused do not run.
    Resume {
        /// Schedule id.
        id: String,
    },
    /// Enqueue a schedule's occurrences between two times again, under
    /// their ids; asking again for the same range does nothing.
    Backfill {
        /// Schedule id.
        id: String,
        /// First nominal time (RFC 3339 or epoch ms).
        #[arg(long)]
        from: String,
        /// Last nominal time (RFC 3339 or epoch ms).
        #[arg(long)]
        to: String,
    },
    /// Delete a schedule.
    Delete {
        /// Schedule id.
        id: String,
    },
}

/// Run `command` against `cfg`'s schedules topic.
pub(crate) async fn run(cfg: &Config, command: SchedulesCommand) -> anyhow::Result<()> {
    let schedules = Schedules::new(cfg)?;
    match command {
        SchedulesCommand::Upsert { file: Some(file), .. } => {
            let bytes = match file.to_str() {
                Some("-") => std::io::Read::bytes(std::io::stdin()).collect::<Result<Vec<u8>, _>>()?,
                _ => std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?,
            };
            let (s, _) = Schedule::from_json(&bytes)?;
            schedules.upsert(&s).await?;
            println!("schedule `{}` written", s.id);
        }
        SchedulesCommand::Upsert {
            id,
            cron,
            every,
            topic,
            payload,
            key,
            time_zone,
            misfire,
            parallel,
            start,
            end,
            ..
        } => {
            let id = id.context("a schedule id")?;
            let topic = topic.context("--topic: the work topic its jobs run from")?;
            let payload = payload.context("--payload: what each occurrence's job carries")?;
            let mut job = JobTemplate::new(topic, payload);
            job.key = key;
            let mut s = match (cron, every) {
                (Some(c), None) => Schedule::cron(id, c, job),
                (None, Some(e)) => Schedule::every(id, e, job),
                _ => anyhow::bail!("give --cron or --every"),
            };
            s.time_zone = time_zone;
            s.misfire = match misfire.as_str() {
                "all" => Misfire::All,
                "none" => Misfire::None,
                _ => Misfire::Latest,
            };
            if parallel {
                s.overlap = Overlap::Parallel;
            }
            let time = |t: Option<String>, flag: &str| {
                t.map(|t| kairos::wire::parse_time(&t).map_err(|p| anyhow::anyhow!("--{flag} {p}")))
                    .transpose()
            };
            s.start = time(start, "start")?;
            s.end = time(end, "end")?;
            schedules.upsert(&s).await?;
            println!("schedule `{}` written", s.id);
        }
        SchedulesCommand::List { json } => {
            let all = schedules.list().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
            } else {
                print!("{}", table(&all));
            }
        }
        SchedulesCommand::Get { id } => match schedules.get(&id).await? {
            Some(v) => println!("{}", serde_json::to_string_pretty(&v)?),
            None => anyhow::bail!("no schedule `{id}`"),
        },
        SchedulesCommand::Pause { id, note } => {
            schedules.pause(&id, note).await?;
            println!("schedule `{id}` paused");
        }
        SchedulesCommand::Resume { id } => {
            schedules.resume(&id).await?;
            println!("schedule `{id}` resumed");
        }
        SchedulesCommand::Backfill { id, from, to } => {
            let time = |t: &str, flag: &str| {
                kairos::wire::parse_time(t).map_err(|p| anyhow::anyhow!("--{flag} {p}"))
            };
            schedules
                .backfill(&id, time(&from, "from")?, time(&to, "to")?)
                .await?;
            println!("backfill of `{id}` from {from} to {to} asked for");
        }
        SchedulesCommand::Delete { id } => {
            schedules.delete(&id).await?;
            println!("schedule `{id}` deleted");
        }
    }
    Ok(())
}

fn table(all: &[ScheduleView]) -> String {
    let time =
        |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".to_string(), kairos::wire::format_time);
    let mut out = format!(
        "{:<24} {:<22} {:<16} {:<26} {:<26} {:>6} {:>8} state\n",
        "id", "recurrence", "zone", "next", "last", "late", "dropped"
    );
    for v in all {
        let (every, zone, state) = match &v.schedule {
            Some(s) => (
                s.cron
                    .clone()
                    .or_else(|| {
                        s.every
                            .map(|e| format!("every {}", humantime::format_duration(e)))
                    })
                    .unwrap_or_default(),
                s.time_zone.clone(),
                match (s.paused, &s.note) {
                    (true, Some(n)) => format!("paused: {n}"),
                    (true, None) => "paused".into(),
                    _ => "running".into(),
                },
            ),
            None => (
                "-".into(),
                "-".into(),
                format!("invalid: {}", v.invalid.as_deref().unwrap_or("")),
            ),
        };
        out.push_str(&format!(
            "{:<24} {:<22} {:<16} {:<26} {:<26} {:>6} {:>8} {state}\n",
            v.id,
            every,
            zone,
            time(v.next),
            time(v.last),
            v.late,
            v.dropped
        ));
    }
    out
}
