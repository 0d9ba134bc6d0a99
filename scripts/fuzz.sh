#!/usr/bin/env bash
# Fuzz record decoding and config parsing (cargo-fuzz, libFuzzer): run each
# target in fuzz/fuzz_targets/ for SECONDS (default 20), starting from the
# committed seed corpus in fuzz/corpus/<target>/. Fails if a target crashes
# (a panic, a failed invariant, a sanitizer report); the crashing input is
# saved in fuzz/artifacts/<target>/ and the output names the command that
# replays it.
#
#   scripts/fuzz.sh               # 20 s per target (the test command runs this)
#   scripts/fuzz.sh 600           # longer, on demand
#   scripts/fuzz.sh 60 decode_record
#
# cargo-fuzz needs a nightly toolchain: it is installed through rustup if
# missing. cargo-fuzz itself and the fuzz
# build (which compiles librdkafka again, with sanitizer flags: several
# minutes on 2 cores the first time) are cached outside the repository
# (default ~/.cache/kairos, KAIROS_CACHE_DIR moves it), so later runs only
# rebuild what changed. The fuzzer works on a copy of the corpus, so a run
# never writes into the repository except for crash artifacts.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS="${1:-20}"
shift || true
case "$SECS" in
  '' | *[!0-9]*) echo "usage: scripts/fuzz.sh [seconds] [target...]" >&2; exit 2 ;;
esac

CARGO_FUZZ_VERSION=0.13.2
CACHE="${KAIROS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kairos}"
TOOLS="$CACHE/cargo-fuzz-$CARGO_FUZZ_VERSION"
TARGET_DIR="$CACHE/fuzz-target"
mkdir -p "$CACHE"

if ! rustc +nightly --version >/dev/null 2>&1; then
  echo "fuzz: no nightly toolchain; installing one" >&2
  rustup toolchain install nightly --profile minimal >&2
fi

if [ ! -x "$TOOLS/bin/cargo-fuzz" ]; then
  echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS (about a minute, once)" >&2
  cargo +nightly install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$TOOLS" >&2
fi
export PATH="$TOOLS/bin:$PATH"

if [ "$#" -gt 0 ]; then
  TARGETS=("$@")
else
  TARGETS=()
  for f in fuzz/fuzz_targets/*.rs; do
    TARGETS+=("$(basename "$f" .rs)")
  done
fi

# fuzz/Cargo.lock pins the fuzz crate's dependencies, the main crate's
# included (same versions as ./Cargo.lock). A dependency added to the main
# crate makes it stale; cargo fuzz has no --locked, so say so and let cargo
# add what is missing (keeping every version it has).
if ! cargo +nightly metadata --locked --format-version 1 --manifest-path fuzz/Cargo.toml \
  >/dev/null 2>&1; then
  echo "fuzz: fuzz/Cargo.lock is out of date with Cargo.toml; updating it (commit the change)" >&2
  cargo +nightly metadata --format-version 1 --manifest-path fuzz/Cargo.toml >/dev/null
fi

# A release build with debug assertions and overflow checks (cargo fuzz's
# default), without a sanitizer: with address sanitizer, the cc crate builds
# zstd-sys instrumented and librdkafka's configure step (rdkafka-sys) then
# fails to link its probe programs against it (undefined `__asan_*`). The
# code under test is safe Rust (`#![forbid(unsafe_code)]`), so panics, failed
# assertions and overflow checks are what the fuzzer is after.
FUZZ_FLAGS=(--fuzz-dir fuzz --target-dir "$TARGET_DIR" --sanitizer none)
start=$(date +%s)
if [ "${#TARGETS[@]}" -eq 1 ]; then
  cargo +nightly fuzz build "${FUZZ_FLAGS[@]}" "${TARGETS[0]}"
else
  cargo +nightly fuzz build "${FUZZ_FLAGS[@]}"
fi
echo "fuzz: build took $(($(date +%s) - start)) s" >&2

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
failed=()
for t in "${TARGETS[@]}"; do
  echo "fuzz: $t for $SECS s" >&2
  mkdir -p "$WORK/$t"
  [ -d "fuzz/corpus/$t" ] && cp -R "fuzz/corpus/$t/." "$WORK/$t/"
  args=(-max_total_time="$SECS" -timeout=10 -print_final_stats=1)
  [ -f "fuzz/$t.dict" ] && args+=(-dict="fuzz/$t.dict")
  if cargo +nightly fuzz run "${FUZZ_FLAGS[@]}" "$t" "$WORK/$t" -- "${args[@]}" >"$WORK/$t.log" 2>&1; then
    # "Done 123456 runs in 20 second(s)", then the final stats.
    grep -E '^Done [0-9]+ runs|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
      "$WORK/$t.log" | sed "s/^/fuzz: $t: /" >&2
    echo "fuzz: $t: corpus $(find "$WORK/$t" -type f | wc -l) inputs, 0 crashes" >&2
  else
    # The log without libFuzzer's progress lines: the panic or report, the
    # input, and the commands that replay and minimise it.
    { grep -Ev '^#[0-9]+[[:space:]]' "$WORK/$t.log" || true; } | tail -n 150 >&2
    if grep -q 'failed to build fuzz script' "$WORK/$t.log"; then
      # cargo fuzz run rebuilds first: sources changed under a running fuzz.
      echo "fuzz: $t FAILED to build (did the sources change during the run?)" >&2
    else
      echo "fuzz: $t FAILED (the crashing input is in fuzz/artifacts/$t/)" >&2
    fi
    failed+=("$t")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
