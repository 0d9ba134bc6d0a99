//! What can be wrong with a record: per header, and per record.

/// What is wrong with one header's value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderProblem {
    /// The header is present with a null value.
    #[error("has no value")]
    NoValue,
    /// The value must be UTF-8 text and is not.
    #[error("is not valid UTF-8")]
    NotUtf8,
    /// The value is empty text where text is required.
    #[error("is empty")]
    Empty,
    /// The value is not a time in either accepted form.
    #[error("`{0}` is neither an RFC 3339 time nor integer epoch milliseconds")]
    BadTime(String),
    /// The time is outside the representable range.
    #[error("`{0}` is outside the supported time range")]
    TimeOutOfRange(String),
    /// The value is not an integer.
    #[error("`{0}` is not an integer")]
    NotAnInteger(String),
    /// The integer is below the minimum.
    #[error("`{value}` is less than {min}")]
    TooSmall {
        /// The value found.
        value: i128,
        /// The smallest value allowed.
        min: u32,
    },
    /// The integer is above the maximum.
    #[error("`{value}` is larger than {max}")]
    TooLarge {
        /// The value found.
        value: String,
        /// The largest value allowed.
        max: u64,
    },
    /// A value longer than allowed.
    #[error("is {len} bytes, more than the limit of {max}")]
    TooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The value is not a UUID.
    #[error("`{0}` is not a UUID")]
    NotAUuid(String),
    /// A topic name with leading or trailing white space.
    #[error("`{0}` has leading or trailing white space")]
    BadTopic(String),
    /// The operation is not one of the known ones.
    #[error("`{0}` is not one of schedule, cancel, reschedule, release")]
    UnknownOp(String),
    /// The priority is not one of the known classes.
    #[error("`{0}` is not one of high, normal, low")]
    UnknownPriority(String),
    /// `kairos-if-busy` is not one of the known policies.
    #[error("`{0}` is not one of queue, skip")]
    UnknownIfBusy(String),
    /// An early-start allowance beyond the longest accepted.
    #[error("`{0}` ms is more than {max} ms (30 days)", max = super::MAX_EARLY_MS)]
    EarlyTooLong(String),
}

/// Why a record is not a valid job. Each variant names what is wrong; the
/// `Display` text is what the dead-letter record carries as its reason.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// No record key: the key is the job's entity key.
    #[error("record has no key (the key is the job's entity key)")]
    MissingKey,
    /// The key is longer than [`Limits::max_key_bytes`](crate::wire::Limits::max_key_bytes).
    #[error("key is {len} bytes, more than the limit of {max}")]
    KeyTooLarge {
        /// Key length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The value is empty and [`Limits::allow_empty_payload`](crate::wire::Limits::allow_empty_payload) is off.
    #[error("record has an empty payload")]
    EmptyPayload,
    /// The value is longer than [`Limits::max_payload_bytes`](crate::wire::Limits::max_payload_bytes).
    #[error("payload is {len} bytes, more than the limit of {max}")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A header's value is wrong.
    #[error("header `{name}` {problem}")]
    BadHeader {
        /// The header's name.
        name: &'static str,
        /// What is wrong with it.
        problem: HeaderProblem,
    },
    /// A Kairos header appears more than once.
    #[error("header `{0}` appears more than once")]
    DuplicateHeader(&'static str),
    /// A header starts with `kairos-` but is not part of the contract.
    #[error("header `{0}` starts with `kairos-` but is not part of the wire contract")]
    UnknownHeader(String),
    /// A header's name is not UTF-8.
    #[error("header #{0} has a name that is not valid UTF-8")]
    HeaderNameNotUtf8(usize),
    /// A header the context requires is missing.
    #[error("header `{name}` is required {context}")]
    MissingHeader {
        /// The header's name.
        name: &'static str,
        /// Where it is required.
        context: &'static str,
    },
    /// The record speaks a contract version this build does not know.
    #[error("wire contract version `{0}` is not supported (this build reads version 1)")]
    UnknownVersion(String),
    /// An operation other than `schedule` on a work topic.
    #[error("operation `{0}` is only valid on the schedule topic")]
    OpNotAllowed(&'static str),
}
