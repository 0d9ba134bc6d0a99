//! The test broker: Apache Kafka in KRaft mode, one or more JVM processes on
//! 127.0.0.1, each node broker and controller at once, as
//! `docker-compose.yml` runs it, made quick for tests (no initial rebalance
//! delay, internal topics of one partition, a small heap and few threads,
//! a cleaner that looks every second, consumer-protocol groups allowed the
//! 6 s sessions classic groups are). Compaction, default session timeouts
//! and fsync behaviour are Kafka's own.
//!
//! The jars come from `scripts/install-broker.sh` (`$KAIROS_KAFKA_HOME`,
//! else its cache directory). With `KAIROS_TEST_BROKERS=host:port` set, the
//! shared broker is that running cluster instead, and tests that kill or
//! restart a broker fail with a message saying they need the jars.
//!
//! Every node runs under a watchdog shell that kills it (SIGKILL) when the
//! pipe from the test process closes: when the `Broker` is dropped, and
//! also when the test process dies in any way.

use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer as _};

use super::free_port;

/// The Kafka version the install script fetches and compose runs.
pub const KAFKA_VERSION: &str = "4.1.1";

/// Any valid KRaft cluster id will do: each test cluster has its own
/// directories and ports.
const CLUSTER_ID: &str = "5L6g3nShT-eMCtK--X86sw";

/// The one user of the brokers' SASL listener (mechanism PLAIN).
pub const SASL_USER: &str = "kairos";
/// Its password.
pub const SASL_PASSWORD: &str = "kairos-test-secret";

/// The password of the brokers' TLS key store.
const TLS_STORE_PASSWORD: &str = "kairos-test-store";

/// The broker's own logging: INFO to the node's `broker.log`.
const LOG4J2: &str = "\
status = error
appender.file.type = Console
appender.file.name = OUT
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = OUT
logger.state.name = state.change.logger
logger.state.level = WARN
";

/// Where the install script put Kafka: `$KAIROS_KAFKA_HOME`, else its cache.
pub fn kafka_home() -> PathBuf {
    if let Ok(p) = std::env::var("KAIROS_KAFKA_HOME") {
        return PathBuf::from(p);
    }
    let cache = std::env::var("KAIROS_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let base = std::env::var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache"));
            base.join("kairos")
        });
    let home = cache.join(format!("kafka-{KAFKA_VERSION}"));
    assert!(
        home.join("complete").exists(),
        "Apache Kafka {KAFKA_VERSION} not found at {}: run ./scripts/test.sh (or scripts/install-broker.sh) \
         first, or point the tests at a running cluster with KAIROS_TEST_BROKERS=host:port",
        home.display()
    );
    home
}

/// The classpath of the broker's jars (also the Java example's).
pub fn kafka_classpath() -> String {
    format!("{}/libs/*", kafka_home().display())
}

/// One Kafka node: broker and controller in one process.
struct Node {
    id: usize,
    port: u16,
    controller_port: u16,
    /// A listener that authenticates clients (SASL_PLAINTEXT, PLAIN).
    sasl_port: u16,
    /// A listener that encrypts (TLS; the certificate in [`Broker::tls`]).
    tls_port: u16,
    /// server.properties, broker.log and data/.
    dir: PathBuf,
    /// `None` while killed.
    process: Option<Process>,
}

/// A node's watchdog shell and the pipe that keeps it alive.
struct Process {
    child: Child,
    lifeline: Option<ChildStdin>,
}

impl Process {
    fn stop(&mut self) {
        if let Some(mut l) = self.lifeline.take() {
            let _ = l.write_all(b"stop\n");
        }
        let _ = self.child.wait();
    }
}

/// A Kafka cluster on 127.0.0.1 (one node unless asked), stopped when
/// dropped; or a running cluster named by `KAIROS_TEST_BROKERS`.
pub struct Broker {
    nodes: Vec<Node>,
    /// `KAIROS_TEST_BROKERS`, when the cluster is not ours.
    external: Option<String>,
    /// Removed on drop when the broker made it itself.
    _root: Option<tempfile::TempDir>,
    /// The certificate of the TLS listeners, for clients to trust.
    ca: Option<PathBuf>,
}

impl Broker {
    /// The broker this test binary shares: started on first use, stopped
    /// when the test process exits (its data directory removed with it).
    /// Tests that share it use topic and group names of their own
    /// ([`super::unique`]). For a broker a test kills, see [`Broker::own`].
    pub fn shared() -> &'static Broker {
        static SHARED: OnceLock<Broker> = OnceLock::new();
        super::capture_logs();
        SHARED.get_or_init(|| {
            if let Ok(b) = std::env::var("KAIROS_TEST_BROKERS") {
                return Broker {
                    nodes: Vec::new(),
                    external: Some(b),
                    _root: None,
                    ca: None,
                };
            }
            let root = tempfile::Builder::new()
                .prefix("kairos-kafka")
                .tempdir()
                .expect("tempdir");
            // The watchdog removes the directory once the broker is gone:
            // a static is never dropped.
            Broker::launch(root.keep(), 1, true)
        })
    }

    /// A single-node broker of the test's own, in a temporary directory.
    pub fn own() -> Broker {
        Broker::cluster(1)
    }

    /// A cluster of `nodes` nodes of the test's own (each broker and
    /// controller; a majority keeps the quorum), in a temporary directory.
    pub fn cluster(nodes: usize) -> Broker {
        let root = tempfile::Builder::new()
            .prefix("kairos-kafka")
            .tempdir()
            .expect("tempdir");
        let mut b = Broker::launch(root.path().to_path_buf(), nodes, false);
        b._root = Some(root);
        b
    }

    /// A cluster of `nodes` nodes whose data lives in `root` (kept by the
    /// caller, e.g. to look at after a failure).
    pub fn cluster_in(root: &Path, nodes: usize) -> Broker {
        Broker::launch(root.to_path_buf(), nodes, false)
    }

    fn launch(root: PathBuf, n: usize, cleanup: bool) -> Broker {
        super::capture_logs();
        assert!(
            std::env::var_os("KAIROS_TEST_BROKERS").is_none(),
            "this test starts, kills and restarts brokers of its own: it needs Apache Kafka's jars \
             (scripts/install-broker.sh), not KAIROS_TEST_BROKERS"
        );
        let mut nodes: Vec<Node> = (0..n)
            .map(|i| Node {
                id: i + 1,
                port: free_port(),
                controller_port: free_port(),
                sasl_port: free_port(),
                tls_port: free_port(),
                dir: root.join(format!("node-{}", i + 1)),
                process: None,
            })
            .collect();
        let voters = nodes
            .iter()
            .map(|nd| format!("{}@127.0.0.1:{}", nd.id, nd.controller_port))
            .collect::<Vec<_>>()
            .join(",");
        let (store, ca) = tls_material(&root);
        for nd in &nodes {
            std::fs::create_dir_all(nd.dir.join("data")).expect("node dir");
            std::fs::write(
                nd.dir.join("server.properties"),
                properties(nd, n, &voters, &store),
            )
            .expect("server.properties");
            std::fs::write(nd.dir.join("log4j2.properties"), LOG4J2).expect("log4j2.properties");
        }
        // Format every node's log directory (one JVM each, side by side).
        let formats: Vec<_> = nodes
            .iter()
            .map(|nd| {
                let out = std::fs::File::create(nd.dir.join("format.log")).expect("format log");
                let mut c = java(nd);
                c.args(["kafka.tools.StorageTool", "format", "--ignore-formatted"])
                    .args(["-t", CLUSTER_ID, "-c"])
                    .arg(nd.dir.join("server.properties"))
                    .stdin(Stdio::null())
                    .stdout(out.try_clone().expect("format log"))
                    .stderr(out);
                (
                    nd.dir.clone(),
                    c.spawn().expect("spawn java (is a JDK 17+ installed?)"),
                )
            })
            .collect();
        for (dir, mut child) in formats {
            let status = child.wait().expect("format");
            assert!(
                status.success(),
                "formatting {} failed:\n{}",
                dir.display(),
                std::fs::read_to_string(dir.join("format.log")).unwrap_or_default()
            );
        }
        let cleanup_dir = cleanup.then(|| root.clone());
        for nd in &mut nodes {
            nd.process = Some(spawn(nd, cleanup_dir.as_deref()));
        }
        let b = Broker {
            nodes,
            external: None,
            _root: None,
            ca: Some(ca),
        };
        for i in 0..n {
            b.wait_ready(i, Duration::from_secs(60));
        }
        b
    }

    /// `host:port,...` for `bootstrap.servers`: every node.
    pub fn bootstrap(&self) -> String {
        if let Some(e) = &self.external {
            return e.clone();
        }
        self.nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `host:port,...` of the listener that authenticates clients with
    /// SASL (PLAIN, as [`SASL_USER`]); `None` for a cluster not ours.
    pub fn sasl_bootstrap(&self) -> Option<String> {
        if self.external.is_some() {
            return None;
        }
        let all: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.sasl_port))
            .collect();
        Some(all.join(","))
    }

    /// `host:port,...` of the TLS listener and the certificate file to
    /// trust (`ssl.ca.location`); `None` for a cluster not ours.
    pub fn tls(&self) -> Option<(String, PathBuf)> {
        let ca = self.ca.clone()?;
        let all: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.tls_port))
            .collect();
        Some((all.join(","), ca))
    }

    /// What the broker is, for a benchmark's or a test's report: "Apache
    /// Kafka 4.1.1 (KRaft, 1 node) at 127.0.0.1:PORT".
    pub fn describe(&self) -> String {
        match &self.external {
            Some(b) => format!("Kafka at {b} (KAIROS_TEST_BROKERS)"),
            None => format!(
                "Apache Kafka {KAFKA_VERSION} (KRaft, {} node{}) at {}",
                self.nodes.len(),
                if self.nodes.len() == 1 { "" } else { "s" },
                self.bootstrap()
            ),
        }
    }

    /// How many nodes the cluster has (0: not ours).
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Kill node `i` (0-based) with SIGKILL and wait until it is gone.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].process.take() {
            p.stop();
        }
    }

    /// Start node `i` again on its data and ports, and wait until it serves.
    pub fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].process.is_none(), "node {i} is running");
        self.nodes[i].process = Some(spawn(&self.nodes[i], None));
        self.wait_ready(i, Duration::from_secs(120));
    }

    /// The JVM process of node `i` (not its watchdog shell), while it runs.
    pub fn node_pid(&self, i: usize) -> Option<u32> {
        let props = self.nodes[i].dir.join("server.properties");
        let props = props.as_os_str().as_encoded_bytes();
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let mut args = cmd.split(|b| *b == 0);
            let java = args.next()?.ends_with(b"java");
            (java && args.any(|a| a == props)).then_some(pid)
        })
    }

    /// The node (0-based) leading `topic`'s partition `partition` now.
    pub fn leader_of(&self, topic: &str, partition: i32) -> Option<usize> {
        let p: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("metadata client");
        let md = p
            .client()
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .ok()?;
        let leader = md
            .topics()
            .first()?
            .partitions()
            .iter()
            .find(|x| x.id() == partition)?
            .leader();
        self.nodes.iter().position(|n| n.id as i32 == leader)
    }

    fn wait_ready(&self, i: usize, timeout: Duration) {
        let nd = &self.nodes[i];
        let deadline = Instant::now() + timeout;
        // The client port opens once the broker has caught up with the
        // cluster's metadata and serves.
        while TcpStream::connect(("127.0.0.1", nd.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "Kafka node {} did not listen on port {} within {timeout:?}; log:\n{}",
                nd.id,
                nd.port,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let p: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", format!("127.0.0.1:{}", nd.port))
            .create()
            .expect("probe client");
        let left = deadline.saturating_duration_since(Instant::now());
        p.client().fetch_metadata(None, left).unwrap_or_else(|e| {
            panic!(
                "Kafka node {} not answering metadata: {e}; log:\n{}",
                nd.id,
                self.log()
            )
        });
    }

    /// The end of each node's log so far (for failure messages).
    pub fn log(&self) -> String {
        let mut out = String::new();
        for n in &self.nodes {
            let log = std::fs::read_to_string(n.dir.join("broker.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            out.push_str(&format!("--- node {} ({}):\n", n.id, n.dir.display()));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// A configuration pointing at this broker, with topic names unique to
    /// this test and small partition counts.
    pub fn config(&self) -> kairos::Config {
        let mut cfg = kairos::Config::default();
        cfg.kafka.brokers = self.bootstrap();
        cfg.kafka.produce_timeout = Duration::from_secs(10);
        super::fresh_topics(&mut cfg);
        cfg
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut p) = n.process.take() {
                p.stop();
            }
        }
    }
}

/// A JDK tool (`java`, `keytool`): `JAVA_HOME`'s, else the one on the path.
fn jdk_tool(name: &str) -> PathBuf {
    std::env::var_os("JAVA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join(name))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// `java` with the broker's JVM settings (Kafka's own performance options,
/// a small heap) and its jars, for node `nd`.
fn java(nd: &Node) -> Command {
    let mut c = Command::new(jdk_tool("java"));
    c.args(["-Xms128m", "-Xmx512m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"])
        .args([
            "-XX:InitiatingHeapOccupancyPercent=35",
            "-XX:+ExplicitGCInvokesConcurrent",
        ])
        .arg("-Djava.awt.headless=true")
        .arg(format!(
            "-Dlog4j2.configurationFile={}",
            nd.dir.join("log4j2.properties").display()
        ))
        .arg("-cp")
        .arg(kafka_classpath());
    c
}

/// Start node `nd` under its watchdog; with `cleanup`, the watchdog removes
/// that directory after the broker is gone.
fn spawn(nd: &Node, cleanup: Option<&Path>) -> Process {
    // The watchdog: run the broker in the background; when our end of its
    // stdin closes (we dropped the Broker, or this test process died in any
    // way, SIGKILL included), kill the broker.
    let script = r#"
        exec 3<&0
        "$@" </dev/null >>"$BROKER_LOG" 2>&1 &
        b=$!
        ( read -r _ <&3; kill -9 "$b" 2>/dev/null ) &
        w=$!
        wait "$b"
        kill "$w" 2>/dev/null
        if [ -n "$BROKER_CLEANUP" ]; then rm -rf "$BROKER_CLEANUP"; fi
    "#;
    let jvm = java(nd);
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(script)
        .arg("kafka")
        .arg(jvm.get_program())
        .args(jvm.get_args())
        .arg("kafka.Kafka")
        .arg(nd.dir.join("server.properties"))
        .env("BROKER_LOG", nd.dir.join("broker.log"))
        .env(
            "BROKER_CLEANUP",
            cleanup.map(|p| p.as_os_str().to_owned()).unwrap_or_default(),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn broker");
    let lifeline = child.stdin.take();
    Process { child, lifeline }
}

/// A key store for the brokers' TLS listeners (a self-signed certificate
/// for 127.0.0.1, valid two days) and that certificate in PEM for clients
/// to trust, made in `root` with the JDK's keytool.
fn tls_material(root: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(root).expect("broker root");
    let (store, ca) = (root.join("broker.p12"), root.join("ca.pem"));
    let pw = TLS_STORE_PASSWORD;
    let generate = [
        "-genkeypair",
        "-keyalg",
        "RSA",
        "-keysize",
        "2048",
        "-validity",
        "2",
        "-dname",
        "CN=127.0.0.1",
        "-ext",
        "SAN=IP:127.0.0.1",
        "-storetype",
        "PKCS12",
        "-keypass",
        pw,
    ];
    let export = ["-exportcert", "-rfc", "-file", ca.to_str().expect("UTF-8 path")];
    for step in [&generate[..], &export[..]] {
        let out = Command::new(jdk_tool("keytool"))
            .args(step)
            .args(["-alias", "broker", "-storepass", pw, "-noprompt", "-keystore"])
            .arg(&store)
            .output()
            .expect("run keytool (a JDK 17+ is needed)");
        assert!(
            out.status.success(),
            "keytool: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    (store, ca)
}

/// `server.properties` of node `nd` in a cluster of `n` nodes.
fn properties(nd: &Node, n: usize, voters: &str, store: &Path) -> String {
    let min_isr = n.min(2);
    format!(
        "\
process.roles=broker,controller
node.id={id}
controller.quorum.voters={voters}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport},SASL_PLAINTEXT://127.0.0.1:{sport},SSL://127.0.0.1:{tport}
advertised.listeners=PLAINTEXT://127.0.0.1:{port},SASL_PLAINTEXT://127.0.0.1:{sport},SSL://127.0.0.1:{tport}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL
listener.name.ssl.ssl.keystore.type=PKCS12
listener.name.ssl.ssl.keystore.location={store}
listener.name.ssl.ssl.keystore.password={pw}
listener.name.ssl.ssl.key.password={pw}
sasl.enabled.mechanisms=PLAIN
listener.name.sasl_plaintext.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_{user}=\"{password}\";
log.dirs={data}
auto.create.topics.enable=false
num.partitions=1
default.replication.factor={n}
offsets.topic.num.partitions=1
offsets.topic.replication.factor={n}
transaction.state.log.num.partitions=1
transaction.state.log.replication.factor={n}
transaction.state.log.min.isr={min_isr}
share.coordinator.state.topic.num.partitions=1
share.coordinator.state.topic.replication.factor={n}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
group.consumer.min.session.timeout.ms=6000
group.consumer.min.heartbeat.interval.ms=500
num.network.threads=2
num.io.threads=4
background.threads=4
num.recovery.threads.per.data.dir=1
log.cleaner.dedupe.buffer.size=8388608
log.cleaner.backoff.ms=1000
",
        id = nd.id,
        port = nd.port,
        cport = nd.controller_port,
        sport = nd.sasl_port,
        tport = nd.tls_port,
        store = store.display(),
        pw = TLS_STORE_PASSWORD,
        user = SASL_USER,
        password = SASL_PASSWORD,
        data = nd.dir.join("data").display(),
    )
}
