//! Fuzz target: loading the configuration ([`kairos::config::load_from`]):
//! TOML text, then `KAIROS_...` environment overrides, then `validate()`.
//!
//! The input is a config file, optionally followed by a line `%% env` and
//! environment variables, one `NAME=VALUE` per line (a line without `=` is a
//! variable with an empty value), so the seed corpus
//! (`fuzz/corpus/parse_config/`) is readable:
//!
//! ```text
//! [kafka]
//! brokers = "a:9092"
//! %% env
//! KAIROS_TOPICS__WORK=a, b
//! KAIROS_KAFKA__CLIENT__SASL_PASSWORD=secret
//! ```
//!
//! A config file that is not UTF-8 never reaches the parser (reading it
//! fails first), so such inputs are skipped.
//!
//! Invariants checked (the config module's documentation):
//! - loading never panics, whatever the text and the variables;
//! - the result does not depend on the order of the variables (the process
//!   environment has none);
//! - a loaded configuration passes or fails `validate()` without panicking,
//!   and every error renders.
#![no_main]
#![forbid(unsafe_code)]

use kairos::config::{self, Config, ConfigError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = std::str::from_utf8(data) else {
        return;
    };
    let (text, env) = match input.strip_prefix("%% env\n") {
        Some(env) => ("", env),
        None => input.split_once("\n%% env\n").unwrap_or((input, "")),
    };
    let mut env: Vec<(String, String)> = env
        .lines()
        .map(|line| match line.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (line.to_string(), String::new()),
        })
        .collect();

    let loaded = config::load_from::<Config>("fuzz.toml", text, env.clone());
    env.reverse();
    let again = config::load_from::<Config>("fuzz.toml", text, env);
    match (&loaded, &again) {
        (Ok(a), Ok(b)) => assert_eq!(a, b, "the result depends on the order of the variables"),
        (Err(a), Err(b)) => assert_eq!(
            a.to_string(),
            b.to_string(),
            "the error depends on the order of the variables"
        ),
        _ => panic!("the order of the variables decides success: {loaded:?} / {again:?}"),
    }
    match loaded {
        Ok(cfg) => match cfg.validate() {
            Ok(()) => {
                assert!(!cfg.kafka.brokers.trim().is_empty());
                assert!(cfg.limits.max_key_bytes >= 1);
            }
            Err(e) => rendered(&e),
        },
        Err(e) => rendered(&e),
    }
});

fn rendered(e: &ConfigError) {
    assert!(!e.to_string().is_empty());
}
