//! The scheduler's dashboard in a real browser: headless Chromium (driven
//! over the DevTools protocol by `tests/browser/dashboard.py`) loads the
//! page from a running scheduler, the numbers it shows are checked against
//! `/status` and `/dlq`, its replay button is clicked and the replayed jobs
//! run; a screenshot is saved (its path is printed). A dead letter's key and
//! reason are a producer's: the test's carry markup and script, and the page
//! shows them as text and runs none of it; so are a recurring schedule's id
//! and pause note, shown with the schedule's next occurrence as
//! `/schedules` gives it. The endpoint has a token, and a replay without
//! it, or without the action header, is refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::system::{config, enqueue_all};
use crate::common::{wait_for, Broker};
use chrono::Utc;
use kairos::admin::get;
use kairos::config::AdminConfig;
use kairos::scheduler::Scheduler;
use kairos::schedules::{JobTemplate, Schedule, Schedules};
use kairos::worker::Outcome;
use kairos::{Job, Producer, Worker};
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(60);
const TOKEN: &str = "s3cret-admin-token";
/// A key and a dead reason that would run script if the page parsed them.
const HOSTILE_KEY: &str = r#"doomed-<img src=x onerror="document.body.dataset.pwned='key'">"#;
const HOSTILE_REASON: &str = r#"not yet <script>document.body.dataset.pwned='script'</script><img src=y onerror="document.body.dataset.pwned='reason'">"#;
/// A schedule id and a pause note, likewise.
const HOSTILE_SCHEDULE: &str = r#"report-<img src=z onerror="document.body.dataset.pwned='schedule'">"#;
const HOSTILE_NOTE: &str = r#"<b onmouseover="document.body.dataset.pwned='note'">until Monday</b>"#;

fn status(addr: std::net::SocketAddr, path: &str) -> serde_json::Value {
    let (code, body) = get(addr, path, Some(TOKEN)).expect("GET");
    assert_eq!(code, 200, "{path}: {body}");
    serde_json::from_str(&body).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_what_the_scheduler_holds_and_its_replay_button_brings_dead_jobs_back() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.scheduler.admin = AdminConfig {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        token: Some(TOKEN.into()),
    };
    kairos::topics::init(&cfg).await.unwrap();
    let stop = CancellationToken::new();
    let scheduler = Scheduler::builder(&cfg).build().unwrap();
    let addr = scheduler.admin_addr().expect("endpoint bound");
    let sched = scheduler.handle();
    // Jobs keyed `doomed-*` die at their only attempt until healed.
    let healed = Arc::new(AtomicBool::new(false));
    let h = healed.clone();
    let worker = Worker::builder(&cfg)
        .build(move |job: Job, _ctx| {
            let dies = job.key.starts_with(b"doomed") && !h.load(Ordering::SeqCst);
            async move {
                if dies {
                    Outcome::dead(HOSTILE_REASON)
                } else {
                    Outcome::done()
                }
            }
        })
        .unwrap();
    let wh = worker.handle();
    let st = stop.clone();
    let s_task = tokio::spawn(scheduler.run_until(async move { st.cancelled().await }));
    let st = stop.clone();
    let w_task = tokio::spawn(worker.run_until(async move { st.cancelled().await }));
    wait_for("the scheduler to be ready", T, || {
        (get(addr, "/readyz", Some(TOKEN)).ok()? == (200, "ready\n".into())).then_some(())
    });

    let work = cfg.topics.work[0].clone();
    let producer = Producer::new(&cfg).unwrap();
    let now = Utc::now();
    let mut jobs: Vec<Job> = (1..4)
        .map(|i| Job::new(&work, format!("doomed-{i}"), b"x".to_vec()))
        .collect();
    jobs.push(Job::new(&work, HOSTILE_KEY, b"x".to_vec()));
    for (mins, n) in [(135, 6), (315, 3)] {
        for i in 0..n {
            jobs.push(
                Job::new(&work, format!("later-{mins}-{i}"), b"x".to_vec())
                    .at(now + chrono::Duration::minutes(mins)),
            );
        }
    }
    enqueue_all(&producer, jobs).await;
    wait_for("4 dead letters and 9 jobs waiting", T, || {
        let d = status(addr, "/dlq");
        (d["total"] == 4 && sched.stats().pending == 9).then_some(())
    });
    healed.store(true, Ordering::SeqCst);
    // Two recurring schedules: one paused with a note, one starting
    // tomorrow (so none of its occurrences comes during the test).
    let schedules = Schedules::new(&cfg).unwrap();
    let start = now + chrono::Duration::days(1);
    let mut hourly = Schedule::every(
        "hourly",
        Duration::from_secs(3600),
        JobTemplate::new(&work, "tick"),
    );
    hourly.start = Some(start);
    schedules.upsert(&hourly).await.unwrap();
    let mut paused = Schedule::cron(
        HOSTILE_SCHEDULE,
        "0 0 9 * * MON",
        JobTemplate::new(&work, "report"),
    );
    paused.time_zone = "Europe/Paris".into();
    paused.paused = true;
    paused.note = Some(HOSTILE_NOTE.into());
    schedules.upsert(&paused).await.unwrap();
    let listed = wait_for("/schedules to show both", T, || {
        let s = status(addr, "/schedules");
        (s["shown"] == 2).then_some(s)
    });

    // The admin surface: a replay needs the token and the action header,
    // on loopback too; the page is sent with its content policy.
    let replay = |headers: &[(&str, &str)]| request(addr, "POST", "/dlq/replay", headers).0;
    assert_eq!(replay(&[("x-kairos-action", "replay")]), 401, "no token");
    let bearer = format!("Bearer {TOKEN}");
    assert_eq!(replay(&[("authorization", &bearer)]), 400, "no action header");
    assert_eq!(
        status(addr, "/dlq")["total"],
        4,
        "nothing replayed by a refused request"
    );
    let (code, head, _) = request(addr, "GET", "/", &[]);
    assert_eq!(code, 200, "the page loads without the token (it holds no data)");
    assert!(
        head.to_ascii_lowercase().contains(
            &format!(
                "content-security-policy: {}",
                kairos::admin::CONTENT_SECURITY_POLICY
            )
            .to_ascii_lowercase()
        ),
        "{head}"
    );
    assert_eq!(request(addr, "GET", "/dlq", &[]).0, 401, "data needs the token");

    let shot = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/browser/dashboard.py");
    let url = format!("http://{addr}/#token={TOKEN}");
    let s = shot.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .arg(&url)
            .arg(&s)
            .output()
    })
    .await
    .unwrap()
    .expect("run python3");
    assert!(
        out.status.success(),
        "the browser run failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    let st = status(addr, "/status");
    assert_eq!(
        shown["pending"], st["stats"]["pending"],
        "shown {shown}, status {st}"
    );
    assert_eq!(shown["pending"], 9);
    assert_eq!(shown["due_now"], st["pending_by_due"]["now"]);
    assert_eq!(shown["dead"], 4, "{shown}");
    assert_eq!(shown["dead_rows"], 4, "{shown}");
    // The hostile key and reason are shown as the text they are, and
    // nothing in them ran or became an element.
    let cells: Vec<Vec<String>> = serde_json::from_value(shown["dead_cells"].clone()).unwrap();
    assert!(
        cells
            .iter()
            .any(|row| row[1] == HOSTILE_KEY && row[4].contains(HOSTILE_REASON)),
        "the key and reason as text: {cells:?}"
    );
    assert_eq!(shown["elements_in_rows"], 0, "{shown}");
    assert_eq!(shown["images"], 0, "{shown}");
    assert_eq!(
        shown["pwned"],
        serde_json::Value::Null,
        "script from a dead letter ran: {shown}"
    );
    // The schedules as /schedules gives them, the hostile ones as text.
    let rows: Vec<Vec<String>> = serde_json::from_value(shown["schedule_cells"].clone()).unwrap();
    let row = |id: &str| rows.iter().find(|r| r[0] == id).cloned();
    let hourly_row = row("hourly").unwrap_or_else(|| panic!("hourly shown: {rows:?}"));
    let hourly_next = listed["schedules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == "hourly")
        .map(|s| s["next"].as_str().unwrap().to_string())
        .unwrap();
    assert_eq!(
        hourly_next
            .parse::<chrono::DateTime<Utc>>()
            .unwrap()
            .timestamp_millis(),
        start.timestamp_millis(),
        "its first occurrence is its start"
    );
    assert_eq!(
        hourly_row[1..4],
        ["every 1h".to_string(), hourly_next, "–".into()]
    );
    let paused_row = row(HOSTILE_SCHEDULE).unwrap_or_else(|| panic!("the paused schedule as text: {rows:?}"));
    assert_eq!(paused_row[1], "cron 0 0 9 * * MON (Europe/Paris)");
    assert_eq!(paused_row[2], "–", "a paused schedule has no next occurrence");
    assert_eq!(paused_row[6], format!("paused: {HOSTILE_NOTE}"));
    assert_eq!(shown["elements_in_schedule_rows"], 0, "{shown}");
    let bars: Vec<u64> = serde_json::from_value(shown["bars"].clone()).unwrap();
    let timeline: Vec<u64> = serde_json::from_value(st["due_timeline"]["jobs"].clone()).unwrap();
    assert_eq!(bars.len(), 24, "{shown}");
    assert_eq!(bars[..], timeline[..24], "the bars are /status's timeline");
    assert_eq!(bars.iter().sum::<u64>(), 9, "all 9 come due within 12 hours");
    assert_eq!(shown["replayed"], 4, "{shown}");
    // The replayed jobs run again (healed now) and succeed.
    wait_for("the 4 replayed jobs to succeed", T, || {
        (wh.stats().succeeded >= 4).then_some(())
    });
    let png = std::fs::read(&shot).expect("screenshot saved");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "a PNG screenshot"
    );
    println!("dashboard screenshot: {}", shot.display());
    stop.cancel();
    s_task.await.unwrap().unwrap();
    w_task.await.unwrap().unwrap();
}

/// One request with `headers`: the status code, the response head and the
/// body (HTTP/1.1, one request per connection).
fn request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n{extra}\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read the answer");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    (code, head.to_string(), body.to_string())
}
