//! What the demo shows an operator: the jobs the scheduler holds (`kairos
//! stats`, `kairos job ID`) while they wait, and after the run the metrics a
//! Prometheus would scrape, the dead letters and the topics' figures.

use std::net::SocketAddr;
use std::time::Duration;

use super::{failed, DemoError};
use kairos::config::Config;
use kairos::scheduler::SchedulerHandle;
use kairos::JobId;

/// Once the scheduler holds about `delayed` jobs (or after 5 s), print them
/// by when they come due, and one of them by id.
pub(super) async fn held(
    cfg: &Config,
    sched: &SchedulerHandle,
    addr: SocketAddr,
    delayed: usize,
    example: JobId,
) -> Result<(), DemoError> {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while (sched.stats().pending as usize) < delayed * 9 / 10 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = cfg.clone();
    let (held, job) = tokio::task::spawn_blocking(move || {
        let held = kairos::overview::schedulers(&c, &[addr], false);
        let job = kairos::overview::find_job(&c, &[addr], &example.to_string());
        (held, job)
    })
    .await
    .map_err(failed)?;
    let spans: Vec<String> = kairos::overview::DUE_SPANS
        .iter()
        .map(|d| format!("{} {d}", held.pending_by_due.get(*d).copied().unwrap_or(0)))
        .collect();
    println!(
        "held       the scheduler holds {} jobs, due: {} (kairos stats)",
        held.pending,
        spans.join(", ")
    );
    if let Ok(Some(j)) = job {
        println!(
            "           job {} (kairos job ID): key {}, run-at {}, attempt {}, schedule partition {}\n",
            j["id"].as_str().unwrap_or("-"),
            j["key"].as_str().unwrap_or("-"),
            j["run_at"].as_str().unwrap_or("-"),
            j["attempt"],
            j["schedule_partition"]
        );
    }
    Ok(())
}

/// After the run: a scrape of both endpoints, the dead letters, the topics.
pub(super) async fn after_run(
    cfg: &Config,
    sched_admin: Option<SocketAddr>,
    worker_admin: Option<SocketAddr>,
) -> Result<(), DemoError> {
    // What an operator's Prometheus would scrape now.
    let scraped = [
        (sched_admin, "kairos_scheduler_"),
        (worker_admin, "kairos_worker_"),
    ];
    for (addr, prefix) in scraped {
        let Some(addr) = addr else { continue };
        let (_, text) = tokio::task::spawn_blocking(move || kairos::admin::get(addr, "/metrics", None))
            .await
            .map_err(failed)?
            .map_err(failed)?;
        let wanted = [
            "fired_total",
            "cancelled_total",
            "fire_lateness_seconds_count",
            "started_total",
            "succeeded_total",
            "retried_total",
            "dead_lettered_total",
            "start_delay_seconds_sum",
        ];
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| {
                l.strip_prefix(prefix)
                    .is_some_and(|r| wanted.iter().any(|w| r.starts_with(w)))
            })
            .collect();
        println!("metrics    {}", lines.join("\n           "));
    }
    // What `kairos dlq list` shows an operator now.
    let c = cfg.clone();
    let dead = tokio::task::spawn_blocking(move || kairos::dlq::list(&c, &kairos::dlq::Filter::default()))
        .await
        .map_err(failed)?
        .map_err(failed)?;
    if let Some(first) = dead.first() {
        println!(
            "dead       {} in {} (kairos dlq list / kairos dlq replay), e.g. job {} key {}: {}",
            dead.len(),
            cfg.topics.dead_letter,
            first.job_id.as_deref().unwrap_or("-"),
            first.key.as_deref().unwrap_or("-"),
            first.reason
        );
    }
    // And what `kairos stats` shows.
    let c = cfg.clone();
    let figures = tokio::task::spawn_blocking(move || kairos::overview::topics(&c))
        .await
        .map_err(failed)?
        .map_err(failed)?;
    for f in figures {
        let lag = f.lag.map_or(String::new(), |l| format!(", {l} behind its group"));
        println!(
            "stats      {} {}: {} records{lag} (kairos stats)",
            f.role, f.topic, f.records
        );
    }
    Ok(())
}
