//! The command line: every `kairos` subcommand and its flags (clap).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use kairos::JobId;

#[derive(Parser)]
#[command(
    name = "kairos",
    version,
    about = "Delayed-scheduling job queue on Apache Kafka"
)]
pub(crate) struct Cli {
    /// Configuration file (TOML); `KAIROS_<SECTION>__<KEY>` variables override it.
    #[arg(long, short, global = true, env = "KAIROS_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// Bootstrap servers, overriding `kafka.brokers`.
    #[arg(long, global = true)]
    pub(crate) brokers: Option<String>,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Manage Kairos's topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// See Kairos work: a broker, the scheduler and sample jobs firing on time.
    /// Without --brokers an in-process development broker serves.
    Demo {
        /// Jobs to write.
        #[arg(long, default_value_t = 300)]
        jobs: usize,
        /// Distinct entity keys.
        #[arg(long, default_value_t = 30)]
        keys: usize,
        /// Longest delay of the sample jobs (e.g. 8s).
        #[arg(long, default_value = "8s", value_parser = humantime::parse_duration)]
        max_delay: std::time::Duration,
        /// At the end, print what the demo saw as one line of JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run the scheduler service: hold future jobs on disk, fire them on time.
    Scheduler,
    /// Run a worker with the example handler (it follows each payload's
    /// instructions: `work=MS`, `fail=N`, `dead`, `then=TOPIC`).
    Worker {
        /// Append start/end events of every run to this file.
        #[arg(long, env = "KAIROS_EXAMPLE_EVENTS")]
        events: Option<PathBuf>,
    },
    /// Write a job: due now, at a time, or after a delay.
    Enqueue {
        /// Work topic the job runs from.
        #[arg(long)]
        topic: String,
        /// Entity key: jobs of one key run one at a time, in order.
        #[arg(long)]
        key: String,
        /// Payload (text).
        #[arg(long)]
        payload: String,
        /// Run at this time (RFC 3339, or epoch milliseconds).
        #[arg(long, conflicts_with = "after")]
        at: Option<String>,
        /// Run after this delay (e.g. `90s`, `5m`, `1h 30m`).
        #[arg(long, value_parser = humantime::parse_duration)]
        after: Option<Duration>,
        /// Tenant, for fair dispatch.
        #[arg(long)]
        tenant: Option<String>,
        /// Attempts allowed before dead-lettering.
        #[arg(long)]
        max_attempts: Option<u32>,
    },
    /// Where jobs stand: per topic, the records it holds and how far its
    /// consumer group is behind; the dead-letter topic's size.
    Stats {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Scheduler admin endpoints to ask for the jobs they hold
        /// (default: `[scheduler.admin] listen`).
        #[arg(long = "admin")]
        admin: Vec<std::net::SocketAddr>,
        /// Also count the jobs held per work topic (each scheduler reads
        /// every pending job for it).
        #[arg(long)]
        by_topic: bool,
        /// Worker admin endpoints to ask for the jobs they hold and run
        /// (default: `[worker.admin] listen`).
        #[arg(long = "worker-admin")]
        worker_admin: Vec<std::net::SocketAddr>,
    },
    /// A pending job by id: run-at, topic, key, tenant, attempt, where it
    /// is stored (asks the schedulers' admin endpoints).
    Job {
        /// The job id.
        id: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Scheduler admin endpoints to ask (default: `[scheduler.admin] listen`).
        #[arg(long = "admin")]
        admin: Vec<std::net::SocketAddr>,
    },
    /// The dead-letter topic: list what is in it, replay dead jobs.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Keys held by workers (a failed job waiting for its retry on a
    /// `hold_key` topic, a long pacing wait): list them, release one.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Recurring schedules: define, list, pause, resume, delete.
    Schedules {
        #[command(subcommand)]
        command: crate::schedules_cmd::SchedulesCommand,
    },
    /// Cancel a pending job by id.
    Cancel {
        /// The job id printed by `enqueue`.
        id: JobId,
    },
    /// Move a pending job to a new run-at.
    Reschedule {
        /// The job id printed by `enqueue`.
        id: JobId,
        /// New run-at (RFC 3339, or epoch milliseconds).
        #[arg(long)]
        at: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum DlqCommand {
    /// List dead letters (oldest first per partition): reason, origin, job.
    List {
        #[command(flatten)]
        filter: DlqFilter,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write dead jobs back to their work topics (same id, key, payload and
    /// headers; attempt 1). At-least-once: replayed twice, they run twice
    /// unless the handler deduplicates on the job id.
    ///
    /// Without a filter it replays the dead letters written since the last
    /// such replay (a position kept per partition), so running it again
    /// replays only newer ones; `--again` starts from the beginning. With a
    /// filter it replays every dead letter that matches, each time.
    Replay {
        #[command(flatten)]
        filter: DlqFilter,
        /// Without a filter: replay from the topic's beginning, also what
        /// earlier replays wrote back.
        #[arg(long)]
        again: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub(crate) enum KeysCommand {
    /// List held keys, longest held first: the job holding each, its
    /// attempt, why, jobs parked behind it, how long.
    Blocked {
        /// Only keys of this work topic.
        #[arg(long)]
        topic: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Release a held key: the job holding it is dead-lettered, the key's
    /// other jobs run (the worker owning its partition acts on it).
    Release {
        /// The entity key.
        key: String,
        /// Its work topic (needed when it is held on several).
        #[arg(long)]
        topic: Option<String>,
    },
}

#[derive(clap::Args)]
pub(crate) struct DlqFilter {
    /// Only dead letters from this topic.
    #[arg(long)]
    pub(crate) topic: Option<String>,
    /// Only dead letters whose reason contains this text.
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// Only the job with this id (repeat for several).
    #[arg(long = "id")]
    pub(crate) ids: Vec<String>,
    /// Only dead letters written at or after this time (RFC 3339 or epoch ms).
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// Only dead letters written before this time (RFC 3339 or epoch ms).
    #[arg(long)]
    pub(crate) until: Option<String>,
}

impl TryFrom<DlqFilter> for kairos::dlq::Filter {
    type Error = anyhow::Error;
    fn try_from(f: DlqFilter) -> anyhow::Result<Self> {
        let time = |t: Option<String>, flag: &str| -> anyhow::Result<Option<i64>> {
            t.map(|t| {
                kairos::wire::parse_time(&t)
                    .map(|t| t.timestamp_millis())
                    .map_err(|p| anyhow::anyhow!("--{flag} {p}"))
            })
            .transpose()
        };
        Ok(kairos::dlq::Filter {
            origin_topic: f.topic,
            reason: f.reason,
            job_ids: f.ids,
            since_ms: time(f.since, "since")?,
            until_ms: time(f.until, "until")?,
        })
    }
}

#[derive(Subcommand)]
pub(crate) enum TopicsCommand {
    /// Create the schedule, changelog, dead-letter and work topics; safe to run twice.
    Init,
}
