//! An in-process development broker, so that `kairos demo` works on a
//! machine without Kafka.
//!
//! It is librdkafka's mock cluster: it starts in milliseconds, listens on
//! 127.0.0.1 (other processes can connect to it too), keeps everything in
//! memory and disappears with the process. It is for trying Kairos, not for
//! keeping jobs: nothing survives a restart, and consumer-group rebalances
//! are slow. Every real deployment and every integration test uses a real
//! Kafka-protocol broker.

use std::sync::mpsc;
use std::thread::JoinHandle;

use rdkafka::mocking::MockCluster;

use kairos::config::Config;

/// A running development broker; stops when dropped.
pub struct DevBroker {
    /// `host:port,...` to use as `kafka.brokers`.
    bootstrap: String,
    /// Dropping the sender tells the broker thread to stop.
    stop: Option<mpsc::Sender<()>>,
    /// The thread that owns the mock cluster (which must stay on one thread).
    thread: Option<JoinHandle<()>>,
}

/// Why the development broker did not start.
#[derive(Debug, thiserror::Error)]
#[error("development broker: {0}")]
pub struct DevBrokerError(String);

impl DevBroker {
    /// Start a one-node mock cluster with every topic of `config` created.
    pub fn start(config: &Config) -> Result<Self, DevBrokerError> {
        let topics = kairos::topics::planned(config);
        let (tx_addr, rx_addr) = mpsc::channel::<Result<String, String>>();
        let (tx_stop, rx_stop) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kairos-dev-broker".into())
            .spawn(move || {
                let cluster = match MockCluster::new(1) {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = tx_addr.send(Err(e.to_string()));
                        return;
                    }
                };
                for (name, partitions) in topics {
                    if let Err(e) = cluster.create_topic(&name, partitions, 1) {
                        let _ = tx_addr.send(Err(format!("creating topic {name}: {e}")));
                        return;
                    }
                }
                let _ = tx_addr.send(Ok(cluster.bootstrap_servers()));
                // Block until the handle is dropped (the sender hangs up).
                let _ = rx_stop.recv();
                drop(cluster);
            })
            .map_err(|e| DevBrokerError(e.to_string()))?;
        let bootstrap = rx_addr
            .recv()
            .map_err(|_| DevBrokerError("broker thread ended before starting".into()))?
            .map_err(DevBrokerError)?;
        Ok(DevBroker {
            bootstrap,
            stop: Some(tx_stop),
            thread: Some(thread),
        })
    }

    /// The bootstrap servers to connect to.
    pub fn bootstrap_servers(&self) -> &str {
        &self.bootstrap
    }
}

impl Drop for DevBroker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
