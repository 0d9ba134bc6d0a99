//! The demo's recurring schedule: a cron pattern with seconds, in a time
//! zone, for three occurrences; each fires once, under the id derived from
//! the schedule and its time. Its job takes longer than the pattern's
//! second and the schedule skips an occurrence that comes while the one
//! before still runs (`overlap = "skip"`).

use std::net::SocketAddr;
use std::time::Duration;

use chrono::{DurationRound as _, Utc};
use rdkafka::Message as _;

use super::{failed, DemoError};
use kairos::schedules::{occurrence_id, JobTemplate, Overlap, Schedule, Schedules};
use kairos::worker::WorkerHandle;
use kairos::{Config, JobId};

/// Occurrences the demo's schedule has.
const OCCURRENCES: i64 = 3;

/// How long the schedule's job takes: longer than the second between
/// occurrences, so the next one comes while it runs.
const WORK_MS: u64 = 2500;

/// What the recurring part saw: occurrences due, fired once, fired more
/// than once (must be 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RecurringSeen {
    /// Occurrences the schedule had.
    pub occurrences: usize,
    /// Of those, fired exactly once.
    pub once: usize,
    /// Fires beyond the first of an occurrence (must be 0).
    pub extra: usize,
    /// The scheduler's `/schedules` listed the schedule with its last
    /// occurrence (its cursor) at the final one.
    pub listed: bool,
    /// Occurrences the worker skipped because the one before still ran.
    pub skipped: u64,
}

/// Define a schedule firing every second for [`OCCURRENCES`] seconds into
/// `topic` (run by `worker`), wait for its occurrences, delete it.
pub(super) async fn show(
    cfg: &Config,
    topic: &str,
    admin: Option<SocketAddr>,
    worker: &WorkerHandle,
) -> Result<RecurringSeen, DemoError> {
    let schedules = Schedules::new(cfg).map_err(failed)?;
    let start = Utc::now()
        .duration_trunc(chrono::Duration::seconds(1))
        .map_err(failed)?
        + chrono::Duration::seconds(3);
    let mut s = Schedule::cron(
        "demo-report",
        "* * * * * *",
        JobTemplate::new(topic, format!("build the report work={WORK_MS}")),
    );
    s.time_zone = "Europe/Berlin".into();
    s.overlap = Overlap::Skip;
    let skipped_before = worker.stats().skipped;
    s.start = Some(start);
    s.end = Some(start + chrono::Duration::seconds(OCCURRENCES - 1));
    println!(
        "\nrecurring     schedule `{}` (cron `{}` in {}) from {} to {}: each occurrence a job on {topic}\n              \
         with the id derived from the schedule and its time, enqueued {} ahead; each takes {} ms,\n              \
         and an occurrence that comes while the one before runs is skipped (overlap = \"skip\")",
        s.id,
        s.cron.as_deref().unwrap_or_default(),
        s.time_zone,
        berlin(start),
        berlin(start + chrono::Duration::seconds(OCCURRENCES - 1)),
        humantime::format_duration(cfg.scheduler.schedules_lead),
        WORK_MS
    );
    schedules.upsert(&s).await.map_err(failed)?;
    let want: Vec<(chrono::DateTime<Utc>, JobId)> = (0..OCCURRENCES)
        .map(|i| {
            let at = start + chrono::Duration::seconds(i);
            (at, occurrence_id(&s.id, at))
        })
        .collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let fires = loop {
        let fires = read_back(cfg, topic).await?;
        let all = want.iter().all(|(_, id)| fires.iter().any(|(f, _)| f == id));
        if all || tokio::time::Instant::now() > deadline {
            break fires;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut seen = RecurringSeen {
        occurrences: want.len(),
        ..Default::default()
    };
    for (at, id) in &want {
        let copies: Vec<i64> = fires.iter().filter(|(f, _)| f == id).map(|(_, t)| *t).collect();
        if copies.len() == 1 {
            seen.once += 1;
        }
        seen.extra += copies.len().saturating_sub(1);
        let late = copies.first().map_or("not fired".to_string(), |t| {
            format!("fired {} ms after its time", t - at.timestamp_millis())
        });
        println!("              {}  job {id}  {late}", berlin(*at));
    }
    if let Some(addr) = admin {
        let (_, body) = tokio::task::spawn_blocking(move || kairos::admin::get(addr, "/schedules", None))
            .await
            .map_err(failed)?
            .map_err(failed)?;
        let listed: serde_json::Value = serde_json::from_str(&body).map_err(failed)?;
        if let Some(row) = listed["schedules"]
            .as_array()
            .and_then(|rows| rows.iter().find(|r| r["id"] == s.id.as_str()))
        {
            let last = row["last"].as_str().unwrap_or("-");
            println!(
                "              the scheduler's /schedules: last occurrence {last}, late {}, dropped {}",
                row["late"], row["dropped"]
            );
            seen.listed = last.parse::<chrono::DateTime<Utc>>().ok() == want.last().map(|(at, _)| *at);
        }
    }
    // The worker reads each occurrence as it fires; one that came while
    // the one before ran is skipped as it is read.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while worker.stats().skipped == skipped_before && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen.skipped = worker.stats().skipped - skipped_before;
    schedules.delete(&s.id).await.map_err(failed)?;
    println!(
        "              {} of {} occurrences fired once, {} more than once; {} skipped by the worker while the one \
         before ran; schedule deleted",
        seen.once, seen.occurrences, seen.extra, seen.skipped
    );
    Ok(seen)
}

fn berlin(t: chrono::DateTime<Utc>) -> String {
    t.with_timezone(&chrono_tz::Europe::Berlin)
        .format("%H:%M:%S %Z")
        .to_string()
}

/// Every job id on `topic` with its record's time.
async fn read_back(cfg: &Config, topic: &str) -> Result<Vec<(JobId, i64)>, DemoError> {
    let (kafka, topic) = (cfg.kafka.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        kairos::kafka::read_to_end(
            &kafka,
            "kairos-demo-recurring",
            &topic,
            None,
            Duration::from_secs(10),
            |m| {
                let view = kairos::wire::RecordView::from_message(m);
                if let Ok(kairos::wire::Command::Schedule(job)) =
                    kairos::wire::decode(&view, kairos::wire::Context::Work, &kairos::Limits::default())
                {
                    out.push((job.id, m.timestamp().to_millis().unwrap_or(0)));
                }
            },
        )
        .map(|()| out)
    })
    .await
    .map_err(failed)?
    .map_err(failed)
}
