//! Clients in other languages: jobs scheduled from Python's confluent-kafka
//! and from Java's kafka-clients, using only the documented headers, fire
//! on time, in order per key, into a Rust worker; a malformed one is
//! dead-lettered and a Python consumer reads the dead letter with its
//! reason; the kcat line of docs/producers.md schedules a job; and Kairos, Python,
//! Java and kcat put each key on the same partition; a transactional
//! producer's jobs fire once committed, never when aborted. The docs'
//! Python and Java examples are the code these tests run.

use std::collections::{HashMap, HashSet};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::system::{config, run, System};
use crate::common::{kafka, read_n, wait_for, Broker, Recorded, TransactionalWriter};
use chrono::Utc;
use kairos::worker::Outcome;
use kairos::{Job, JobId, Producer};
use rdkafka::Message as _;

const PYTHON: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/kairos_client.py");
const JAVA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/java/ScheduleJobs.java");

/// A client in another language.
#[derive(Clone, Copy, Debug)]
enum Client {
    Python,
    Java,
}

impl Client {
    /// Run the client with `args`; what it printed.
    fn run(self, args: &[&str]) -> String {
        let mut cmd = match self {
            Client::Python => {
                let mut c = Command::new("python3");
                c.arg(PYTHON);
                c
            }
            Client::Java => {
                // The JDK runs the source file as it is (single-file
                // programs); kafka-clients comes with the broker's jars.
                let mut c = Command::new("java");
                c.args(["-Dlog4j2.level=warn", "-cp", &kafka::kafka_classpath(), JAVA]);
                c
            }
        };
        let out = cmd
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("{self:?} (the test command installs it): {e}"));
        assert!(
            out.status.success(),
            "{self:?} client failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// A scheduler and a worker on `cfg` whose handler records each job it
/// runs, with when it started.
fn recording(cfg: &kairos::Config) -> (Recorded<(Job, chrono::DateTime<Utc>)>, System) {
    let runs: Recorded<(Job, chrono::DateTime<Utc>)> = Default::default();
    let r = runs.clone();
    let sys = run(cfg, true, move |job: Job, _ctx| {
        let r = r.clone();
        async move {
            r.lock().unwrap().push((job, Utc::now()));
            Outcome::done()
        }
    });
    (runs, sys)
}

/// Topics of the test's own (their first work topic returned), and a
/// scheduler and a recording worker on them (see [`recording`]); the store
/// lives in the directory returned.
async fn recording_set_up() -> (
    tempfile::TempDir,
    kairos::Config,
    String,
    Recorded<(Job, chrono::DateTime<Utc>)>,
    System,
) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(Broker::shared(), dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let (runs, sys) = recording(&cfg);
    (dir, cfg, work, runs, sys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_producer_schedules_jobs_for_a_rust_worker_and_reads_dead_letters() {
    foreign_jobs(Client::Python).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_producer_schedules_jobs_for_a_rust_worker() {
    foreign_jobs(Client::Java).await;
}

/// 60 jobs over 6 keys from `client`, due 2 s from now, each key's jobs 50
/// ms apart: each runs once, not early, in order per key, with its run-at
/// and tenant. Python also writes a malformed job and reads its dead letter.
async fn foreign_jobs(client: Client) {
    let (_dir, cfg, work, runs, sys) = recording_set_up().await;
    let (mode, tenant) = match client {
        Client::Python => ("produce", "python"),
        Client::Java => ("jobs", "java"),
    };
    let out = client.run(&[
        mode,
        &cfg.kafka.brokers,
        &cfg.topics.schedule,
        &work,
        "60",
        "6",
        "2000",
    ]);
    let mut expected: HashMap<String, (String, u32, i64)> = HashMap::new();
    let mut bad = None;
    for line in out.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["BAD", id] => bad = Some(id.to_string()),
            [id, key, seq, at] => {
                expected.insert(
                    id.to_string(),
                    (key.to_string(), seq.parse().unwrap(), at.parse().unwrap()),
                );
            }
            _ => panic!("unexpected line from {client:?}: {line}"),
        }
    }
    assert_eq!(expected.len(), 60);

    wait_for("60 jobs to run", Duration::from_secs(30), || {
        (runs.lock().unwrap().len() >= 60).then_some(())
    });
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 60, "each job ran once");
    let mut last_seq: HashMap<String, u32> = HashMap::new();
    for (job, started) in &runs {
        let (key, seq, at) = &expected[&job.id.to_string()];
        assert_eq!(job.key_lossy(), *key);
        assert_eq!(job.run_at.timestamp_millis(), *at);
        assert_eq!(job.tenant.as_deref(), Some(tenant));
        assert!(started.timestamp_millis() >= *at, "job {} started early", job.id);
        if let Some(prev) = last_seq.insert(key.clone(), *seq) {
            assert!(prev < *seq, "key {key}: seq {seq} ran after {prev}");
        }
    }

    if let Some(bad) = bad {
        let dead = Client::Python.run(&["dead", &cfg.kafka.brokers, &cfg.topics.dead_letter, "1"]);
        let line = dead.lines().next().unwrap();
        assert!(
            line.starts_with(&format!("DEAD {bad} header `kairos-run-at`")),
            "{line}"
        );
    }
    sys.stop().await;
}

/// The kcat command of docs/producers.md, on this test's broker and topics, with a
/// run-at two seconds ahead: the job runs then, its id derived from where
/// the record sits (it names none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_kcat_line_schedules_a_job() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let (runs, sys) = recording(&cfg);
    let at = kairos::job::truncate_to_millis(Utc::now() + chrono::Duration::seconds(2));
    let line = doc_block(PRODUCERS, "## With a command-line Kafka tool (kcat)", "sh")
        .replace("localhost:9092", &cfg.kafka.brokers)
        .replace("kairos.schedule", &cfg.topics.schedule)
        .replace("kairos.jobs", &cfg.topics.work[0])
        .replace(
            "2030-01-01T09:00:00Z",
            &at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        );
    let out = Command::new("sh")
        .args(["-c", &line])
        .output()
        .expect("kcat (the test command installs it)");
    assert!(
        out.status.success(),
        "{line}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("the job to run", Duration::from_secs(30), || {
        (!runs.lock().unwrap().is_empty()).then_some(())
    });
    sys.stop().await;
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 1);
    let (job, started) = &runs[0];
    assert_eq!(
        (job.key_lossy().as_ref(), job.payload.as_slice()),
        ("user-42", &b"reminder"[..])
    );
    assert_eq!(job.run_at, at);
    assert!(*started >= at, "ran early");
}

/// Kairos's producer, the Python and Java producers of docs/producers.md and its kcat
/// flags write 200 keys to a topic of 12 partitions: each key's four
/// records are on one partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kairos_python_java_and_kcat_put_a_key_on_the_same_partition() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    cfg.topics.work_partitions = 12;
    kairos::topics::init(&cfg).await.unwrap();
    let topic = cfg.topics.work[0].clone();
    let keys: Vec<String> = (0..200).map(|i| format!("entity-{i}")).collect();
    let producer = Producer::new(&cfg).unwrap();
    for k in &keys {
        producer
            .enqueue(Job::new(&topic, k.as_str(), b"x".to_vec()))
            .await
            .unwrap();
    }
    let mut args = vec!["keys", cfg.kafka.brokers.as_str(), topic.as_str()];
    args.extend(keys.iter().map(String::as_str));
    for client in [Client::Python, Client::Java] {
        let out = client.run(&args);
        assert_eq!(out.lines().count(), keys.len(), "{client:?}: {out}");
    }
    let input: String = keys.iter().map(|k| format!("{k}:x\n")).collect();
    let mut kcat = Command::new("kcat")
        .args(["-P", "-b", &cfg.kafka.brokers, "-t", &topic, "-K:"])
        .args(["-X", "partitioner=murmur2_random", "-H", "kairos-client=kcat"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("kcat (the test command installs it)");
    use std::io::Write as _;
    kcat.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    assert!(kcat.wait().unwrap().success());

    let records = read_n(
        &cfg.kafka.brokers,
        &topic,
        4 * keys.len(),
        Duration::from_secs(30),
    );
    let mut partitions: HashMap<Vec<u8>, HashSet<i32>> = HashMap::new();
    for m in &records {
        partitions
            .entry(m.key().unwrap().to_vec())
            .or_default()
            .insert(m.partition());
    }
    let split: Vec<_> = partitions.iter().filter(|(_, ps)| ps.len() > 1).collect();
    assert!(split.is_empty(), "keys on more than one partition: {split:?}");
    let used: HashSet<i32> = partitions.values().flatten().copied().collect();
    assert!(used.len() > 6, "200 keys spread over the partitions: {used:?}");
}

/// A producer that writes jobs inside Kafka transactions (a transactional
/// Java application, Kafka Streams with exactly-once): a job in a committed
/// transaction fires; one in an aborted transaction never does. The commit
/// marker is the partition's last offset and is never delivered to a
/// consumer: the scheduler must count the partition as read past it, or
/// the job waits for its partition to be read up to its run-at forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_written_in_kafka_transactions_fire_once_committed_and_never_when_aborted() {
    let (_dir, cfg, work, runs, sys) = recording_set_up().await;
    let writer = TransactionalWriter::new(&cfg.kafka.brokers, "txn-app");
    // Both on partition 0, the aborted one first, one key. Had it been
    // read, it would run before the committed one.
    let due = Utc::now() + chrono::Duration::milliseconds(1500);
    let aborted = Job::new(&work, "txn", b"aborted".to_vec()).at(due);
    let committed = Job::new(&work, "txn", b"committed".to_vec()).at(due);
    for (job, commit) in [(&aborted, false), (&committed, true)] {
        let rec = kairos::wire::encode(job, &cfg.topics.schedule);
        writer.write(&rec, 0, commit).await;
    }
    wait_for("the committed job to run", Duration::from_secs(30), || {
        runs.lock()
            .unwrap()
            .iter()
            .any(|(j, _)| j.id == committed.id)
            .then_some(())
    });
    let ran: Vec<(kairos::JobId, bool)> = runs
        .lock()
        .unwrap()
        .iter()
        .map(|(j, started)| (j.id, started.timestamp_millis() >= due.timestamp_millis()))
        .collect();
    assert_eq!(
        ran,
        vec![(committed.id, true)],
        "only the committed job ran, not early"
    );
    sys.stop().await;
}

/// The Python and Java examples of the docs are the marked parts of the
/// clients the tests run.
#[test]
fn the_docs_show_the_python_and_java_code_the_tests_run() {
    for (file, marker, doc, heading, lang) in [
        (
            PYTHON,
            "README",
            PRODUCERS,
            "## Scheduling a job from Python",
            "python",
        ),
        (
            PYTHON,
            "README-schedules",
            SCHEDULES,
            "# Recurring schedules",
            "python",
        ),
        (JAVA, "README", PRODUCERS, "## Scheduling a job from Java", "java"),
    ] {
        let source = std::fs::read_to_string(file).unwrap();
        let lines: Vec<&str> = source
            .lines()
            .skip_while(|l| !l.contains(&format!("{marker}:begin")))
            .skip(1)
            .take_while(|l| !l.contains(&format!("{marker}:end")))
            .collect();
        // As the docs show it: without the indentation it has in its class.
        let indent = lines
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.len() - l.trim_start().len())
            .min()
            .unwrap_or(0);
        let marked: String = lines
            .iter()
            .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
            .collect();
        assert!(marked.lines().count() > 5, "{file} marks its part of the docs");
        let block = doc_block(doc, heading, lang);
        assert!(
            block.contains(marked.trim_matches('\n')),
            "the {lang} example under {heading:?} in {doc} is not the marked part of {file}"
        );
    }
}

/// Where the docs show other Kafka clients writing jobs.
const PRODUCERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/producers.md");
/// Where the docs show recurring schedules.
const SCHEDULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/recurring-schedules.md");

/// The first fenced `lang` block after the line `heading` in the markdown file `doc`.
fn doc_block(doc: &str, heading: &str, lang: &str) -> String {
    let text = std::fs::read_to_string(doc).unwrap();
    let at = text
        .find(&format!("\n{heading}\n"))
        .or_else(|| text.starts_with(&format!("{heading}\n")).then_some(0))
        .unwrap_or_else(|| panic!("{doc} has {heading:?}"));
    let after = &text[at..];
    let start = after.find(&format!("```{lang}\n")).expect("a code block") + lang.len() + 4;
    let end = after[start..].find("```").expect("the block's end");
    after[start..start + end].to_string()
}

/// A recurring schedule defined from Python (docs/recurring-schedules.md's `define`): its
/// occurrences fire once each, at their times, under the ids Python
/// computes with `occurrence_id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_defined_from_python_fires_under_the_ids_python_computes() {
    let crate::scheduler::SetUp {
        dir: _dir, cfg, work, ..
    } = crate::scheduler::set_up(|_| {}).await;
    let running = crate::scheduler::start(&cfg);
    crate::scheduler::wait_owned(&running, 3);
    let start_ms = (Utc::now().timestamp_millis() / 1000 + 3) * 1000;
    let out = Client::Python.run(&[
        "define",
        &cfg.kafka.brokers,
        &cfg.topics.schedules,
        "py-ticks",
        &work,
        &start_ms.to_string(),
        "3",
    ]);
    let ids: Vec<JobId> = out
        .lines()
        .filter_map(|l| l.strip_prefix("OCCURRENCE "))
        .map(|id| id.parse().unwrap())
        .collect();
    let nominal = |i: i64| chrono::DateTime::from_timestamp_millis(start_ms + i * 1000).unwrap();
    let rust: Vec<JobId> = (0..3)
        .map(|i| kairos::schedules::occurrence_id("py-ticks", nominal(i)))
        .collect();
    assert_eq!(ids, rust, "Python and Rust derive the same ids");
    let fired = wait_for("the occurrences to fire", Duration::from_secs(60), || {
        let jobs: Vec<Job> = crate::common::read_all(
            &cfg.kafka.brokers,
            &work,
            "read_committed",
            Duration::from_secs(30),
        )
        .iter()
        .filter_map(|m| {
            let view = kairos::wire::RecordView::from_message(m);
            kairos::wire::decode_job(&view, kairos::wire::Context::Work, &kairos::Limits::default()).ok()
        })
        .collect();
        ids.iter()
            .all(|id| jobs.iter().any(|j| j.id == *id))
            .then_some(jobs)
    });
    assert_eq!(fired.len(), 3, "each occurrence once: {fired:?}");
    for (i, id) in ids.iter().enumerate() {
        let j = fired.iter().find(|j| j.id == *id).unwrap();
        assert_eq!(
            (j.run_at, &j.payload[..]),
            (nominal(i as i64), &b"from python"[..])
        );
    }
    running.stop().await;
}
