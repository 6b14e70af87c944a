#!/usr/bin/env bash
# Builds what `bench/gpu.sh` runs and lays it out, stripped, in DIR, for a GPU
# machine without Rust (`BUILT=DIR bash bench/gpu.sh`): the CUDA test binaries
# of mooncake-gpu (its unit tests too) and tests/gpu_store, the gpu_store and gpu_sweep examples,
# mooncake-master and mooncake-client, and the Python wheel (abi3, so any Python
# 3.9+ there takes it). The binaries load the CUDA driver and NVRTC at run time,
# so they build on a machine without either.
#
#   bash bench/gpu-pack.sh DIR        # needs maturin on PATH for the wheel
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
[ -n "${1:-}" ] || { echo "usage: gpu-pack.sh DIR" >&2; exit 1; }
rm -rf "$1"
mkdir -p "$1/release/deps" "$1/release/examples"
DIR="$(cd "$1" && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
cargo test --release --no-run --message-format=json-render-diagnostics \
    -p mooncake-gpu --test cuda --test device_memory --test eviction_watchdog --test round_trips --test ipc_two_process \
    -p tests --test gpu_store \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 >"$DIR/tests.txt"
# mooncake-gpu's unit tests: the device sum's profile (`profile_device_sums`).
cargo test --release --no-run --message-format=json-render-diagnostics -p mooncake-gpu --lib \
    | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 >>"$DIR/tests.txt"
while read -r exe; do
    cp "$exe" "$DIR/release/deps/"
done <"$DIR/tests.txt"
rm "$DIR/tests.txt"
cargo build --release -p examples --example gpu_store -p mooncake-gpu --example gpu_sweep -p mooncake-cli --bins
cp "$TARGET/release/examples/gpu_store" "$TARGET/release/examples/gpu_sweep" "$DIR/release/examples/"
cp "$TARGET/release/mooncake-master" "$TARGET/release/mooncake-client" "$DIR/release/"
(cd mooncake-py && maturin build --release --strip -q -o "$DIR")
find "$DIR/release" -type f -executable -exec strip {} +
du -sh "$DIR"
