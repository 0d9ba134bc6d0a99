//! The scheduler instance's stable identity in its consumer group.
//!
//! With static membership (Kafka's `group.instance.id`, KIP-345) a restarted
//! instance takes its partitions back at once, instead of waiting for its
//! dead predecessor's session to expire: a scheduler killed and restarted
//! keeps firing within about a second, where with dynamic membership
//! nothing fires for the whole session timeout, and a kill loop can hold
//! every fire back for minutes. The id is generated on first start and kept
//! in the data directory, so it lives exactly as long as the store it
//! belongs to; one store, one instance.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::config::Config;

/// The file in the data directory that keeps the generated id.
pub const INSTANCE_ID_FILE: &str = "instance-id";

/// Why the instance id could not be read or kept.
#[derive(Debug, thiserror::Error)]
#[error("scheduler instance id in {path}: {source}")]
pub struct InstanceIdError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub source: std::io::Error,
}

/// The `group.instance.id` this scheduler joins its group with, or `None`
/// for dynamic membership (`scheduler.static_membership = false`) and
/// when `[kafka.consumer]` sets `group.instance.id` itself (then it wins).
/// Otherwise `scheduler.instance_id` when set, else the id kept in the data
/// directory, generated and written there (durably) on first start.
pub fn group_instance_id(cfg: &Config) -> Result<Option<String>, InstanceIdError> {
    let s = &cfg.scheduler;
    if !s.static_membership || cfg.kafka.consumer.contains_key("group.instance.id") {
        return Ok(None);
    }
    if !s.instance_id.is_empty() {
        return Ok(Some(s.instance_id.clone()));
    }
    kept_or_new(&s.data_dir).map(Some)
}

/// The `transactional.id` of this instance's producer in exactly-once mode:
/// stable for as long as its store lives (the static member id, else the id
/// kept in the data directory), so a restarted instance fences its own
/// predecessor and aborts what it left open.
pub fn transactional_id(cfg: &Config) -> Result<String, InstanceIdError> {
    let id = match group_instance_id(cfg)? {
        Some(id) => id,
        None => match cfg.kafka.consumer.get("group.instance.id") {
            Some(v) => v.0.clone(),
            None => kept_or_new(&cfg.scheduler.data_dir)?,
        },
    };
    Ok(format!("kairos-scheduler-{id}"))
}

fn kept_or_new(dir: &Path) -> Result<String, InstanceIdError> {
    let path = dir.join(INSTANCE_ID_FILE);
    let err = |source| InstanceIdError {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            if id.is_empty() {
                return Err(err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the file is empty; delete it to have a new id generated",
                )));
            }
            return Ok(id.to_string());
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let id = format!("kairos-scheduler-{}", uuid::Uuid::now_v7().simple());
    // Written aside and renamed, so a crash never leaves half an id.
    let tmp = dir.join(format!("{INSTANCE_ID_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(format!("{id}\n").as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(err)?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path) -> Config {
        let mut cfg = Config::default();
        cfg.scheduler.data_dir = dir.to_path_buf();
        cfg
    }

    #[test]
    fn the_generated_id_is_kept_in_the_data_directory() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let first = group_instance_id(&cfg).unwrap().unwrap();
        assert!(first.starts_with("kairos-scheduler-"), "{first}");
        assert_eq!(group_instance_id(&cfg).unwrap().unwrap(), first);
        let other = tempfile::tempdir().unwrap();
        assert_ne!(group_instance_id(&config(other.path())).unwrap().unwrap(), first);
    }

    #[test]
    fn configuration_names_or_turns_off_the_id() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = config(dir.path());
        cfg.scheduler.instance_id = "scheduler-a".into();
        assert_eq!(group_instance_id(&cfg).unwrap().as_deref(), Some("scheduler-a"));
        cfg.scheduler.static_membership = false;
        assert_eq!(group_instance_id(&cfg).unwrap(), None);
        cfg.scheduler.static_membership = true;
        cfg.kafka.consumer.insert(
            "group.instance.id".into(),
            crate::config::PassThrough("mine".into()),
        );
        assert_eq!(group_instance_id(&cfg).unwrap(), None);
        assert!(!dir.path().join(INSTANCE_ID_FILE).exists());
    }

    #[test]
    fn an_empty_id_file_is_an_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(INSTANCE_ID_FILE), "\n").unwrap();
        let e = group_instance_id(&config(dir.path())).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
    }
}
