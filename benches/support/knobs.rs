//! Every environment setting a bench reads, in one place. A bench reads a
//! knob only through these functions, and each knob must be in [`KNOBS`]
//! (BENCHMARKS.md lists the same table), so that none goes unlisted.

/// Each knob, with the benches that read it and what it sets.
pub const KNOBS: &[(&str, &str, &str)] = &[
    (
        "KAIROS_BENCH_N",
        "all but fair_dispatch's memory case",
        "jobs per run (schedules: schedules held; or the first numeric argument)",
    ),
    (
        "KAIROS_BENCH_ONLY",
        "scheduler_e2e, fair_dispatch, worker_holds, schedules",
        "run one case (see each bench's doc)",
    ),
    (
        "KAIROS_BENCH_ROUNDS",
        "scheduler_e2e, fair_dispatch, scheduler_restart",
        "rounds per side",
    ),
    (
        "KAIROS_BENCH_DIR",
        "all that keep a store",
        "where stores and temporary files go (/tmp)",
    ),
    (
        "KAIROS_BENCH_RATE",
        "scheduler_e2e, schedules",
        "due jobs per second, or a comma-separated ladder (schedules: one rate)",
    ),
    (
        "KAIROS_BENCH_SECS",
        "scheduler_e2e, schedules",
        "seconds of run-ats per lateness run (10)",
    ),
    (
        "KAIROS_BENCH_LEAD_SECS",
        "scheduler_e2e",
        "durable round: run-at after the first write (20)",
    ),
    (
        "KAIROS_BENCH_LATENESS_LEAD_MS",
        "scheduler_e2e",
        "lateness: how far ahead jobs are written",
    ),
    (
        "KAIROS_BENCH_DURABLE_FIRST",
        "scheduler_e2e",
        "durable round: write every job before the scheduler starts",
    ),
    (
        "KAIROS_BENCH_DUMP",
        "scheduler_e2e",
        "write each job's lateness to this file",
    ),
    (
        "KAIROS_BENCH_INGEST_BATCH",
        "scheduler benches",
        "[scheduler] ingest_batch (2000)",
    ),
    (
        "KAIROS_BENCH_READ_AHEAD",
        "scheduler benches",
        "the scheduler consumer's queued.min.messages",
    ),
    (
        "KAIROS_BENCH_LINGER_MS",
        "scheduler benches",
        "the scheduler producer's linger.ms (5)",
    ),
    (
        "KAIROS_BENCH_EXACTLY_ONCE",
        "scheduler benches",
        "1: [scheduler] exactly_once (fire in Kafka transactions)",
    ),
    (
        "KAIROS_BENCH_APPLY_THREADS",
        "scheduler benches",
        "[scheduler] apply_threads (3)",
    ),
    (
        "KAIROS_BENCH_QUEUE_KBYTES",
        "scheduler benches",
        "the scheduler consumer's queued.max.messages.kbytes",
    ),
    (
        "KAIROS_BENCH_MEMBERSHIP",
        "scheduler_restart",
        "both (default), dynamic or static",
    ),
    (
        "KAIROS_BENCH_FLOODS",
        "fair_dispatch",
        "flood sizes of the delay case (100000,1000000)",
    ),
    (
        "KAIROS_BENCH_MEM_JOBS",
        "fair_dispatch",
        "memory case: fair jobs waiting (10,000,000)",
    ),
    (
        "KAIROS_BENCH_MEM_TENANTS",
        "fair_dispatch",
        "memory case: tenants (100,000)",
    ),
    (
        "KAIROS_BENCH_BACKLOG_TARGET",
        "fair_dispatch",
        "[fair] backlog_target (1000)",
    ),
    (
        "KAIROS_BENCH_BACKLOG_TIME_MS",
        "fair_dispatch",
        "[fair] backlog_time (300 ms)",
    ),
    (
        "KAIROS_BENCH_POLL_MS",
        "fair_dispatch",
        "[fair] poll_interval (30 ms)",
    ),
    (
        "KAIROS_BENCH_PLAIN_MAX_SECS",
        "fair_dispatch",
        "caps the plain topic's delay run",
    ),
    (
        "KAIROS_BENCH_WAIT_INGEST",
        "fair_dispatch",
        "1: the delay case waits for the flood to be ingested",
    ),
    (
        "KAIROS_BENCH_TIMEOUT_SECS",
        "fair_dispatch",
        "bounds every wait (3600)",
    ),
    (
        "KAIROS_BENCH_TRACE",
        "fair_dispatch",
        "print the throughput case's progress every 100 ms",
    ),
    (
        "KAIROS_BENCH_B_JOBS",
        "worker_throughput",
        "benchmark B's jobs (5,000)",
    ),
    (
        "KAIROS_BENCH_B_BASELINE",
        "worker_throughput",
        "benchmark B's baseline jobs (1,000)",
    ),
    (
        "KAIROS_BENCH_C_JOBS",
        "worker_throughput",
        "benchmark C's jobs (100,000)",
    ),
    (
        "KAIROS_BENCH_TIMELINE",
        "worker_throughput",
        "print B's handler starts per 50 ms",
    ),
    (
        "KAIROS_BENCH_WORKER_CONSUMER",
        "worker_throughput",
        "librdkafka settings for the worker's consumer (key=value,...)",
    ),
    ("KAIROS_BENCH_HELD", "worker_holds", "held keys (100,000)"),
    (
        "KAIROS_BENCH_FAILING_N",
        "worker_holds",
        "jobs of the failing-keys case (500,000)",
    ),
    (
        "KAIROS_BENCH_HOLDS_CHILD",
        "worker_holds",
        "internal: the child process's configuration",
    ),
    (
        "KAIROS_BENCH_HOLDS_CHILD_HOLD",
        "worker_holds",
        "internal: whether the child holds its keys",
    ),
];

fn listed(name: &str) -> &str {
    assert!(
        KNOBS.iter().any(|(n, _, _)| *n == name),
        "bench knob {name} is not in benches/support/knobs.rs"
    );
    name
}

/// The knob's text, if set.
pub fn text(name: &str) -> Option<String> {
    std::env::var(listed(name)).ok()
}

/// Whether the knob is set (to anything).
pub fn set(name: &str) -> bool {
    std::env::var_os(listed(name)).is_some()
}

/// The knob as a number (underscores allowed), or `None` when unset or not
/// a number.
pub fn number<T: std::str::FromStr>(name: &str) -> Option<T> {
    text(name).and_then(|v| v.trim().replace('_', "").parse().ok())
}

/// The knob as a number, or `default`.
pub fn u64_or(name: &str, default: u64) -> u64 {
    number(name).unwrap_or(default)
}

/// The knob as comma-separated positive numbers, or `default` when unset.
pub fn list_or(name: &str, default: &[u64]) -> Vec<u64> {
    match text(name) {
        Some(v) => v
            .split(',')
            .filter_map(|x| x.trim().replace('_', "").parse().ok())
            .filter(|x| *x > 0)
            .collect(),
        None => default.to_vec(),
    }
}
