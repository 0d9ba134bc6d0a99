//! Clients in other languages: jobs scheduled from Python's confluent-kafka
//! using only the documented headers fire on time, in order per key, into a
//! Rust worker; a malformed one is dead-lettered and a Python consumer reads
//! the dead letter with its reason.

use std::collections::HashMap;
use std::process::Command;
use std::time::Duration;

use crate::common::system::{config, run};
use crate::common::{wait_for, Broker};
use chrono::Utc;
use kairos::worker::Outcome;
use kairos::Job;

fn python(args: &[&str]) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/kairos_client.py");
    let out = Command::new("python3")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 (the test command installs confluent-kafka)");
    assert!(
        out.status.success(),
        "python client failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_producer_schedules_jobs_for_a_rust_worker_and_reads_dead_letters() {
    let broker = Broker::shared();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(broker, dir.path());
    kairos::topics::init(&cfg).await.unwrap();
    let work = cfg.topics.work[0].clone();
    let runs: crate::common::Recorded<(Job, chrono::DateTime<Utc>)> = Default::default();
    let r = runs.clone();
    let sys = run(&cfg, true, move |job: Job, _ctx| {
        let r = r.clone();
        async move {
            r.lock().unwrap().push((job, Utc::now()));
            Outcome::done()
        }
    });

    // 60 jobs over 6 keys, due 2 s from now, each key's jobs 50 ms apart.
    let out = python(&[
        "produce",
        &cfg.kafka.brokers,
        &cfg.topics.schedule,
        &work,
        "60",
        "6",
        "2000",
    ]);
    let mut expected: HashMap<String, (String, u32, i64)> = HashMap::new();
    let mut bad = String::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        match f.as_slice() {
            ["BAD", id] => bad = id.to_string(),
            [id, key, seq, at] => {
                expected.insert(
                    id.to_string(),
                    (key.to_string(), seq.parse().unwrap(), at.parse().unwrap()),
                );
            }
            _ => panic!("unexpected line from python: {line}"),
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
        assert_eq!(job.tenant.as_deref(), Some("python"));
        assert!(started.timestamp_millis() >= *at, "job {} started early", job.id);
        if let Some(prev) = last_seq.insert(key.clone(), *seq) {
            assert!(prev < *seq, "key {key}: seq {seq} ran after {prev}");
        }
    }

    let dead = python(&["dead", &cfg.kafka.brokers, &cfg.topics.dead_letter, "1"]);
    let line = dead.lines().next().unwrap();
    assert!(
        line.starts_with(&format!("DEAD {bad} header `kairos-run-at`")),
        "{line}"
    );
    sys.stop().await;
}
