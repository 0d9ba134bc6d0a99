//! Loading: a TOML file, then `KAIROS_...` environment overrides, checked.

use std::path::{Path, PathBuf};

/// Why configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not TOML.
    #[error("config file {path} is not valid TOML: {message}")]
    Syntax {
        /// The file.
        path: String,
        /// The parser's message, with line and column.
        message: String,
    },
    /// A key is unknown or a value has the wrong type.
    #[error("config key `{key}`: {message}")]
    Key {
        /// Dotted path of the offending key, e.g. `kafka.brokerz`.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// An environment override could not be applied.
    #[error("environment variable {var}: {message}")]
    Env {
        /// The variable's name.
        var: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of its allowed range.
    #[error("config key `{key}`: {message}")]
    Invalid {
        /// Dotted path of the key.
        key: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "KAIROS_";

/// Load a configuration section (`T` is [`Config`](crate::Config) or a role's config that
/// flattens it) from an optional file, then apply `KAIROS_...` overrides from
/// the process environment.
pub fn load<T: serde::de::DeserializeOwned>(path: Option<&Path>) -> Result<T, ConfigError> {
    let text = match path {
        Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
            path: p.to_path_buf(),
            source,
        })?,
        None => String::new(),
    };
    let name = path.map_or_else(|| "(none)".to_string(), |p| p.display().to_string());
    load_from(&name, &text, std::env::vars())
}

/// Load from TOML text and an explicit set of environment variables (for tests).
pub fn load_from<T: serde::de::DeserializeOwned>(
    name: &str,
    text: &str,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError> {
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| ConfigError::Syntax {
        path: name.to_string(),
        message: e.to_string(),
    })?;
    let mut env: Vec<(String, String)> = env.into_iter().collect();
    env.sort();
    for (var, value) in env {
        if let Some(rest) = var.strip_prefix(ENV_PREFIX) {
            if rest.contains("__") {
                apply_env(&mut table, &var, rest, &value)?;
            }
        }
    }
    let value = toml::Value::Table(table);
    serde_path_to_error::deserialize(value).map_err(|e| {
        let key = e.path().to_string();
        ConfigError::Key {
            key,
            message: e.into_inner().to_string(),
        }
    })
}

/// The librdkafka maps, where `_` in a variable stands for `.` in the key.
const PASS_THROUGH_MAPS: [&str; 3] = ["client", "producer", "consumer"];

fn apply_env(table: &mut toml::Table, var: &str, rest: &str, value: &str) -> Result<(), ConfigError> {
    let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if parts.iter().any(String::is_empty) {
        return Err(ConfigError::Env {
            var: var.to_string(),
            message: "empty name between `__` separators".into(),
        });
    }
    let pass_through =
        parts.len() == 3 && parts[0] == "kafka" && PASS_THROUGH_MAPS.contains(&parts[1].as_str());
    let (last, path) = parts.split_last().expect("split yields at least one part");
    let mut cur = table;
    for p in path {
        let entry = cur
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = entry.as_table_mut().ok_or_else(|| ConfigError::Env {
            var: var.to_string(),
            message: format!("`{p}` is a value, not a section"),
        })?;
    }
    let (key, val) = if pass_through {
        (last.replace('_', "."), toml::Value::String(value.to_string()))
    } else {
        (last.clone(), parse_env_value(value))
    };
    cur.insert(key, val);
    Ok(())
}

fn parse_env_value(value: &str) -> toml::Value {
    format!("v = {value}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()))
}
