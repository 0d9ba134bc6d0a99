//! Requests asked again while a broker is lost: a metadata, watermark or
//! offset request to a broker just killed fails at once (its connection
//! reset, its handle destroyed when the cluster drops it from the
//! metadata) and succeeds a few seconds later, once the controller has
//! moved its partitions' leadership and the coordinators elsewhere. And
//! the opposite: records the broker refuses however often they are sent.

use std::time::{Duration, Instant};

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use tracing::warn;

/// Whether asking again may help: anything but a refusal of authorization.
pub fn transient(e: &KafkaError) -> bool {
    !matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::GroupAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
        )
    )
}

/// Whether the broker refuses this record however often it is sent: too
/// large for the topic, malformed for it, against a topic policy or not
/// authorised. librdkafka fails every record of a refused record's batch
/// with the same error, so a record failed so may also be an innocent
/// batch-mate of the one refused.
pub fn refused_for_good(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTimestamp
                | RDKafkaErrorCode::PolicyViolation
                | RDKafkaErrorCode::TopicAuthorizationFailed
        )
    )
}

/// Call `f` until it succeeds, fails for good, or `deadline` passes (then
/// its last error is returned), waiting 100 ms, doubling up to 2 s, between
/// tries. `what` names the request in the warning of each failed try.
pub fn retry_until<T>(
    what: &str,
    deadline: Instant,
    mut f: impl FnMut() -> Result<T, KafkaError>,
) -> Result<T, KafkaError> {
    let mut wait = Duration::from_millis(100);
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if transient(&e) && Instant::now() + wait < deadline => {
                warn!(request = what, error = %e, retry_in = ?wait, "Kafka request failed; asking again");
                std::thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_again_until_it_works_and_not_after_a_refusal() {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut tries = 0;
        let got = retry_until("test", deadline, || {
            tries += 1;
            if tries < 3 {
                Err(KafkaError::MetadataFetch(RDKafkaErrorCode::DestroyBroker))
            } else {
                Ok(tries)
            }
        });
        assert_eq!(got.unwrap(), 3);
        let mut tries = 0;
        let refused: Result<(), _> = retry_until("test", deadline, || {
            tries += 1;
            Err(KafkaError::MetadataFetch(
                RDKafkaErrorCode::TopicAuthorizationFailed,
            ))
        });
        assert!(refused.is_err());
        assert_eq!(tries, 1);
        let soon = Instant::now() + Duration::from_millis(50);
        let late: Result<(), _> = retry_until("test", soon, || {
            Err(KafkaError::MetadataFetch(RDKafkaErrorCode::DestroyBroker))
        });
        assert!(late.is_err(), "gives up at the deadline");
    }
}
