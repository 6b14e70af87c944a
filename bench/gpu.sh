#!/usr/bin/env bash
# The GPU checks of issue 24 in one run, on a machine with a CUDA GPU (and NVRTC):
# the CUDA tests (none may skip), the two-process CUDA IPC test, the store's device
# tests, `gpu_store --bench` (local / shm-peer / tcp-peer replicas against pinned
# DMA and the host calls, each row with its device put's and get's time phase by
# phase, `*_phases_us`; again with answer polling off, up to 16 MiB; again with
# master calls over loopback TCP, 4 and 16 MiB; the first device calls of a store
# with a 2 and an 8 GiB segment), `gpu_sweep` (NanoKvCache put/get
# against DtoD), and, when
# torch with CUDA imports, the Python drop-in on CUDA tensors (pytest, the
# `gpu_pointers.py` bench against `gpu_store`'s `own_master_process` rows, compared
# by `compare_gpu.py`; `kv_connector.py --gpu`), and the device checksum's
# profile (`profile_device_sums`). Every output lands in OUT.
#
#   bash bench/gpu.sh [OUT]        # default bench/results/gpu-<date>
#
# Knobs: ITERS (20), FIRST_CALL_SEGMENTS (segment sizes of the first-call steps), PY_ITERS (100: the Python steps and their Rust reference), MAX_SIZE (64 MiB), PYTHON (python3 with the wheel installed:
# `cd mooncake-py && maturin develop --release`), STEP_LIMIT (seconds one step may
# take, 300), PARTS (which parts run: "tests bench python", all by default; a
# machine lent for minutes can run them in separate calls). Exit status: 0 when every step passed and no GPU test skipped, else 1
# (the failing steps are listed at the end).
#
# Prebuilt mode, for a GPU machine without Rust: BUILT=DIR runs the binaries that
# `bench/gpu-pack.sh DIR` laid out (DIR/release/{deps,examples}/..., DIR/*.whl,
# installed into a scratch folder) instead of building them with cargo.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${1:-bench/results/gpu-$(date -u +%F)}"
ITERS="${ITERS:-20}"
# The Python-against-Rust comparison's iterations: more than the others, its
# medians decide a 10 % target.
PY_ITERS="${PY_ITERS:-100}"
MAX_SIZE="${MAX_SIZE:-67108864}"
PYTHON="${PYTHON:-python3}"
STEP_LIMIT="${STEP_LIMIT:-300}"
BUILT="${BUILT:-}"
PARTS=" ${PARTS:-tests bench python} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT"
failed=()
step() { # step NAME COMMAND... : runs it, its output in OUT/NAME.txt
    local name="$1"
    shift
    echo "== $name"
    if ! timeout "$STEP_LIMIT" bash -c '"$@"' step "$@" >"$OUT/$name.txt" 2>&1; then
        failed+=("$name")
        tail -20 "$OUT/$name.txt"
    fi
}
nvidia-smi -L >"$OUT/device.txt" 2>&1 || echo "no nvidia-smi" >"$OUT/device.txt"
# The test binaries of one test target each, prebuilt or by cargo.
tests_of() { # tests_of PACKAGE TARGET...
    local pkg="$1" t
    shift
    if [ -n "$BUILT" ]; then
        for t in "$@"; do
            "$BUILT"/release/deps/"$t"-* --nocapture --test-threads 1 || return 1
        done
    else
        cargo test --release -p "$pkg" $(printf -- '--test %s ' "$@") -- --nocapture --test-threads 1
    fi
}
example() { # example PACKAGE NAME ARGS...
    local pkg="$1" name="$2"
    shift 2
    if [ -n "$BUILT" ]; then
        "$BUILT/release/examples/$name" "$@"
    else
        cargo run --release -p "$pkg" --example "$name" -- "$@"
    fi
}
export -f tests_of example
if [ -n "$BUILT" ]; then
    BUILT="$(cd "$BUILT" && pwd)"
    export BUILT
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mooncake-site "$BUILT"/*.whl \
        && export PYTHONPATH="/tmp/mooncake-site${PYTHONPATH:+:$PYTHONPATH}"
    export MOONCAKE_MASTER="$BUILT/release/mooncake-master"
fi
if want tests; then
    step gpu-tests tests_of mooncake-gpu cuda device_memory eviction_watchdog round_trips
    step ipc-two-process tests_of mooncake-gpu ipc_two_process
    step store-device-tests tests_of tests gpu_store
    if grep -h "skipping" "$OUT/gpu-tests.txt" "$OUT/ipc-two-process.txt" "$OUT/store-device-tests.txt"; then
        failed+=("GPU tests skipped on a GPU machine")
    fi
fi
if want bench; then
    step gpu-store-bench example examples gpu_store --bench --iters "$ITERS" --max-size "$MAX_SIZE"
    # The same with answer polling off (MOONCAKE_SPIN_US=0), up to 16 MiB: what the
    # polling does to puts with a master daemon and to TCP, in the same run.
    step gpu-store-bench-nopoll bash -c 'MOONCAKE_SPIN_US=0 example "$@"' _ examples gpu_store --bench \
        --iters "$ITERS" --max-size $((MAX_SIZE < 16 << 20 ? MAX_SIZE : 16 << 20))
    # Master calls over loopback TCP (MOONCAKE_RPC_UNIX=0) against the default Unix
    # socket, 4 and 16 MiB, the placements with a master daemon: what the socket does
    # to device puts' two round trips, in the same run as the main bench.
    step gpu-store-bench-tcp-rpc bash -c 'MOONCAKE_RPC_UNIX=0 example "$@"' _ examples gpu_store --bench \
        --iters "$ITERS" --min-size $((4 << 20)) --max-size $((16 << 20)) --replicas own_remote_master,shm_peer
    # Device puts placed by a start before their DMA (MOONCAKE_PLACE_AHEAD=0) against
    # the default (room held ahead, bound beside the DMA), 1-16 MiB, with a master
    # daemon: what it does to the put's round trip before the DMA, in the same run.
    step gpu-store-bench-no-ahead bash -c 'MOONCAKE_PLACE_AHEAD=0 example "$@"' _ examples gpu_store --bench \
        --iters "$ITERS" --min-size $((1 << 20)) --max-size $((16 << 20)) --replicas own_remote_master,shm_peer
    step gpu-store-bench-ahead example examples gpu_store --bench \
        --iters "$ITERS" --min-size $((1 << 20)) --max-size $((16 << 20)) --replicas own_remote_master,shm_peer
    # The first device calls of a fresh store, its segment page-locked in pieces
    # (the default) and as one piece (as before pieces), with FIRST_CALL_SEGMENTS
    # (bytes; 2 and 8 GiB by default: 32 GiB takes a minute), and `page_lock_segments` after them.
    for seg in ${FIRST_CALL_SEGMENTS:-2147483648 8589934592}; do
        step "first-call-$seg" example examples gpu_store --first-call "$seg" --device 0
    done
    step gpu-sweep example mooncake-gpu gpu_sweep --iters "$ITERS"
    step gpu-sweep-staging example mooncake-gpu gpu_sweep --staging --iters "$ITERS"
    # Where a device checksum's time goes: its kernels with parts cut out.
    if [ -n "$BUILT" ]; then
        step crc-profile bash -c '"$BUILT"/release/deps/mooncake_gpu-* profile_device_sums --ignored --nocapture'
    else
        step crc-profile cargo test --release -p mooncake-gpu --lib -- profile_device_sums --ignored --nocapture
    fi
fi
if ! want python; then
    :
elif "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    if [ -z "$BUILT" ]; then
        cargo build --release -p mooncake-cli --bins >"$OUT/build-cli.txt" 2>&1 || failed+=("build-cli")
        export MOONCAKE_MASTER="${CARGO_TARGET_DIR:-$ROOT/target}/release/mooncake-master"
    fi
    step py-gpu-tests "$PYTHON" -m pytest -q -rs mooncake-py/tests/test_gpu.py
    grep -q "skipped" "$OUT/py-gpu-tests.txt" && failed+=("torch CUDA test skipped")
    step py-gpu-pointers "$PYTHON" mooncake-py/bench/gpu_pointers.py --master-bin "$MOONCAKE_MASTER" --iters "$PY_ITERS"
    # The Rust device API in the same placement, with the same master process, right
    # after; then Python over Rust per size (mean throughputs and median calls).
    step py-rust-reference example examples gpu_store --bench --iters "$PY_ITERS" --min-size $((1 << 20)) \
        --max-size "$MAX_SIZE" --replicas own_master_process --master-bin "$MOONCAKE_MASTER"
    step py-vs-rust "$PYTHON" mooncake-py/bench/compare_gpu.py "$OUT/py-gpu-pointers.txt" "$OUT/py-rust-reference.txt"
    step py-gpu-pointers-tcp "$PYTHON" mooncake-py/bench/gpu_pointers.py --master-bin "$MOONCAKE_MASTER" \
        --iters "$PY_ITERS" --protocol tcp
    step py-kv-connector "$PYTHON" examples/python/kv_connector.py --gpu
else
    echo "torch with CUDA does not import with $PYTHON: the Python GPU steps are skipped" | tee "$OUT/python.txt"
    failed+=("python GPU steps (no torch+CUDA)")
fi
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'failed or skipped: %s\n' "${failed[@]}"
    exit 1
fi
echo "all GPU checks passed; results in $OUT"
