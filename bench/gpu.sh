#!/usr/bin/env bash
# The GPU checks of issue 24 in one run, on a machine with a CUDA GPU (and NVRTC):
# the CUDA tests (none may skip), the two-process CUDA IPC test, the store's device
# tests, `gpu_store --bench` (local / shm-peer / tcp-peer replicas against pinned
# DMA and the host calls), `gpu_sweep` (NanoKvCache put/get against DtoD), and, when
# torch with CUDA imports, the Python drop-in on CUDA tensors (pytest, the
# `gpu_pointers.py` bench, `kv_connector.py --gpu`). Every output lands in OUT.
#
#   bash bench/gpu.sh [OUT]        # default bench/results/gpu-<date>
#
# Knobs: ITERS (20), MAX_SIZE (64 MiB), PYTHON (python3 with the wheel installed:
# `cd mooncake-py && maturin develop --release`). Exit status: 0 when every step
# passed and no GPU test skipped, else 1 (the failing steps are listed at the end).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${1:-bench/results/gpu-$(date -u +%F)}"
ITERS="${ITERS:-20}"
MAX_SIZE="${MAX_SIZE:-67108864}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
failed=()
step() { # step NAME COMMAND... : runs it, its output in OUT/NAME.txt
    local name="$1"
    shift
    echo "== $name"
    if ! "$@" >"$OUT/$name.txt" 2>&1; then
        failed+=("$name")
        tail -20 "$OUT/$name.txt"
    fi
}
nvidia-smi -L >"$OUT/device.txt" 2>&1 || echo "no nvidia-smi" >"$OUT/device.txt"
step gpu-tests cargo test --release -p mooncake-gpu -- --nocapture
step store-device-tests cargo test --release -p tests --test gpu_store -- --nocapture
if grep -h "skipping" "$OUT/gpu-tests.txt" "$OUT/store-device-tests.txt"; then
    failed+=("GPU tests skipped on a GPU machine")
fi
step gpu-store-bench cargo run --release --example gpu_store -- --bench --iters "$ITERS" --max-size "$MAX_SIZE"
step gpu-sweep cargo run --release -p mooncake-gpu --example gpu_sweep -- --iters "$ITERS"
step gpu-sweep-staging cargo run --release -p mooncake-gpu --example gpu_sweep -- --staging --iters "$ITERS"
if "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    cargo build --release -p mooncake-cli --bins >"$OUT/build-cli.txt" 2>&1 || failed+=("build-cli")
    export MOONCAKE_MASTER="${CARGO_TARGET_DIR:-$ROOT/target}/release/mooncake-master"
    step py-gpu-tests "$PYTHON" -m pytest -q -rs mooncake-py/tests/test_gpu.py
    grep -q "skipped" "$OUT/py-gpu-tests.txt" && failed+=("torch CUDA test skipped")
    step py-gpu-pointers "$PYTHON" mooncake-py/bench/gpu_pointers.py --master-bin "$MOONCAKE_MASTER" --iters "$ITERS"
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
