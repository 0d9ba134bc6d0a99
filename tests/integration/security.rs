//! TLS and SASL through the librdkafka pass-through: the test broker also
//! listens with TLS (a self-signed certificate for 127.0.0.1) and with
//! SASL_PLAINTEXT (mechanism PLAIN, one user). Configured with
//! `[kafka.client]` settings alone, a producer, the scheduler and a worker
//! schedule and run a job through each, and a client that does not trust
//! the certificate, or gives a wrong password, fails at first contact
//! naming the cause.

use std::process::Command;
use std::time::{Duration, Instant};

use kairos::worker::Outcome;
use kairos::{Job, Producer};

use crate::common::kafka::{SASL_PASSWORD, SASL_USER};
use crate::common::system::{config, run};
use crate::common::{wait_for, Broker};

/// `cfg`'s clients connect to `brokers` with `settings` (librdkafka's).
fn through(cfg: &mut kairos::Config, brokers: &str, settings: &[(&str, &str)]) {
    cfg.kafka.brokers = brokers.to_string();
    for (k, v) in settings {
        cfg.kafka.client.insert(k.to_string(), (*v).into());
    }
}

/// `cfg`'s clients authenticate as `user` with `password` on the broker's
/// SASL listener.
fn sasl(cfg: &mut kairos::Config, brokers: &str, user: &str, password: &str) {
    let settings = [
        ("security.protocol", "sasl_plaintext"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", user),
        ("sasl.password", password),
    ];
    through(cfg, brokers, &settings);
}

/// Schedule a job a second ahead on `cfg` and wait until a worker, with a
/// scheduler, runs it.
async fn a_job_runs(cfg: &kairos::Config) {
    kairos::topics::init(cfg).await.unwrap();
    let ran = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = ran.clone();
    let system = run(cfg, true, move |job: Job, _ctx| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(job.id);
            Outcome::done()
        }
    });
    let producer = Producer::new(cfg).unwrap();
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

/// `kairos topics init` on `brokers` with librdkafka `settings` given as
/// `KAIROS_KAFKA__CLIENT__...` variables: it fails, within 15 s, saying it
/// cannot reach the address and naming `cause`.
fn first_contact_fails(brokers: &str, settings: &[(&str, &str)], cause: &str) {
    let t0 = Instant::now();
    let mut c = Command::new(env!("CARGO_BIN_EXE_kairos"));
    c.args(["--brokers", brokers, "topics", "init"])
        .env("KAIROS_LOG", "warn");
    for (k, v) in settings {
        c.env(
            format!("KAIROS_KAFKA__CLIENT__{}", k.replace('.', "_").to_uppercase()),
            v,
        );
    }
    let out = c.output().expect("run kairos");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("cannot reach Kafka at {brokers}")) && err.contains(cause),
        "{err}"
    );
    assert!(t0.elapsed() < Duration::from_secs(15), "took {:?}", t0.elapsed());
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
    a_job_runs(&cfg).await;
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
    let settings = [
        ("security.protocol", "sasl_plaintext"),
        ("sasl.mechanism", "PLAIN"),
        ("sasl.username", SASL_USER),
        ("sasl.password", "not-the-password"),
    ];
    first_contact_fails(&listener, &settings, "Authentication failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_scheduled_and_runs_through_a_tls_listener() {
    let broker = Broker::shared();
    let Some((listener, ca)) = broker.tls() else {
        eprintln!("left out: the cluster is not the test's own (KAIROS_TEST_BROKERS), no TLS listener known");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(broker, dir.path());
    let ca = ca.to_string_lossy().into_owned();
    through(
        &mut cfg,
        &listener,
        &[("security.protocol", "ssl"), ("ssl.ca.location", &ca)],
    );
    a_job_runs(&cfg).await;
}

#[test]
fn a_certificate_not_trusted_fails_at_first_contact_naming_the_cause() {
    let broker = Broker::shared();
    let Some((listener, _)) = broker.tls() else {
        eprintln!("left out: the cluster is not the test's own (KAIROS_TEST_BROKERS), no TLS listener known");
        return;
    };
    // The system's CAs, which do not include the broker's certificate.
    first_contact_fails(
        &listener,
        &[("security.protocol", "ssl")],
        "certificate verify failed",
    );
}
