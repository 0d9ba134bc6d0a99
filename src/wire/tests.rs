use proptest::prelude::*;

use super::encode::decimal;
use super::*;

mod rejects;

fn view_of(rec: &OwnedRecord) -> RecordView<'_> {
    rec.view(3, 42, Some(1_700_000_000_000))
}

fn plain<'a>(headers: Vec<(&'a str, Option<&'a [u8]>)>) -> RecordView<'a> {
    RecordView {
        topic: "jobs",
        partition: 0,
        offset: 7,
        timestamp_ms: Some(1_700_000_000_000),
        key: Some(b"user-1"),
        value: Some(b"payload"),
        headers,
        unreadable_header: None,
    }
}

fn work(view: &RecordView<'_>) -> Result<Command, DecodeError> {
    decode(view, Context::Work, &Limits::default())
}

fn job_strategy() -> impl Strategy<Value = Job> {
    (
        proptest::collection::vec(any::<u8>(), 1..64),
        proptest::collection::vec(any::<u8>(), 1..256),
        // Whole milliseconds from year 0 to 9999.
        -62_167_219_200_000i64..253_402_300_799_999i64,
        "[a-z][a-z0-9._-]{0,30}",
        1u32..=u32::MAX,
        proptest::option::of(1u32..=u32::MAX),
        proptest::option::of("[^\\s][a-zA-Z0-9 ]{0,20}"),
        proptest::option::of(".{0,40}"),
        proptest::collection::vec(
            (
                "[a-z][a-z0-9-]{0,10}",
                proptest::option::of(proptest::collection::vec(any::<u8>(), 0..16)),
            ),
            0..4,
        ),
        (
            0usize..3,
            proptest::option::of(1u64..=MAX_EARLY_MS),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 1..16)),
            proptest::option::of(1u64..),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                key,
                payload,
                ms,
                topic,
                attempt,
                max,
                tenant,
                err,
                hdrs,
                (class, early, limit_key, parked, skip_if_busy),
            )| Job {
                id: JobId::new(),
                key,
                payload,
                run_at: Utc.timestamp_millis_opt(ms).unwrap(),
                topic,
                attempt,
                max_attempts: max,
                tenant,
                priority: [
                    crate::job::Priority::High,
                    crate::job::Priority::Normal,
                    crate::job::Priority::Low,
                ][class],
                early: early.map(std::time::Duration::from_millis),
                last_error: err,
                limit_key,
                parked,
                skip_if_busy,
                headers: hdrs
                    .into_iter()
                    // user headers must not use the reserved prefix
                    .map(|(k, v)| (format!("x-{k}"), v))
                    .collect(),
            },
        )
}

#[test]
fn if_busy_queues_by_default_skips_when_asked_and_refuses_anything_else() {
    let skip = |headers| match work(&plain(headers)) {
        Ok(Command::Schedule(j)) => Ok(j.skip_if_busy),
        Err(DecodeError::BadHeader { name, problem }) => Err((name, problem)),
        other => panic!("{other:?}"),
    };
    assert_eq!(skip(vec![]), Ok(false));
    assert_eq!(skip(vec![("kairos-if-busy", Some(b"queue"))]), Ok(false));
    assert_eq!(skip(vec![("kairos-if-busy", Some(b" skip "))]), Ok(true));
    assert_eq!(
        skip(vec![("kairos-if-busy", Some(b"drop"))]),
        Err((header::IF_BUSY, HeaderProblem::UnknownIfBusy("drop".into())))
    );
    assert_eq!(
        skip(vec![("kairos-if-busy", None)]),
        Err((header::IF_BUSY, HeaderProblem::NoValue))
    );
}

#[test]
fn priority_and_early_allowance_have_defaults_and_typed_errors() {
    let job = match work(&plain(vec![])).unwrap() {
        Command::Schedule(j) => j,
        other => panic!("{other:?}"),
    };
    assert_eq!((job.priority, job.early), (crate::job::Priority::Normal, None));
    let job = match work(&plain(vec![
        ("kairos-priority", Some(b"high")),
        ("kairos-early", Some(b" 60000 ")),
    ]))
    .unwrap()
    {
        Command::Schedule(j) => j,
        other => panic!("{other:?}"),
    };
    assert_eq!(job.priority, crate::job::Priority::High);
    assert_eq!(job.early, Some(std::time::Duration::from_secs(60)));
    let problem = |headers| match work(&plain(headers)) {
        Err(DecodeError::BadHeader { name, problem }) => (name, problem),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        problem(vec![("kairos-priority", Some(b"urgent"))]),
        (header::PRIORITY, HeaderProblem::UnknownPriority("urgent".into()))
    );
    assert_eq!(
        problem(vec![("kairos-early", Some(b"0"))]),
        (header::EARLY, HeaderProblem::TooSmall { value: 0, min: 1 })
    );
    assert_eq!(
        problem(vec![("kairos-early", Some(b"soon"))]),
        (header::EARLY, HeaderProblem::NotAnInteger("soon".into()))
    );
    assert_eq!(
        problem(vec![("kairos-early", Some(b"2592000001"))]),
        (header::EARLY, HeaderProblem::EarlyTooLong("2592000001".into()))
    );
    // The producer refuses what would not decode.
    let sub_ms = Job::new("jobs", "k", b"p".to_vec());
    let sub_ms = Job {
        early: Some(std::time::Duration::from_micros(1500)),
        ..sub_ms
    };
    assert!(check(&sub_ms, &Limits::default()).is_err());
    let long = Job::new("jobs", "k", b"p".to_vec()).early(std::time::Duration::from_secs(31 * 86_400));
    assert!(check(&long, &Limits::default()).is_err());
}

proptest! {
    #[test]
    fn encode_then_decode_is_identity_on_schedule_topic(job in job_strategy()) {
        let rec = encode(&job, "kairos.schedule");
        let decoded = decode(&view_of(&rec), Context::Schedule, &Limits::default()).unwrap();
        prop_assert_eq!(decoded, Command::Schedule(job));
    }

    #[test]
    fn fire_path_headers_are_the_encoded_headers(job in job_strategy()) {
        use rdkafka::message::Headers;
        let direct = kafka_headers(&job);
        let got: Vec<(String, Option<Vec<u8>>)> = direct
            .iter()
            .map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec)))
            .collect();
        prop_assert_eq!(got, encode(&job, &job.topic).headers);
    }

    #[test]
    fn encode_then_decode_is_identity_on_work_topic(job in job_strategy()) {
        let rec = encode(&job, &job.topic);
        let decoded = decode_job(&view_of(&rec), Context::Work, &Limits::default()).unwrap();
        prop_assert_eq!(decoded, job);
    }

    #[test]
    fn time_text_round_trips(ms in -62_167_219_200_000i64..253_402_300_799_999i64) {
        let t = Utc.timestamp_millis_opt(ms).unwrap();
        prop_assert_eq!(parse_time(&format_time(t)).unwrap(), t);
        prop_assert_eq!(parse_time(&ms.to_string()).unwrap(), t);
    }

    #[test]
    fn every_time_round_trips(
        ms in DateTime::<Utc>::MIN_UTC.timestamp_millis()..=DateTime::<Utc>::MAX_UTC.timestamp_millis()
    ) {
        let t = Utc.timestamp_millis_opt(ms).unwrap();
        prop_assert_eq!(parse_time(&format_time(t)).unwrap(), t);
    }

    #[test]
    fn decode_never_panics_on_arbitrary_headers(
        key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
        value in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)),
        headers in proptest::collection::vec(
            (prop_oneof![Just("kairos-run-at".to_string()), Just("kairos-attempt".to_string()),
                         Just("kairos-id".to_string()), Just("kairos-op".to_string()),
                         Just("kairos-topic".to_string()), "kairos-[a-z]{1,5}", "[a-z]{1,5}"],
             proptest::option::of(proptest::collection::vec(any::<u8>(), 0..12))),
            0..6),
    ) {
        let view = RecordView {
            topic: "t", key: key.as_deref(), value: value.as_deref(),
            headers: headers.iter().map(|(k, v)| (k.as_str(), v.as_deref())).collect(),
            ..Default::default()
        };
        let _ = decode(&view, Context::Schedule, &Limits::default());
        let _ = decode(&view, Context::Work, &Limits::default());
    }
}

fn any_job_strategy() -> impl Strategy<Value = Job> {
    (
        job_strategy(),
        proptest::collection::vec(any::<u8>(), 0..3),
        proptest::collection::vec(any::<u8>(), 0..3),
        prop_oneof![
            Just("".to_string()),
            Just(" t".to_string()),
            Just("t".to_string())
        ],
        0u32..3,
        proptest::option::of(0u32..3),
        proptest::option::of(prop_oneof![
            Just("".to_string()),
            Just(" ".to_string()),
            Just("x".to_string())
        ]),
        prop_oneof![
            Just("x-h".to_string()),
            Just("kairos-h".to_string()),
            Just("KAIROS-id".to_string())
        ],
        any::<bool>(),
    )
        .prop_map(
            |(mut job, key, payload, topic, attempt, max, tenant, hname, mutate)| {
                if mutate {
                    job.key = key;
                    job.payload = payload;
                    job.topic = topic;
                    job.attempt = attempt;
                    job.max_attempts = max;
                    job.tenant = tenant;
                    job.headers.push((hname, None));
                }
                job
            },
        )
}

proptest! {
    #[test]
    fn check_agrees_with_decode(job in any_job_strategy()) {
        let rec = encode(&job, "kairos.schedule");
        let decoded = decode(&view_of(&rec), Context::Schedule, &Limits::default());
        match check(&job, &Limits::default()) {
            Ok(()) => prop_assert_eq!(decoded, Ok(Command::Schedule(job))),
            Err(e) => prop_assert!(decoded.is_err(), "check said {e} but decode accepted"),
        }
    }
}

#[test]
fn a_record_without_headers_is_a_job_due_when_written() {
    let Command::Schedule(job) = work(&plain(vec![])).unwrap() else {
        panic!("expected a job")
    };
    assert_eq!(job.topic, "jobs");
    assert_eq!(job.attempt, 1);
    assert_eq!(job.run_at.timestamp_millis(), 1_700_000_000_000);
    assert_eq!(job.id, JobId::derived("jobs", 0, 7, 1_700_000_000_000));
}

#[test]
fn run_at_accepts_rfc3339_with_offset_and_epoch_millis() {
    let a = parse_time("2030-05-01T12:00:00+02:00").unwrap();
    let b = parse_time("1903860000000").unwrap();
    assert_eq!(a, b);
    assert_eq!(
        parse_time("9999-12-31T23:59:59.999Z").unwrap().timestamp_millis(),
        253_402_300_799_999
    );
    assert_eq!(parse_time("-1000").unwrap().timestamp_millis(), -1000);
}

#[test]
fn schedule_topic_requires_a_target_topic() {
    let v = plain(vec![("kairos-run-at", Some(b"0"))]);
    assert!(matches!(
        decode(&v, Context::Schedule, &Limits::default()),
        Err(DecodeError::MissingHeader {
            name: "kairos-topic",
            ..
        })
    ));
}

#[test]
fn cancel_and_reschedule_round_trip_and_are_refused_on_work_topics() {
    let id = JobId::new();
    let rec = encode_cancel(id, "kairos.schedule");
    assert_eq!(
        decode(&view_of(&rec), Context::Schedule, &Limits::default()),
        Ok(Command::Cancel(id))
    );
    assert_eq!(work(&view_of(&rec)), Err(DecodeError::OpNotAllowed("cancel")));

    let at = Utc.timestamp_millis_opt(1_900_000_000_123).unwrap();
    let rec = encode_reschedule(id, at, "kairos.schedule");
    assert_eq!(
        decode(&view_of(&rec), Context::Schedule, &Limits::default()),
        Ok(Command::Reschedule { id, run_at: at })
    );
    let v = plain(vec![("kairos-op", Some(b"cancel"))]);
    assert!(matches!(
        decode(&v, Context::Schedule, &Limits::default()),
        Err(DecodeError::MissingHeader {
            name: "kairos-id",
            ..
        })
    ));
    let v = plain(vec![("kairos-op", Some(b"delete"))]);
    assert!(matches!(
        decode(&v, Context::Schedule, &Limits::default()),
        Err(DecodeError::BadHeader {
            name: "kairos-op",
            problem: HeaderProblem::UnknownOp(_)
        })
    ));
}

#[test]
fn dead_letters_keep_the_original_record_and_replace_old_reasons() {
    let original = plain(vec![
        ("kairos-run-at", Some(b"garbage")),
        ("kairos-dead-reason", Some(b"old")),
    ]);
    let dead = DeadLetter {
        reason: "header `kairos-run-at` is bad".into(),
        origin_topic: "jobs".into(),
        origin_partition: 0,
        origin_offset: 7,
    };
    let rec = dead_letter_record(&original, &dead, "kairos.dead", &Limits::default());
    assert_eq!(rec.key, b"user-1");
    assert_eq!(rec.value.as_deref(), Some(&b"payload"[..]));
    assert_eq!(rec.header("kairos-run-at"), Some(&b"garbage"[..]));
    assert_eq!(rec.header("kairos-dead-reason"), Some(dead.reason.as_bytes()));
    assert_eq!(rec.header("kairos-origin-offset"), Some(&b"7"[..]));
    assert_eq!(
        rec.headers
            .iter()
            .filter(|(k, _)| k == "kairos-dead-reason")
            .count(),
        1
    );
}

#[test]
fn oversized_dead_letters_are_cut_to_the_limits_and_say_so() {
    let key = vec![b'k'; 5000];
    let value = vec![b'v'; 1_000_010];
    let mut original = plain(vec![]);
    original.key = Some(&key);
    original.value = Some(&value);
    let dead = DeadLetter {
        reason: "too big".into(),
        origin_topic: "jobs".into(),
        origin_partition: 0,
        origin_offset: 7,
    };
    let rec = dead_letter_record(&original, &dead, "kairos.dead", &Limits::default());
    assert_eq!(rec.key.len(), 4096);
    assert_eq!(rec.value.as_ref().unwrap().len(), 1_000_000);
    assert_eq!(rec.header("kairos-dead-truncated"), Some(&b"key,payload"[..]));
    let small = dead_letter_record(&plain(vec![]), &dead, "kairos.dead", &Limits::default());
    assert_eq!(small.header("kairos-dead-truncated"), None);
}

#[test]
fn errors_read_well() {
    let e = work(&plain(vec![("kairos-run-at", Some(b"soon"))])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "header `kairos-run-at` `soon` is neither an RFC 3339 time nor integer epoch milliseconds"
    );
}

#[test]
fn decimal_writes_every_u64_as_to_string_does() {
    let mut buf = [0u8; 20];
    for n in [
        0,
        1,
        9,
        10,
        99,
        100,
        12_345,
        1_000_000_000,
        u32::MAX.into(),
        1 << 62,
        u64::MAX,
    ] {
        assert_eq!(decimal(n, &mut buf), n.to_string().as_bytes());
    }
}

/// The fuzzer's dictionary (`fuzz/decode_record.dict`) names every header
/// of the contract, every operation and every priority, so the fuzzer
/// reaches their decoding.
#[test]
fn the_fuzz_dictionary_names_every_header_and_value_word() {
    let dict = include_str!("../../fuzz/decode_record.dict");
    let entries: Vec<&str> = dict
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.trim().strip_prefix('"')?.strip_suffix('"'))
        .collect();
    for name in header::ALL {
        let entry = format!("{name}: ");
        assert!(
            entries.contains(&entry.as_str()),
            "{entry:?} missing from the dictionary"
        );
    }
    for word in [
        "schedule",
        "cancel",
        "reschedule",
        "release",
        "high",
        "normal",
        "low",
        "queue",
        "skip",
    ] {
        // Each decodes as a value somewhere (an op, a priority, an if-busy policy).
        assert!(entries.contains(&word), "{word:?} missing from the dictionary");
    }
}
