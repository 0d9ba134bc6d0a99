#!/usr/bin/env bash
# Install the test broker, nisshi (a Kafka-protocol broker in Rust, formerly
# tansu), if it is not cached yet, and print the path of its binary.
#
# The build takes about 15 minutes on 2 cores, so the binary and the build
# directory are cached outside the repository (default ~/.cache/kairos) where
# a fresh clone, CI and later runs find them. nisshi needs rustc 1.96 or
# newer: the stable toolchain is used when it is new enough, else nightly.
set -euo pipefail

VERSION=0.8.1
# dynostore: the in-memory engine; libsql: the durable sqlite engine used by
# the broker-restart tests.
FEATURES=dynostore,libsql
CACHE="${KAIROS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kairos}"
ROOT="$CACHE/nisshi-$VERSION"
BIN="$ROOT/bin/nisshi"

if [ -x "$BIN" ]; then
  echo "$BIN"
  exit 0
fi

toolchain_ok() { # $1: rustc --version output
  local v major minor
  v=$(echo "$1" | awk '{print $2}')
  major=${v%%.*}; minor=${v#*.}; minor=${minor%%.*}
  [ "$major" -gt 1 ] || [ "$minor" -ge 96 ]
}

TC=()
if toolchain_ok "$(rustc --version)"; then
  TC=()
elif rustc +nightly --version >/dev/null 2>&1 && toolchain_ok "$(rustc +nightly --version)"; then
  TC=(+nightly)
else
  echo "install-broker: rustc $(rustc --version) is older than 1.96; installing a nightly toolchain" >&2
  rustup toolchain install nightly --profile minimal >&2
  TC=(+nightly)
fi

mkdir -p "$CACHE"
echo "install-broker: building nisshi $VERSION into $ROOT (about 15 minutes on 2 cores, once)" >&2
CARGO_TARGET_DIR="$CACHE/nisshi-target" cargo "${TC[@]}" install nisshi \
  --version "$VERSION" --locked --no-default-features --features "$FEATURES" \
  --root "$ROOT" >&2
echo "$BIN"
