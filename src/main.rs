//! The `kairos` command: parses the command line, loads configuration,
//! starts tracing and calls into the library.
#![forbid(unsafe_code)]

use anyhow::{bail, Context as _};
use clap::Parser;
use kairos::config::{self, Config};
use kairos::{Job, Producer};

/// mimalloc, for the Rust side; with its `override` feature it also serves
/// librdkafka's mallocs. See BENCHMARKS.md ("allocator").
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod cli;
mod demo;
mod dev_broker;
mod example;
mod schedules_cmd;

use cli::{Cli, Command, DlqCommand, KeysCommand, TopicsCommand};

/// Resolves on SIGTERM or Ctrl-C.
async fn terminated() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn load(cli: &Cli) -> anyhow::Result<Config> {
    let mut cfg: Config = config::load(cli.config.as_deref())?;
    if let Some(b) = &cli.brokers {
        cfg.kafka.brokers = b.clone();
    }
    cfg.validate()?;
    Ok(cfg)
}

/// How long a command waits for the cluster's first answer before it says
/// why there is none.
const FIRST_CONTACT: std::time::Duration = std::time::Duration::from_secs(5);

/// Make sure the cluster answers before a command talks to it: a command
/// fails within seconds naming the address and the cause; a service says
/// what it waits for and tries again until it answers (or it is stopped).
async fn first_contact(cli: &Cli, cfg: &Config) -> anyhow::Result<()> {
    let service = match &cli.command {
        Command::Demo { .. } if cli.brokers.is_none() => return Ok(()),
        Command::Job { .. } => return Ok(()),
        Command::Scheduler | Command::Worker { .. } => true,
        _ => false,
    };
    loop {
        let kafka = cfg.kafka.clone();
        let reached =
            tokio::task::spawn_blocking(move || kairos::kafka::reach(&kafka, FIRST_CONTACT)).await?;
        match reached {
            Ok(()) => return Ok(()),
            Err(e) if service => {
                tracing::warn!(brokers = %e.brokers, cause = %e.cause, "waiting for Kafka: it does not answer yet; trying again");
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    _ = terminated() => anyhow::bail!("stopped while waiting for Kafka at {}", e.brokers),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn parse_time(text: &str) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    kairos::wire::parse_time(text).map_err(|p| anyhow::anyhow!("--at {p}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The demo prints its own story; its components' logs only on request.
    let default_level = if matches!(cli.command, Command::Demo { .. }) {
        "error"
    } else {
        "info"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KAIROS_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = load(&cli)?;
    first_contact(&cli, &cfg).await?;
    match cli.command {
        Command::Topics {
            command: TopicsCommand::Init,
        } => {
            let report = kairos::topics::init(&cfg).await?;
            for r in report {
                let what = match r.outcome {
                    kairos::topics::TopicOutcome::Created => "created",
                    kairos::topics::TopicOutcome::AlreadyExists => "exists ",
                };
                println!("{what}  {:<12} {} ({} partitions)", r.role, r.name, r.partitions);
            }
            if kairos::topics::schedule_has_append_time(&cfg).await == Some(false) {
                println!(
                    "warning  the schedule topic {} keeps its producers' record times (CreateTime): the \
                     scheduler does not trust them, and a due job waits for a look-up of its partition's \
                     end; set message.timestamp.type=LogAppendTime on it (new topics get it)",
                    cfg.topics.schedule
                );
            }
        }
        Command::Enqueue {
            topic,
            key,
            payload,
            at,
            after,
            tenant,
            max_attempts,
        } => {
            let producer = Producer::new(&cfg)?;
            let mut job = Job::new(topic, key, payload);
            job.tenant = tenant;
            job.max_attempts = max_attempts;
            let mut write = producer.enqueue(job);
            if let Some(at) = at {
                write = write.at(parse_time(&at)?);
            }
            if let Some(d) = after {
                write = write.after(d);
            }
            let id = write.await.context("enqueue")?;
            println!("{id}");
        }
        Command::Demo {
            jobs,
            keys,
            max_delay,
            json,
        } => {
            let opts = demo::DemoOptions {
                jobs,
                keys,
                max_delay,
            };
            let seen = demo::run(cfg, opts, cli.brokers.clone()).await?;
            if json {
                println!("{}", serde_json::to_string(&seen)?);
            }
        }
        Command::Scheduler => {
            let scheduler = kairos::scheduler::Scheduler::builder(&cfg).build()?;
            scheduler.run_until(terminated()).await?;
        }
        Command::Worker { events } => {
            let log = events.as_ref().map(example::EventLog::open).transpose()?;
            let worker = kairos::worker::Worker::builder(&cfg)
                .build(move |job, ctx| example::handle(job, ctx, log.clone()))?;
            worker.run_until(terminated()).await?;
        }
        Command::Stats {
            json,
            admin,
            by_topic,
            worker_admin,
        } => {
            let c = cfg.clone();
            let figures = tokio::task::spawn_blocking(move || kairos::overview::topics(&c)).await??;
            let c = cfg.clone();
            let addrs = kairos::overview::admin_addrs(cfg.scheduler.admin.listen, &admin);
            let workers = kairos::overview::admin_addrs(cfg.worker.admin.listen, &worker_admin);
            let (held, busy) = tokio::task::spawn_blocking(move || {
                (
                    kairos::overview::schedulers(&c, &addrs, by_topic),
                    kairos::overview::workers(&c, &workers),
                )
            })
            .await?;
            if json {
                let out = serde_json::json!({"topics": figures, "scheduler": held, "workers": busy});
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print!("{}", kairos::overview::text(&figures, &held, &busy));
            }
        }
        Command::Job { id, json, admin } => {
            let c = cfg.clone();
            let addrs = kairos::overview::admin_addrs(cfg.scheduler.admin.listen, &admin);
            let found =
                tokio::task::spawn_blocking(move || kairos::overview::find_job(&c, &addrs, &id)).await??;
            match found {
                Some(job) if json => println!("{}", serde_json::to_string_pretty(&job)?),
                Some(job) => {
                    for (k, v) in job.as_object().into_iter().flatten() {
                        println!("{k:<20} {}", v.as_str().map_or(v.to_string(), str::to_string));
                    }
                }
                None => {
                    anyhow::bail!("no pending job with this id (it ran, was cancelled, or never existed)")
                }
            }
        }
        Command::Dlq {
            command: DlqCommand::List { filter, json },
        } => {
            let filter: kairos::dlq::Filter = filter.try_into()?;
            let c = cfg.clone();
            let entries = tokio::task::spawn_blocking(move || kairos::dlq::list(&c, &filter)).await??;
            if json {
                println!("{}", serde_json::to_string_pretty(&entries)?);
            } else {
                println!(
                    "{:<9} {:<36} {:<12} {:>7}  {:<30} reason",
                    "partition", "job", "key", "attempt", "origin"
                );
                for e in &entries {
                    let origin = format!("{}[{}]@{}", e.origin_topic, e.origin_partition, e.origin_offset);
                    let job = e.job_id.clone().unwrap_or_else(|| "(not a job)".into());
                    let attempt = e.attempt.map_or("-".into(), |a| a.to_string());
                    let why = match &e.not_a_job {
                        Some(n) => format!("{} (not replayable: {n})", e.reason),
                        None => e.reason.clone(),
                    };
                    let key = e.key.clone().unwrap_or_default();
                    println!(
                        "{:<9} {job:<36} {key:<12} {attempt:>7}  {origin:<30} {why}",
                        format!("{}@{}", e.partition, e.offset)
                    );
                }
                eprintln!("{} dead letters", entries.len());
            }
        }
        Command::Dlq {
            command: DlqCommand::Replay { filter, again, json },
        } => {
            let filter: kairos::dlq::Filter = filter.try_into()?;
            let report = kairos::dlq::replay(&cfg, &filter, again, |done, of| {
                if done % 1000 == 0 {
                    eprintln!("replayed {done} of {of}");
                }
            })
            .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "{} dead letters matched: {} jobs replayed, {} not jobs (left alone)",
                    report.matched, report.replayed, report.not_jobs
                );
                if report.since_last_replay {
                    println!(
                        "read from where the last replay stopped ({} earlier dead letters not read); \
                         a second replay replays only what dies from now on; --again replays from the beginning",
                        report.earlier_not_read
                    );
                } else {
                    println!(
                        "filtered (or --again): every match was replayed; a second run replays them again \
                         (jobs run twice unless the handler deduplicates on the job id)"
                    );
                }
            }
        }
        Command::Keys {
            command: KeysCommand::Blocked { topic, json },
        } => {
            let c = cfg.clone();
            let held =
                tokio::task::spawn_blocking(move || kairos::keys::blocked(&c, topic.as_deref())).await??;
            if json {
                println!("{}", serde_json::to_string_pretty(&held)?);
            } else {
                print!("{}", kairos::keys::text(&held));
            }
        }
        Command::Keys {
            command: KeysCommand::Release { key, topic },
        } => {
            let h = kairos::keys::release(&cfg, &key, topic.as_deref()).await?;
            println!(
                "release of `{}` on {} (partition {}, held by job {}) written; the worker that owns the \
                 partition dead-letters that job and lets the key's other jobs run",
                h.key,
                h.topic,
                h.partition,
                h.job_id.as_deref().unwrap_or("-")
            );
        }
        Command::Schedules { command } => schedules_cmd::run(&cfg, command).await?,
        Command::Cancel { id } => {
            Producer::new(&cfg)?.cancel(id).await.context("cancel")?;
            println!("cancel of {id} written");
        }
        Command::Reschedule { id, at } => {
            let at = parse_time(&at)?;
            if at.timestamp_millis() < 0 {
                bail!("--at must be after 1970");
            }
            Producer::new(&cfg)?
                .reschedule(id, at)
                .await
                .context("reschedule")?;
            println!("reschedule of {id} to {} written", kairos::wire::format_time(at));
        }
    }
    Ok(())
}
