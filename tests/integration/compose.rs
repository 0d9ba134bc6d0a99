//! `docker-compose.yml` runs the Kafka the tests run: the same version as
//! the install script fetches, with the broker settings Kairos relies on.
//! (No Docker engine runs here; `scripts/test.sh` also checks that the
//! file parses with `docker-compose config`.)

use crate::common::kafka::KAFKA_VERSION;

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn compose_runs_the_kafka_version_and_settings_the_tests_run() {
    let compose = read("docker-compose.yml");
    let install = read("scripts/install-broker.sh");
    assert!(
        install.contains(&format!("\nVERSION={KAFKA_VERSION}\n")),
        "scripts/install-broker.sh fetches Kafka {KAFKA_VERSION}"
    );
    assert!(
        compose.contains(&format!("image: apache/kafka:{KAFKA_VERSION}\n")),
        "docker-compose.yml runs apache/kafka:{KAFKA_VERSION}"
    );
    for setting in [
        "KAFKA_PROCESS_ROLES: broker,controller",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE: \"false\"",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS: \"0\"",
        "KAFKA_LOG_DIRS: /var/lib/kafka/data",
        "kafka-data:/var/lib/kafka/data",
    ] {
        assert!(compose.contains(setting), "docker-compose.yml sets {setting}");
    }
    // The scheduler's volume is a directory the image gives its user.
    assert!(compose.contains("scheduler-data:/var/lib/kairos/scheduler"));
    assert!(
        read("Dockerfile").contains("mkdir -p /var/lib/kairos/scheduler && chown -R kairos /var/lib/kairos")
    );
}
