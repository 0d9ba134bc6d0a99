//! First contact: whether the cluster answers, and if not, why, in words a
//! user can act on (the address, and connection refused, name not
//! resolved, TLS or SASL refused), within seconds instead of after a
//! request's own time-out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::DeliveryResult;
use rdkafka::producer::{Producer as _, ProducerContext, ThreadedProducer};
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaConfig;
use crate::sync::Lock;

/// The cluster did not answer.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach Kafka at {brokers}: {cause}")]
pub struct Unreachable {
    /// The bootstrap servers asked.
    pub brokers: String,
    /// Why, as librdkafka reported it (the last connection error), or that
    /// nothing answered in time.
    pub cause: String,
}

/// Collects what librdkafka reports about its connections while a client
/// tries to reach the cluster.
#[derive(Default)]
struct Watch {
    last: Arc<Mutex<Option<String>>>,
}

impl Watch {
    fn note(&self, what: String) {
        *self.last.locked() = Some(what);
    }
}

impl ClientContext for Watch {
    fn log(&self, level: RDKafkaLogLevel, _fac: &str, log_message: &str) {
        let serious = (level as i32) <= (RDKafkaLogLevel::Warning as i32);
        if serious && is_about_connecting(log_message) {
            self.note(log_message.to_string());
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        // "All brokers down" follows the failure that says why: keep that.
        let summary = error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown);
        let mut last = self.last.locked();
        if !summary || last.is_none() {
            *last = Some(reason.to_string());
        }
    }
}

impl ProducerContext for Watch {
    type DeliveryOpaque = ();
    fn delivery(&self, _: &DeliveryResult<'_>, _: ()) {}
}

/// Whether a log line is about reaching a broker (connect, resolve, TLS,
/// SASL), not about something later.
fn is_about_connecting(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    [
        "connect",
        "resolve",
        "ssl",
        "tls",
        "sasl",
        "authentic",
        "handshake",
    ]
    .iter()
    .any(|w| l.contains(w))
}

/// Ask the cluster for its brokers, for at most `timeout`. An error names
/// the address and the last cause librdkafka gave (`Connection refused`,
/// `Failed to resolve`, an SSL handshake or SASL authentication failure).
pub fn reach(cfg: &KafkaConfig, timeout: Duration) -> Result<(), Unreachable> {
    let watch = Watch::default();
    let last = watch.last.clone();
    let unreachable = |cause: String| Unreachable {
        brokers: cfg.brokers.clone(),
        cause,
    };
    let mut conf = super::base_config(cfg, "kairos-reach");
    // Report connection failures at once, each time (librdkafka otherwise
    // logs a repeated failure once).
    conf.set("log.connection.close", "true");
    conf.set("reconnect.backoff.ms", "100");
    conf.set_log_level(RDKafkaLogLevel::Warning);
    // A producer polled by its own thread: the callbacks above are called.
    let producer: ThreadedProducer<Watch> = conf
        .create_with_context(watch)
        .map_err(|e| unreachable(e.to_string()))?;
    let client = producer.client();
    match client.fetch_metadata(None, timeout) {
        Ok(md) if !md.brokers().is_empty() => Ok(()),
        Ok(_) => Err(unreachable("the cluster answered with no brokers".into())),
        Err(e) => {
            let seen = last.locked().take();
            Err(unreachable(
                seen.unwrap_or_else(|| format!("no answer within {timeout:?} ({e})")),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_lines_are_told_from_the_rest() {
        assert!(is_about_connecting(
            "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused"
        ));
        assert!(is_about_connecting(
            "nosuch.invalid:9092/bootstrap: Failed to resolve 'nosuch.invalid:9092'"
        ));
        assert!(is_about_connecting(
            "SASL authentication error: Authentication failed"
        ));
        assert!(!is_about_connecting(
            "Topic x partition count changed from 1 to 2"
        ));
    }
}
