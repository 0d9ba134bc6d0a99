//! Headers and records the contract refuses, each with the error that names
//! what is wrong; and times that only epoch milliseconds can carry.

use super::*;

fn expect_bad(headers: Vec<(&str, Option<&[u8]>)>, name: &str, problem: HeaderProblem) {
    match work(&plain(headers)) {
        Err(DecodeError::BadHeader { name: n, problem: p }) => {
            assert_eq!(n, name);
            assert_eq!(p, problem);
        }
        other => panic!("expected bad header {name}, got {other:?}"),
    }
}

/// Found by the `decode_record` fuzz target: a job due in a year RFC 3339
/// cannot write (from the record's timestamp, or epoch milliseconds in
/// `kairos-run-at`) was encoded as `+55840-11-08T22:13:20.000Z`, which no
/// consumer could read back: the scheduler would dead-letter it.
#[test]
fn times_outside_years_0_to_9999_are_written_as_epoch_millis_and_round_trip() {
    let mut far = plain(vec![]);
    far.timestamp_ms = Some(1_700_000_000_000_000);
    let before_year_0 = (-62_167_219_200_001i64).to_string();
    let after_9999 = 253_402_300_800_000i64.to_string();
    for view in [
        far,
        plain(vec![("kairos-run-at", Some(before_year_0.as_bytes()))]),
        plain(vec![("kairos-run-at", Some(after_9999.as_bytes()))]),
    ] {
        let Command::Schedule(job) = work(&view).unwrap() else {
            panic!("expected a job")
        };
        let rec = encode(&job, "kairos.schedule");
        let written = rec.header(header::RUN_AT).unwrap();
        assert_eq!(written, job.run_at.timestamp_millis().to_string().as_bytes());
        let again = decode(&view_of(&rec), Context::Schedule, &Limits::default());
        assert_eq!(again, Ok(Command::Schedule(job.clone())));
        let rec = encode_reschedule(job.id, job.run_at, "kairos.schedule");
        assert_eq!(
            decode(&view_of(&rec), Context::Schedule, &Limits::default()),
            Ok(Command::Reschedule {
                id: job.id,
                run_at: job.run_at
            })
        );
    }
    assert_eq!(format_time(parse_time("0").unwrap()), "1970-01-01T00:00:00.000Z");
}

#[test]
fn unparseable_run_at_names_the_header_and_value() {
    expect_bad(
        vec![("kairos-run-at", Some(b"tomorrow"))],
        "kairos-run-at",
        HeaderProblem::BadTime("tomorrow".into()),
    );
    expect_bad(
        vec![("kairos-run-at", Some(b"99999999999999999999999"))],
        "kairos-run-at",
        HeaderProblem::TimeOutOfRange("99999999999999999999999".into()),
    );
    expect_bad(
        vec![("kairos-run-at", Some(b"9223372036854775807"))],
        "kairos-run-at",
        HeaderProblem::TimeOutOfRange("9223372036854775807".into()),
    );
    expect_bad(
        vec![("kairos-run-at", Some(b""))],
        "kairos-run-at",
        HeaderProblem::Empty,
    );
    expect_bad(
        vec![("kairos-run-at", None)],
        "kairos-run-at",
        HeaderProblem::NoValue,
    );
}

#[test]
fn non_utf8_text_is_rejected() {
    expect_bad(
        vec![("kairos-tenant", Some(&[0xff, 0xfe]))],
        "kairos-tenant",
        HeaderProblem::NotUtf8,
    );
    expect_bad(
        vec![("kairos-run-at", Some(&[0xc3]))],
        "kairos-run-at",
        HeaderProblem::NotUtf8,
    );
}

#[test]
fn attempts_must_be_positive_integers() {
    expect_bad(
        vec![("kairos-attempt", Some(b"-1"))],
        "kairos-attempt",
        HeaderProblem::TooSmall { value: -1, min: 1 },
    );
    expect_bad(
        vec![("kairos-attempt", Some(b"0"))],
        "kairos-attempt",
        HeaderProblem::TooSmall { value: 0, min: 1 },
    );
    expect_bad(
        vec![("kairos-max-attempts", Some(b"three"))],
        "kairos-max-attempts",
        HeaderProblem::NotAnInteger("three".into()),
    );
    expect_bad(
        vec![("kairos-attempt", Some(b"4294967296"))],
        "kairos-attempt",
        HeaderProblem::TooLarge {
            value: "4294967296".into(),
            max: u64::from(u32::MAX),
        },
    );
}

#[test]
fn ids_must_be_uuids() {
    expect_bad(
        vec![("kairos-id", Some(b"job-1"))],
        "kairos-id",
        HeaderProblem::NotAUuid("job-1".into()),
    );
}

#[test]
fn unknown_version_is_rejected() {
    assert_eq!(
        work(&plain(vec![("kairos-version", Some(b"2"))])),
        Err(DecodeError::UnknownVersion("2".into()))
    );
}

#[test]
fn duplicated_and_unknown_kairos_headers_are_rejected() {
    assert_eq!(
        work(&plain(vec![
            ("kairos-attempt", Some(b"1")),
            ("kairos-attempt", Some(b"2"))
        ])),
        Err(DecodeError::DuplicateHeader("kairos-attempt"))
    );
    assert_eq!(
        work(&plain(vec![("kairos-runat", Some(b"0"))])),
        Err(DecodeError::UnknownHeader("kairos-runat".into()))
    );
    assert_eq!(
        work(&plain(vec![("Kairos-Run-At", Some(b"0"))])),
        Err(DecodeError::UnknownHeader("Kairos-Run-At".into()))
    );
}

#[test]
fn user_headers_pass_through_in_order_with_nulls() {
    let Command::Schedule(job) = work(&plain(vec![
        ("trace", Some(b"1")),
        ("empty", None),
        ("trace", Some(b"2")),
    ]))
    .unwrap() else {
        panic!()
    };
    assert_eq!(
        job.headers,
        vec![
            ("trace".to_string(), Some(b"1".to_vec())),
            ("empty".to_string(), None),
            ("trace".to_string(), Some(b"2".to_vec())),
        ]
    );
}

#[test]
fn keys_and_payloads_are_checked_against_limits() {
    let mut v = plain(vec![]);
    v.key = None;
    assert_eq!(work(&v), Err(DecodeError::MissingKey));
    v.key = Some(b"");
    assert_eq!(work(&v), Err(DecodeError::MissingKey));
    let big = vec![b'k'; 4097];
    v.key = Some(&big);
    assert_eq!(work(&v), Err(DecodeError::KeyTooLarge { len: 4097, max: 4096 }));
    v.key = Some(b"k");
    v.value = None;
    assert_eq!(work(&v), Err(DecodeError::EmptyPayload));
    v.value = Some(b"");
    assert_eq!(work(&v), Err(DecodeError::EmptyPayload));
    let allow = Limits {
        allow_empty_payload: true,
        ..Limits::default()
    };
    assert!(decode(&v, Context::Work, &allow).is_ok());
    let huge = vec![0u8; 1_000_001];
    v.value = Some(&huge);
    assert_eq!(
        work(&v),
        Err(DecodeError::PayloadTooLarge {
            len: 1_000_001,
            max: 1_000_000
        })
    );
}
