use std::path::Path;

use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn empty_file_gives_defaults() {
    let c: Config = load_from("t", "", env(&[])).unwrap();
    assert_eq!(c, Config::default());
    c.validate().unwrap();
}

#[test]
fn shipped_files_parse_and_validate() {
    for file in ["config/scheduler.toml", "config/worker.toml"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let c: toml::Table = text.parse().unwrap();
        // The file's common sections must load as Config.
        let cfg: Config = load_from(file, &c.to_string(), env(&[])).unwrap();
        cfg.validate().unwrap();
    }
}

#[test]
fn unknown_keys_are_named() {
    let err = load_from::<Config>("t", "[kafka]\nbrokerz = \"x\"\n", env(&[])).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("brokerz"), "{text}");
    let err = load_from::<Config>("t", "[kafak]\n", env(&[])).unwrap_err();
    assert!(err.to_string().contains("kafak"), "{err}");
}

#[test]
fn wrong_types_name_the_key() {
    let err = load_from::<Config>("t", "[topics]\nschedule_partitions = \"six\"\n", env(&[])).unwrap_err();
    match err {
        ConfigError::Key { key, .. } => assert_eq!(key, "topics.schedule_partitions"),
        other => panic!("{other}"),
    }
}

#[test]
fn syntax_errors_are_reported_with_the_file() {
    let err = load_from::<Config>("my.toml", "[kafka\n", env(&[])).unwrap_err();
    assert!(
        matches!(err, ConfigError::Syntax { ref path, .. } if path == "my.toml"),
        "{err}"
    );
}

#[test]
fn environment_overrides_file_and_defaults() {
    let c: Config = load_from(
        "t",
        "[kafka]\nbrokers = \"file:9092\"\n[kafka.client]\n\"socket.timeout.ms\" = 1000\n",
        env(&[
            ("KAIROS_KAFKA__BROKERS", "env:9092"),
            ("KAIROS_KAFKA__CLIENT__SASL_PASSWORD", "s3cret"),
            ("KAIROS_KAFKA__PRODUCER__COMPRESSION_TYPE", "zstd"),
            ("KAIROS_TOPICS__SCHEDULE_PARTITIONS", "12"),
            ("KAIROS_TOPICS__WORK", "a, b"),
            ("KAIROS_LIMITS__ALLOW_EMPTY_PAYLOAD", "true"),
            ("KAIROS_KAFKA__PRODUCE_TIMEOUT", "5s"),
            ("KAIROS_CONFIG", "ignored: no double underscore"),
            ("OTHER__THING", "ignored: no prefix"),
        ]),
    )
    .unwrap();
    assert_eq!(c.kafka.brokers, "env:9092");
    assert_eq!(c.kafka.client["socket.timeout.ms"], PassThrough::from("1000"));
    assert_eq!(c.kafka.client["sasl.password"], PassThrough::from("s3cret"));
    assert_eq!(c.kafka.producer["compression.type"], PassThrough::from("zstd"));
    assert_eq!(c.topics.schedule_partitions, 12);
    assert_eq!(c.topics.work, vec!["a", "b"]);
    assert!(c.limits.allow_empty_payload);
    assert_eq!(c.kafka.produce_timeout, Duration::from_secs(5));
}

#[test]
fn unknown_environment_keys_are_errors_too() {
    let err = load_from::<Config>("t", "", env(&[("KAIROS_KAFKA__BROKER", "x")])).unwrap_err();
    assert!(err.to_string().contains("broker"), "{err}");
}

#[test]
fn validation_rejects_out_of_range_values() {
    let mut c = Config::default();
    c.topics.schedule_partitions = 0;
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid {
            key: "topics.schedule_partitions",
            ..
        })
    ));
    let mut c = Config::default();
    c.topics.replication_factor = 3;
    c.topics.min_insync_replicas = Some(2);
    assert!(c.validate().is_ok());
    c.topics.min_insync_replicas = Some(4);
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid {
            key: "topics.min_insync_replicas",
            ..
        })
    ));
}

#[test]
fn session_timeouts_must_be_ones_librdkafka_accepts() {
    let mut c = Config::default();
    c.worker.session_timeout = std::time::Duration::from_millis(500);
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid {
            key: "worker.session_timeout",
            ..
        })
    ));
    c.worker.session_timeout = std::time::Duration::from_secs(10);
    c.scheduler.session_timeout = std::time::Duration::from_secs(301);
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid {
            key: "scheduler.session_timeout",
            ..
        })
    ));
    c.scheduler.session_timeout = std::time::Duration::from_secs(30);
    c.validate().unwrap();
}

#[test]
fn the_scheduler_s_revocation_deadline_fits_a_rebalance() {
    let mut c = Config::default();
    c.scheduler.revocation_deadline = std::time::Duration::from_secs(301);
    assert!(matches!(
        c.validate(),
        Err(ConfigError::Invalid {
            key: "scheduler.revocation_deadline",
            ..
        })
    ));
    c.scheduler.revocation_deadline = std::time::Duration::ZERO;
    assert!(c.validate().is_err());
    c.scheduler.revocation_deadline = std::time::Duration::from_secs(5);
    c.validate().unwrap();
}

#[test]
fn fair_topics_must_be_work_topics_with_positive_weights() {
    let key_of = |c: &Config| match c.validate() {
        Err(ConfigError::Invalid { key, .. }) => Some(key),
        _ => None,
    };
    let mut c = Config::default();
    c.fair.topics = vec!["not-a-work-topic".into()];
    assert_eq!(key_of(&c), Some("fair.topics"));
    c.fair.topics = c.topics.work.clone();
    assert_eq!(key_of(&c), None);
    c.fair.weights.insert("acme".into(), 0.0);
    assert_eq!(key_of(&c), Some("fair.weights"));
    c.fair.weights.insert("acme".into(), 3.0);
    c.fair.default_weight = f64::NAN;
    assert_eq!(key_of(&c), Some("fair.default_weight"));
    c.fair.default_weight = 1.0;
    c.fair.backlog_target = 0;
    assert_eq!(key_of(&c), Some("fair.backlog_target"));
    c.fair.backlog_target = 10;
    c.fair.backlog_time = std::time::Duration::from_secs(61);
    assert_eq!(key_of(&c), Some("fair.backlog_time"));
    c.fair.backlog_time = std::time::Duration::ZERO;
    assert_eq!(key_of(&c), None);
    c.fair.poll_interval = std::time::Duration::from_millis(1);
    assert_eq!(key_of(&c), Some("fair.poll_interval"));
    // A weights table in TOML.
    let c: Config = toml::from_str("[fair]\ntopics = \"kairos.jobs\"\n[fair.weights]\nacme = 3.0\n").unwrap();
    assert_eq!(c.fair.weights.get("acme"), Some(&3.0));
    assert!(c.fair.is_fair("kairos.jobs"));
}

#[test]
fn hold_key_and_pacing_name_worker_topics_and_sane_limits() {
    let key_of = |c: &Config| match c.validate() {
        Err(ConfigError::Invalid { key, .. }) => Some(key),
        _ => None,
    };
    let c: Config = toml::from_str(
        "[worker]\ntopics = [\"crawl\", \"mail\"]\non_failure_by_topic = { mail = \"hold_key\" }\n\
         [worker.pacing.crawl]\nmin_spacing = \"100ms\"\nrate = 10\nburst = 5\n\
         [worker.pacing.crawl.keys.\"slow.example.com\"]\nmin_spacing = \"2s\"\n",
    )
    .unwrap();
    assert_eq!(key_of(&c), None);
    assert_eq!(c.worker.on_failure("mail"), crate::config::OnFailure::HoldKey);
    assert_eq!(c.worker.on_failure("crawl"), crate::config::OnFailure::Overtake);
    assert!(c.worker.holds_keys("crawl") && c.worker.holds_keys("mail"));
    let crawl = &c.worker.pacing["crawl"];
    assert_eq!(
        crawl.limit_of(b"slow.example.com").min_spacing,
        Some(Duration::from_secs(2))
    );
    assert_eq!(crawl.limit_of(b"other").rate, Some(10.0));
    let mut bad = c.clone();
    bad.worker.pacing.insert("nope".into(), Default::default());
    assert_eq!(key_of(&bad), Some("worker.pacing"));
    let mut bad = c.clone();
    bad.worker
        .on_failure_by_topic
        .insert("nope".into(), crate::config::OnFailure::HoldKey);
    assert_eq!(key_of(&bad), Some("worker.on_failure_by_topic"));
    let mut bad = c.clone();
    bad.worker.pacing.get_mut("crawl").unwrap().rate = Some(0.0);
    assert_eq!(key_of(&bad), Some("worker.pacing"));
    let mut bad = c.clone();
    bad.worker.pacing.get_mut("crawl").unwrap().keys.insert(
        "k".into(),
        crate::config::Limit {
            burst: Some(3),
            ..Default::default()
        },
    );
    assert_eq!(key_of(&bad), Some("worker.pacing"), "a burst needs a rate");
    let mut bad = c.clone();
    bad.worker.pacing_horizon = Duration::ZERO;
    assert_eq!(key_of(&bad), Some("worker.pacing_horizon"));
    let mut bad = c;
    bad.worker.hold_give_up = Duration::from_millis(999);
    assert_eq!(key_of(&bad), Some("worker.hold_give_up"));
    assert!(toml::from_str::<Config>("[worker]\non_failure = \"hold\"\n").is_err());
}

#[test]
fn pass_through_settings_the_guarantees_rest_on_are_refused_naming_the_guarantee() {
    for (section, key, says) in [
        ("client", "enable.idempotence", "once and in order"),
        ("producer", "acks", "every in-sync replica"),
        ("consumer", "enable.auto.commit", "finished"),
        ("consumer", "enable.auto.offset.store", "finished"),
        ("client", "isolation.level", "committed"),
        ("consumer", "auto.offset.reset", "skipping no job"),
        ("producer", "partitioner", "murmur2"),
        ("client", "group.id", "worker.group_id"),
    ] {
        let toml = format!("[kafka.{section}]\n\"{key}\" = \"x\"\n");
        let err = load_from::<Config>("t", &toml, env(&[]))
            .and_then(|c: Config| c.validate().map(|()| c))
            .expect_err(key);
        let text = err.to_string();
        assert!(
            text.contains(key) && text.contains(&format!("[kafka.{section}]")) && text.contains(says),
            "{text}"
        );
    }
    // Settings that change no guarantee pass.
    let c: Config = load_from(
        "t",
        "[kafka.producer]\n\"compression.type\" = \"zstd\"\n[kafka.consumer]\n\"fetch.max.bytes\" = 1000000\n",
        env(&[]),
    )
    .unwrap();
    c.validate().unwrap();
}

#[test]
fn exactly_once_workers_take_topics_that_hold_keys_and_a_transaction_timeout_of_a_second_or_more() {
    let mut c = Config::default();
    c.worker.exactly_once = true;
    c.validate().unwrap();
    c.worker.on_failure = crate::config::OnFailure::HoldKey;
    c.validate().unwrap();
    c.worker.transaction_timeout = std::time::Duration::from_millis(500);
    let Err(ConfigError::Invalid { key, .. }) = c.validate() else {
        panic!("a transaction timeout under 1 s accepted")
    };
    assert_eq!(key, "worker.transaction_timeout");
}

#[test]
fn the_worker_s_commit_interval_fits_its_session() {
    let mut c = Config::default();
    c.worker.commit_interval = std::time::Duration::ZERO;
    let key_of = |c: &Config| match c.validate() {
        Err(ConfigError::Invalid { key, .. }) => Some(key),
        _ => None,
    };
    assert_eq!(key_of(&c), Some("worker.commit_interval"));
    c.worker.commit_interval = c.worker.session_timeout / 5;
    assert_eq!(
        key_of(&c),
        Some("worker.commit_interval"),
        "longer than a sixth of the session"
    );
    c.worker.commit_interval = std::time::Duration::from_secs(1);
    c.validate().unwrap();
}
