//! Shared by the scheduler benches: a deterministic job generator, a
//! process's memory from `/proc/PID/status`, and a throwaway `redis-server`
//! spoken to in raw RESP (no client crate needed). Every bench that includes
//! it runs on the `kairos` binary's allocator (mimalloc, also serving
//! librdkafka's mallocs), so that what runs in-process runs as it does there.
#![allow(dead_code)] // each bench uses its own subset

pub mod knobs;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chrono::{TimeZone, Utc};
use kairos::scheduler::store::Change;
use kairos::scheduler::stored::StoredJob;
use kairos::{Job, JobId};
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

/// Schedule partitions the jobs are spread over.
pub const PARTITIONS: i32 = 6;
/// Payload size of every generated job.
pub const PAYLOAD_BYTES: usize = 100;
/// sled page cache, as `cache_capacity` in config/scheduler.toml (16 MiB).
pub const CACHE_BYTES: u64 = 16 << 20;
/// Jobs per ingest batch (one fsync each), as `ingest_batch`.
pub const INGEST_BATCH: usize = 2000;
/// Jobs per fire batch, as `fire_batch`.
pub const FIRE_BATCH: usize = 1000;
/// The timer wheel's span and capacity, as `window` and `window_capacity`.
pub const WHEEL_SPAN_MS: i64 = 60_000;
pub const WHEEL_CAPACITY: usize = 100_000;
/// Sorted set holding the jobs in the Redis baseline.
pub const ZKEY: &[u8] = b"kairos:due";

pub const MIB: f64 = 1024.0 * 1024.0;

/// N from the first numeric argument (`cargo bench --bench X -- 1000000`;
/// underscores allowed), else from `$KAIROS_BENCH_N`, else `default`.
/// Non-numeric arguments (cargo passes `--bench`) are ignored.
pub fn job_count(default: u64) -> u64 {
    let parse = |s: &str| s.replace('_', "").parse::<u64>().ok();
    std::env::args()
        .skip(1)
        .find_map(|a| parse(&a))
        .or_else(|| knobs::number("KAIROS_BENCH_N"))
        .unwrap_or(default)
        .max(1)
}

/// A fresh temporary directory under `$KAIROS_BENCH_DIR` (else /tmp), removed on drop.
pub fn bench_dir(prefix: &str) -> tempfile::TempDir {
    let base = knobs::text("KAIROS_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    std::fs::create_dir_all(&base).expect("create bench base dir");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .expect("create bench temp dir")
}

/// Milliseconds since the epoch, now.
pub fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

/// The benches' tokio runtime: two worker threads, one per core here.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Generates the same job sequence for a given seed: 36-character UUID keys,
/// 100-byte random payloads, run-at uniform over `[base_ms, base_ms + spread_ms)`,
/// partitions round-robin, per-partition arrival sequence numbers.
pub struct JobGen {
    rng: StdRng,
    base_ms: i64,
    spread_ms: i64,
    seqs: [u64; PARTITIONS as usize],
    made: u64,
}

impl JobGen {
    pub fn new(seed: u64, base_ms: i64, spread_ms: i64) -> Self {
        JobGen {
            rng: StdRng::seed_from_u64(seed),
            base_ms,
            spread_ms: spread_ms.max(1),
            seqs: [0; PARTITIONS as usize],
            made: 0,
        }
    }

    /// The next job and its schedule partition.
    pub fn next_job(&mut self) -> (i32, StoredJob) {
        let partition = (self.made % PARTITIONS as u64) as i32;
        self.made += 1;
        let run_at_ms = self.base_ms + self.rng.gen_range(0..self.spread_ms);
        let mut id_rand = [0u8; 10];
        self.rng.fill_bytes(&mut id_rand);
        let id =
            uuid::Builder::from_unix_timestamp_millis(self.base_ms as u64 + self.made, &id_rand).into_uuid();
        let mut key_rand = [0u8; 16];
        self.rng.fill_bytes(&mut key_rand);
        let key = uuid::Builder::from_random_bytes(key_rand)
            .into_uuid()
            .hyphenated()
            .to_string();
        let mut payload = vec![0u8; PAYLOAD_BYTES];
        self.rng.fill_bytes(&mut payload);
        let run_at = Utc
            .timestamp_millis_opt(run_at_ms)
            .single()
            .expect("run-at in range");
        let job = Job::new("jobs", key, payload).id(JobId::from(id)).at(run_at);
        let seq = &mut self.seqs[partition as usize];
        let stored = StoredJob { job, seq: *seq };
        *seq += 1;
        (partition, stored)
    }
}

/// Puts grouped by partition, as the scheduler's ingest applies a batch.
pub fn puts_by_partition(jobs: impl IntoIterator<Item = (i32, StoredJob)>) -> Vec<(i32, Vec<Change>)> {
    let mut by: Vec<Vec<Change>> = vec![Vec::new(); PARTITIONS as usize];
    for (p, s) in jobs {
        by[p as usize].push(Change::Put(s));
    }
    by.into_iter()
        .enumerate()
        .filter(|(_, c)| !c.is_empty())
        .map(|(p, c)| (p as i32, c))
        .collect()
}

/// The process's memory, from `/proc/self/status` (kB there, bytes here).
#[derive(Clone, Copy, Debug, Default)]
pub struct Mem {
    pub rss: u64,
    pub hwm: u64,
    pub anon: u64,
    pub file: u64,
}

pub fn mem() -> Mem {
    mem_from("/proc/self/status")
}

/// Another process's memory, from `/proc/PID/status` (all zero once it is gone).
pub fn mem_of(pid: u32) -> Mem {
    mem_from(&format!("/proc/{pid}/status"))
}

fn mem_from(path: &str) -> Mem {
    let status = std::fs::read_to_string(path).unwrap_or_default();
    let mut m = Mem::default();
    for line in status.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
        match name {
            "VmRSS" => m.rss = kb * 1024,
            "VmHWM" => m.hwm = kb * 1024,
            "RssAnon" => m.anon = kb * 1024,
            "RssFile" => m.file = kb * 1024,
            _ => {}
        }
    }
    m
}

pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB
}

/// Send `rec`, serving the producer's queue (polling `poll` at a time)
/// while it is full; any other error stops the bench.
pub fn send_queued<K, P>(
    producer: &rdkafka::producer::BaseProducer,
    mut rec: rdkafka::producer::BaseRecord<'_, K, P>,
    poll: Duration,
) where
    K: rdkafka::message::ToBytes + ?Sized,
    P: rdkafka::message::ToBytes + ?Sized,
{
    use rdkafka::error::KafkaError;
    use rdkafka::types::RDKafkaErrorCode;
    loop {
        match producer.send(rec) {
            Ok(()) => return,
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                rec = back;
                producer.poll(poll);
            }
            Err((e, back)) => panic!("producing to {}: {e}", back.topic),
        }
    }
}

/// A target's verdict, as every bench prints it.
pub fn pass(ok: bool) -> &'static str {
    if ok {
        "MET"
    } else {
        "NOT MET"
    }
}

/// A `redis-server` on 127.0.0.1 and a free port, killed on drop.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Start one with `--save '' --appendonly no` (no persistence), plus `extra` arguments.
    pub fn start(extra: &[&str]) -> io::Result<RedisServer> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let dir = bench_dir("kairos-bench-redis-");
        let mut args: Vec<String> = [
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            dir.path().to_str().expect("utf-8 temp path"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = Command::new("redis-server")
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot start redis-server ({e}); install it: apt-get install -y redis-server"),
                )
            })?;
        let mut server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = server.connect() {
                if c.call(&[b"PING"]).is_ok() {
                    return Ok(server);
                }
            }
            if let Some(status) = server.child.try_wait()? {
                return Err(io::Error::other(format!("redis-server exited: {status}")));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other("redis-server did not answer PING within 10s"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn connect(&self) -> io::Result<Resp> {
        let s = TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_nodelay(true)?;
        Ok(Resp {
            r: BufReader::with_capacity(1 << 20, s.try_clone()?),
            w: BufWriter::with_capacity(1 << 20, s),
        })
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A reply in RESP2.
#[derive(Debug)]
pub enum Reply {
    Status(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Option<Vec<Reply>>),
}

impl Reply {
    pub fn int(&self) -> i64 {
        match self {
            Reply::Int(n) => *n,
            other => panic!("expected an integer reply, got {other:?}"),
        }
    }

    pub fn bulk(self) -> Vec<u8> {
        match self {
            Reply::Bulk(Some(b)) => b,
            other => panic!("expected a bulk reply, got {other:?}"),
        }
    }

    /// The bulk strings of an array reply.
    pub fn bulks(self) -> Vec<Vec<u8>> {
        match self {
            Reply::Array(Some(items)) => items.into_iter().map(Reply::bulk).collect(),
            Reply::Array(None) => Vec::new(),
            other => panic!("expected an array reply, got {other:?}"),
        }
    }
}

/// A RESP connection. Commands are buffered until [`Resp::flush`], so
/// several can be sent before their replies are read (pipelining).
pub struct Resp {
    r: BufReader<TcpStream>,
    w: BufWriter<TcpStream>,
}

impl Resp {
    /// Start a command of `n` arguments (the command name counts).
    pub fn begin(&mut self, n: usize) -> io::Result<()> {
        write!(self.w, "*{n}\r\n")
    }

    /// One argument of the command begun.
    pub fn arg(&mut self, a: &[u8]) -> io::Result<()> {
        write!(self.w, "${}\r\n", a.len())?;
        self.w.write_all(a)?;
        self.w.write_all(b"\r\n")
    }

    /// Buffer a whole command.
    pub fn send(&mut self, args: &[&[u8]]) -> io::Result<()> {
        self.begin(args.len())?;
        for a in args {
            self.arg(a)?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// Read one reply; an error reply is an `Err`.
    pub fn read(&mut self) -> io::Result<Reply> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "redis closed the connection",
            ));
        }
        let line = line.trim_end_matches("\r\n");
        let (kind, rest) = line.split_at(1);
        let num = || {
            rest.parse::<i64>()
                .map_err(|_| io::Error::other(format!("bad RESP line {line:?}")))
        };
        Ok(match kind {
            "+" => Reply::Status(rest.to_string()),
            "-" => return Err(io::Error::other(format!("redis error: {rest}"))),
            ":" => Reply::Int(num()?),
            "$" => match num()? {
                n if n < 0 => Reply::Bulk(None),
                n => {
                    let mut buf = vec![0u8; n as usize + 2];
                    self.r.read_exact(&mut buf)?;
                    buf.truncate(n as usize);
                    Reply::Bulk(Some(buf))
                }
            },
            "*" => match num()? {
                n if n < 0 => Reply::Array(None),
                n => {
                    let mut items = Vec::with_capacity(n as usize);
                    for _ in 0..n {
                        items.push(self.read()?);
                    }
                    Reply::Array(Some(items))
                }
            },
            _ => return Err(io::Error::other(format!("bad RESP line {line:?}"))),
        })
    }

    /// Send one command and read its reply.
    pub fn call(&mut self, args: &[&[u8]]) -> io::Result<Reply> {
        self.send(args)?;
        self.flush()?;
        self.read()
    }

    /// `INFO <section>` as name → value.
    pub fn info(&mut self, section: &str) -> io::Result<HashMap<String, String>> {
        let text = self.call(&[b"INFO", section.as_bytes()])?.bulk();
        Ok(String::from_utf8_lossy(&text)
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect())
    }

    /// Buffer one variadic `ZADD key score member ...` of `items` (score = run-at ms).
    pub fn zadd(&mut self, key: &[u8], items: &[(i64, Vec<u8>)]) -> io::Result<()> {
        self.begin(2 + 2 * items.len())?;
        self.arg(b"ZADD")?;
        self.arg(key)?;
        for (score, member) in items {
            self.arg(score.to_string().as_bytes())?;
            self.arg(member)?;
        }
        Ok(())
    }
}

/// `ZADD`s `items` into [`ZKEY`] in commands of `batch` members, keeping up
/// to `window` commands in flight. Returns members added.
pub fn zadd_all(
    c: &mut Resp,
    items: impl Iterator<Item = (i64, Vec<u8>)>,
    batch: usize,
    window: usize,
) -> io::Result<u64> {
    let mut added = 0u64;
    let mut in_flight = 0usize;
    let mut buf = Vec::with_capacity(batch);
    let mut items = items.peekable();
    while items.peek().is_some() {
        buf.clear();
        buf.extend(items.by_ref().take(batch));
        c.zadd(ZKEY, &buf)?;
        in_flight += 1;
        if in_flight >= window {
            c.flush()?;
            added += c.read()?.int() as u64;
            in_flight -= 1;
        }
    }
    c.flush()?;
    for _ in 0..in_flight {
        added += c.read()?.int() as u64;
    }
    Ok(added)
}

/// The scheduler's settings a bench run may override, to compare them on
/// one machine: `KAIROS_BENCH_INGEST_BATCH` (`[scheduler] ingest_batch`,
/// 2000), `KAIROS_BENCH_READ_AHEAD` (its consumer's `queued.min.messages`,
/// librdkafka's default), `KAIROS_BENCH_LINGER_MS` (its producer's
/// `linger.ms`, 5), `KAIROS_BENCH_APPLY_THREADS` (`[scheduler]
/// apply_threads`, 3), `KAIROS_BENCH_EXACTLY_ONCE` (`[scheduler]
/// exactly_once`) and `KAIROS_BENCH_QUEUE_KBYTES` (its consumer's
/// `queued.max.messages.kbytes`, librdkafka's default). Apply to the
/// scheduler's configuration alone.
pub fn scheduler_knobs(cfg: &mut kairos::Config) {
    if let Some(n) = knobs::number("KAIROS_BENCH_INGEST_BATCH") {
        cfg.scheduler.ingest_batch = n;
    }
    if let Some(n) = knobs::text("KAIROS_BENCH_READ_AHEAD") {
        let v = n.as_str().into();
        cfg.kafka.consumer.insert("queued.min.messages".into(), v);
    }
    if let Some(n) = knobs::text("KAIROS_BENCH_LINGER_MS") {
        cfg.kafka.producer.insert("linger.ms".into(), n.as_str().into());
    }
    if let Some(n) = knobs::number("KAIROS_BENCH_APPLY_THREADS") {
        cfg.scheduler.apply_threads = n;
    }
    if knobs::set("KAIROS_BENCH_EXACTLY_ONCE") {
        cfg.scheduler.exactly_once = true;
    }
    if let Some(n) = knobs::text("KAIROS_BENCH_QUEUE_KBYTES") {
        let v = n.as_str().into();
        cfg.kafka.consumer.insert("queued.max.messages.kbytes".into(), v);
    }
}
