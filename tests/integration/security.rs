//! Authentication through the librdkafka pass-through: the test broker
//! also listens with SASL_PLAINTEXT (mechanism PLAIN, one user). Configured
//! with `[kafka.client]` settings alone, a producer, the scheduler and a
//! worker schedule and run a job through it, and a wrong password fails at
//! first contact naming the cause. TLS is the same pass-through
//! (`security.protocol = "ssl"`, `ssl.ca.location`, ...) and has no test
//! here.

use std::process::Command;
use std::time::{Duration, Instant};

use kairos::worker::Outcome;
use kairos::{Job, Producer};

use crate::common::kafka::{SASL_PASSWORD, SASL_USER};
use crate::common::system::{config, run};
use crate::common::{wait_for, Broker};

/// `cfg`'s clients authenticate as `user` with `password` on the broker's
/// SASL listener.
fn sasl(cfg: &mut kairos::Config, brokers: &str, user: &str, password: &str) {
    cfg.kafka.brokers = brokers.to_string();
    for (k, v) in [
        ("security.protocol", "sasl_plaintext"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", user),
        ("sasl.password", password),
    ] {
        cfg.kafka.client.insert(k.into(), v.into());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_scheduled_and_runs_through_a_sasl_listener() {
    let broker = Broker::shared();
    let Some(listener) = broker.sasl_bootstrap() else {
        eprintln!(
            "left out: the cluster is not the test's own (KAIROS_TEST_BROKERS), no SASL listener known"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    sasl(&mut cfg, &listener, SASL_USER, SASL_PASSWORD);
    kairos::topics::init(&cfg).await.unwrap();
    let ran = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = ran.clone();
    let system = run(&cfg, true, move |job: Job, _ctx| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(job.id);
            Outcome::done()
        }
    });
    let producer = Producer::new(&cfg).unwrap();
    let id = producer
        .enqueue(Job::new(cfg.topics.work[0].as_str(), "user-1", "hello"))
        .after(Duration::from_secs(1))
        .await
        .unwrap();
    wait_for(
        "the job to run through the scheduler",
        Duration::from_secs(60),
        || ran.lock().unwrap().contains(&id).then_some(()),
    );
    system.stop().await;
}

#[test]
fn a_wrong_password_fails_at_first_contact_naming_the_cause() {
    let broker = Broker::shared();
    let Some(listener) = broker.sasl_bootstrap() else {
        eprintln!(
            "left out: the cluster is not the test's own (KAIROS_TEST_BROKERS), no SASL listener known"
        );
        return;
    };
    let t0 = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_kairos"))
        .args(["--brokers", &listener, "topics", "init"])
        .env("KAIROS_KAFKA__CLIENT__SECURITY_PROTOCOL", "sasl_plaintext")
        .env("KAIROS_KAFKA__CLIENT__SASL_MECHANISM", "PLAIN")
        .env("KAIROS_KAFKA__CLIENT__SASL_USERNAME", SASL_USER)
        .env("KAIROS_KAFKA__CLIENT__SASL_PASSWORD", "not-the-password")
        .env("KAIROS_LOG", "warn")
        .output()
        .expect("run kairos");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("cannot reach Kafka at {listener}")) && err.contains("Authentication failed"),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(15), "took {:?}", t0.elapsed());
}
