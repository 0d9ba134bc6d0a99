#!/usr/bin/env bash
# The test command: installs what is missing (Apache Kafka from Maven
# Central, Debian's docker-compose and chromium, two Python packages), then
# checks formatting and lints, runs the unit, integration and crash tests
# against Apache Kafka, fuzzes record decoding and config parsing briefly,
# and validates the compose file. Run from anywhere: ./scripts/test.sh
#
# KAIROS_TEST_BROKERS=host:9092 runs the tests against a Kafka cluster that
# is already running instead (no JDK or Maven needed); the tests that kill
# and restart brokers need the jars and fail without them.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "test broker"
if [ -n "${KAIROS_TEST_BROKERS:-}" ] && ! command -v mvn >/dev/null; then
  echo "Kafka at $KAIROS_TEST_BROKERS (KAIROS_TEST_BROKERS); no Maven here to install one"
else
  KAIROS_KAFKA_HOME="$(scripts/install-broker.sh)"
  export KAIROS_KAFKA_HOME
  echo "Apache Kafka $(cat "$KAIROS_KAFKA_HOME/complete") in $KAIROS_KAFKA_HOME"
fi

apt_install() { # install Debian packages, as root or through sudo
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "$@" >/dev/null
}

step "tools"
command -v docker-compose >/dev/null || apt_install docker-compose
command -v docker-compose
# The foreign-client tests use Python's confluent-kafka (its wheel carries librdkafka).
python3 -c "import confluent_kafka" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check 'confluent-kafka==2.16.*'
python3 -c "import confluent_kafka; print('confluent-kafka', confluent_kafka.version())"
# The kcat line of docs/producers.md is run by the tests.
command -v kcat >/dev/null || apt_install kcat
kcat -V 2>&1 | head -1
# The dashboard test drives Debian's Chromium over the DevTools protocol.
command -v chromium >/dev/null || apt_install chromium
python3 -c "import websocket" 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check 'websocket-client==1.*'
chromium --version

# The dependency audit (licenses, banned and duplicate crates, sources).
command -v cargo-deny >/dev/null || cargo install --locked --quiet cargo-deny --version '~0.20'
cargo deny --version

step "format"
cargo fmt --all -- --check
# The fuzz crate is a workspace of its own (fuzz/), outside `--all`.
rustfmt --edition 2021 --check fuzz/fuzz_targets/*.rs

step "lint"
cargo clippy --all-targets --locked -- -D warnings

step "dependencies"
# Licenses, bans and sources from the lockfile (deny.toml). The advisory
# check needs the RustSec database from GitHub: run where it is reachable.
cargo deny --log-level error check bans licenses sources
if timeout 10 git ls-remote -q https://github.com/rustsec/advisory-db HEAD >/dev/null 2>&1; then
  cargo deny --log-level error check advisories
else
  echo "advisories: github.com unreachable from here, the RustSec database not fetched; not checked"
fi

step "minimum Rust"
# The rust-version in Cargo.toml is the one the Dockerfile builds with, and
# the lockfile builds with it (its own target directory, so the main build
# stays warm).
msrv="$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)"
grep -q "^FROM rust:${msrv}-" Dockerfile || { echo "Dockerfile does not build with rust ${msrv}"; exit 1; }
rustup toolchain list | grep -q "^${msrv}" || rustup toolchain install "${msrv}" --profile minimal
CARGO_TARGET_DIR=target/msrv cargo "+${msrv}" check --locked --quiet --lib --bins
echo "builds with rust ${msrv}"

step "tests"
# Unit, integration (incl. the crash suite) and doc tests. The benchmarks are
# not run here (they take minutes to hours; see BENCHMARKS.md), only compiled
# by the lint step above.
# A test that hangs fails the run instead of stalling it (the whole suite
# takes about 20 minutes here).
if [ -n "${KAIROS_KAFKA_HOME:-}" ]; then
  timeout --kill-after=30s 40m cargo test --lib --bins --tests --locked
else
  # Against KAIROS_TEST_BROKERS, without Kafka's jars: the crash suite starts,
  # kills and restarts brokers of its own, and the Java client compiles
  # against the jars; both are left out, and said so.
  echo "left out without Kafka's jars: tests/crash.rs and the tests of the Java client (names with 'java')"
  timeout --kill-after=30s 40m cargo test --lib --bins --locked \
    --test integration --test fair --test keys --test worker_processes --test modules --test links -- --skip java
fi
timeout --kill-after=30s 10m cargo test --doc --locked

step "package"
# The crate as `cargo publish` would upload it (Cargo.toml's include list)
# builds on its own, and carries no tests, benches or scripts.
timeout --kill-after=30s 20m cargo package --locked --allow-dirty --quiet
if cargo package --list --locked --allow-dirty 2>/dev/null | grep -E '^(tests|benches|fuzz|scripts)/'; then
  echo "the package carries test or bench files"; exit 1
fi
echo "cargo package: $(cargo package --list --locked --allow-dirty 2>/dev/null | wc -l) files"

step "fuzz"
# Record decoding and config parsing, 20 s per target from the seed corpus
# (the first run also builds the fuzz targets, a few minutes; cached after).
# Longer on demand: scripts/fuzz.sh 600
scripts/fuzz.sh 20

step "compose file"
docker-compose -f docker-compose.yml config -q
echo "docker-compose.yml is valid"
