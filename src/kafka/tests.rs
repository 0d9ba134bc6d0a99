//! Client settings: what Kairos sets, what a user may override.

use super::*;

#[test]
fn user_settings_override_defaults() {
    let mut cfg = KafkaConfig::default();
    cfg.client.insert("security.protocol".into(), "ssl".into());
    cfg.producer.insert("linger.ms".into(), "50".into());
    cfg.consumer.insert("auto.offset.reset".into(), "latest".into());
    let p = producer_config(&cfg, "p");
    assert_eq!(p.get("linger.ms"), Some("50"));
    assert_eq!(p.get("security.protocol"), Some("ssl"));
    assert_eq!(p.get("enable.idempotence"), Some("true"));
    cfg.consumer.insert("session.timeout.ms".into(), "6000".into());
    let member = Membership {
        group: "g",
        session_timeout: std::time::Duration::from_secs(10),
        instance_id: Some("i-1".into()),
        auto_commit_every: Some(std::time::Duration::from_millis(100)),
    };
    let c = consumer_config(&cfg, &member, "c");
    assert_eq!(c.get("auto.offset.reset"), Some("latest"));
    assert_eq!(c.get("linger.ms"), None);
    assert_eq!(c.get("group.id"), Some("g"));
    assert_eq!(c.get("group.instance.id"), Some("i-1"));
    assert_eq!(c.get("auto.commit.interval.ms"), Some("100"));
    assert_eq!(
        c.get("session.timeout.ms"),
        Some("6000"),
        "the user's setting wins"
    );
    cfg.consumer.clear();
    let member = Membership {
        instance_id: None,
        ..member
    };
    let c = consumer_config(&cfg, &member, "c");
    assert_eq!(c.get("session.timeout.ms"), Some("10000"));
    assert_eq!(c.get("group.instance.id"), None);
    assert_eq!(c.get("partition.assignment.strategy"), Some("cooperative-sticky"));
    cfg.group_protocol = GroupProtocol::Consumer;
    let c = consumer_config(&cfg, &member, "c");
    assert_eq!(c.get("group.protocol"), Some("consumer"));
    assert_eq!(c.get("session.timeout.ms"), None, "the broker's, under KIP-848");
    assert_eq!(c.get("partition.assignment.strategy"), None);
}

#[test]
fn a_member_committing_in_transactions_never_commits_by_itself() {
    let mut cfg = KafkaConfig::default();
    cfg.consumer.insert("enable.auto.commit".into(), "true".into());
    let member = Membership {
        group: "g",
        session_timeout: std::time::Duration::from_secs(10),
        instance_id: None,
        auto_commit_every: None,
    };
    let c = consumer_config(&cfg, &member, "c");
    assert_eq!(
        c.get("enable.auto.commit"),
        Some("false"),
        "over the user's setting"
    );
    assert_eq!(c.get("enable.auto.offset.store"), Some("false"));
    let member = Membership {
        auto_commit_every: Some(std::time::Duration::from_secs(1)),
        ..member
    };
    let c = consumer_config(&cfg, &member, "c");
    assert_eq!(c.get("enable.auto.commit"), Some("true"));
    assert_eq!(c.get("auto.commit.interval.ms"), Some("1000"));
}

#[test]
fn doubles_from_100_ms_up_to_5_s() {
    let mut d = RetryDelay::new();
    let got: Vec<u64> = (0..8).map(|_| d.next_delay().as_millis() as u64).collect();
    assert_eq!(got, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
    assert_eq!(d.next_delay(), std::time::Duration::from_secs(5));
}
