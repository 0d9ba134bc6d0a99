//! First contact with a cluster that is not there: the `kairos` binary,
//! pointed at a closed port or a name that does not resolve, says within
//! seconds what is wrong, naming the address and the cause; a service says
//! what it is waiting for while it tries again. No broker is needed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A local port nothing listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn kairos(brokers: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kairos"));
    c.arg("--brokers").arg(brokers).args(args);
    c.env("RUST_BACKTRACE", "0").env("KAIROS_LOG", "warn");
    c
}

#[test]
fn a_command_says_within_seconds_which_address_failed_and_why() {
    let refused = format!("127.0.0.1:{}", closed_port());
    for (brokers, cause) in [
        (refused.as_str(), "Connection refused"),
        ("kairos-no-such-host.invalid:9092", "Failed to resolve"),
    ] {
        for args in [&["topics", "init"][..], &["stats"], &["dlq", "list"]] {
            let t0 = Instant::now();
            let out = kairos(brokers, args).output().expect("run kairos");
            let took = t0.elapsed();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{args:?} on {brokers}: {err}");
            assert!(
                err.contains(&format!("cannot reach Kafka at {brokers}")) && err.contains(cause),
                "{args:?} on {brokers}: {err}"
            );
            assert!(
                took < Duration::from_secs(10),
                "{args:?} on {brokers} took {took:?}"
            );
        }
    }
}

#[test]
fn a_service_says_what_it_waits_for_while_the_cluster_does_not_answer() {
    let brokers = format!("127.0.0.1:{}", closed_port());
    let dir = tempfile::tempdir().unwrap();
    let mut child = kairos(&brokers, &["scheduler"])
        .env("KAIROS_SCHEDULER__DATA_DIR", dir.path())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kairos scheduler");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut seen = Vec::new();
    let mut waits = 0;
    while waits < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            break;
        };
        if line.contains("waiting for Kafka")
            && line.contains(&brokers)
            && line.contains("Connection refused")
        {
            waits += 1;
        }
        seen.push(line);
    }
    let still_running = child.try_wait().unwrap().is_none();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        waits, 2,
        "two warnings naming the address and the cause within 15 s: {seen:#?}"
    );
    assert!(still_running, "the service keeps waiting: {seen:#?}");
}
