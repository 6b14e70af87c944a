#!/usr/bin/env python3
"""The Python drop-in with GPU pointers: `put_from` / `get_into` and the multi-buffer
batch forms on CUDA tensors (registered by `data_ptr()`, as vLLM does), timed per
object size, one JSON document out.

The replicas are in the client's own segment: with `--protocol shm` (the default)
mapped, as in the `own_remote_master` rows of
`cargo run --release --example gpu_store -- --bench`;
with `--protocol tcp` reached over loopback TCP, as in its `tcp_peer` rows. Its master
is a `mooncake-master` process (puts pay two master round trips that the `local` rows'
embedded master does not): the same as the `own_master_process` rows of
`gpu_store --bench --master-bin PATH`, which is what the figures are compared with
(target: within 10 % of the Rust device API; `compare_gpu.py` takes both documents).
Each row has mean throughputs and the median call of `put_from` / `get_into`.

    python gpu_pointers.py [--master-bin target/release/mooncake-master] [--iters 20]
        [--max-size BYTES] [--protocol shm|tcp] [--emulate]

Without torch and a CUDA device it exits 2 and says so. `--emulate` runs the same
calls over host memory declared to the store as GPU memory (a test of this script and
of the binding's device path, not a GPU result).
"""

import argparse
import ctypes
import json
import os
import pathlib
import subprocess
import sys
import time

from mooncake_rs.store import MooncakeDistributedStore

MiB = 1 << 20


def start_master(binary):
    proc = subprocess.Popen([binary, "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"mooncake-master did not start: {line!r}")
    return proc, line.split()[-1]


class Cuda:
    """Device buffers as CUDA tensors."""

    def __init__(self, store, n, size):
        import torch

        self.torch = torch
        self.tensors = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(n)]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        torch.cuda.synchronize()

    def sync(self):
        self.torch.cuda.synchronize()


class Emulated:
    """Host buffers declared to the store as GPU memory."""

    def __init__(self, store, n, size):
        self.bufs = [(ctypes.c_ubyte * size)() for _ in range(n)]
        self.ptrs = [ctypes.addressof(b) for b in self.bufs]
        for p in self.ptrs:
            assert store._emulate_device_memory(p, size, 0) == 0

    def sync(self):
        pass


WARM_UP = 5


def timed(iters, call, undo=lambda i: None):
    """Seconds a call took: (mean, median), `undo` run after each outside the clock,
    after WARM_UP untimed calls (as `gpu_store`'s: the first device call page-locks the
    piece of the segment it moves through, the next few fill the staging pool, the
    streams and the room held ahead; every call here reuses the room of the one before)."""
    for w in range(WARM_UP):
        call(-1 - w)
        undo(-1 - w)
    each = []
    for i in range(iters):
        t = time.perf_counter()
        call(i)
        each.append(time.perf_counter() - t)
        undo(i)
    return sum(each) / iters, sorted(each)[iters // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = pathlib.Path(__file__).resolve().parents[2]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    ap.add_argument("--master-bin", default=str(target / "release" / "mooncake-master"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-size", type=int, default=64 * MiB)
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--protocol", default="shm",
                    help="the store's protocol: shm (its own segment mapped: compare with gpu_store's "
                         "local rows) or tcp (its own segment over loopback TCP: the tcp_peer rows)")
    a = ap.parse_args()
    if a.emulate:
        kind, device = Emulated, "host emulation (no GPU): a test of the script, not a GPU result"
    else:
        try:
            import torch

            if not torch.cuda.is_available():
                raise ImportError("torch finds no CUDA device")
        except ImportError as e:
            print(f"gpu_pointers: {e}; nothing to measure (exit 2)", file=sys.stderr)
            return 2
        kind, device = Cuda, torch.cuda.get_device_name()
    sizes = [s for s in (MiB, 4 * MiB, 16 * MiB, 64 * MiB) if s <= a.max_size] or [a.max_size]
    layers = 4
    proc, master = start_master(a.master_bin)
    try:
        store = MooncakeDistributedStore()
        segment = 6 * layers * max(sizes) + 64 * MiB
        assert store.setup("localhost", "P2PHANDSHAKE", segment, 16 * MiB, a.protocol, "", master) == 0
        # The segment page-locked whole before timing, as `gpu_store` does per row.
        store.page_lock_segments()
        rows = []
        keep = []  # emulated ranges stay declared until the store closes
        for size in sizes:
            mem = kind(store, 2 * layers, size)
            keep.append(mem)
            for p in mem.ptrs:
                assert store.register_buffer(p, size) == 0
            src, dst = mem.ptrs[:layers], mem.ptrs[layers:]
            key = lambda i: f"gpu/{size}/{i}"  # noqa: E731
            put = timed(a.iters, lambda i: store.put_from(key(i), src[0], size), lambda i: store.remove(key(i)))
            assert store.put_from("gpu/read", src[0], size) == 0
            get = timed(a.iters, lambda i: store.get_into("gpu/read", dst[0], size) == size or sys.exit(1))
            sizes_l = [[size] * layers]
            mput = timed(
                a.iters,
                lambda i: store.batch_put_from_multi_buffers([key(i)], [src], sizes_l) == [0] or sys.exit(1),
                lambda i: store.remove(key(i)),
            )
            assert store.batch_put_from_multi_buffers(["gpu/multi"], [src], sizes_l) == [0]
            mget = timed(
                a.iters,
                lambda i: store.batch_get_into_multi_buffers(["gpu/multi"], [dst], sizes_l) == [layers * size]
                or sys.exit(1),
            )
            mem.sync()
            store.remove_all(True)
            for p in mem.ptrs:
                store.unregister_buffer(p)
            gb = lambda n, s: round(n / s[0] / 1e9, 3)  # noqa: E731
            us = lambda s: round(s[1] * 1e6, 1)  # noqa: E731
            rows.append(
                {
                    "object_bytes": size,
                    "put_from_gbps": gb(size, put),
                    "get_into_gbps": gb(size, get),
                    "multi_put_gbps": gb(layers * size, mput),
                    "multi_get_gbps": gb(layers * size, mget),
                    "put_from_p50_us": us(put),
                    "get_into_p50_us": us(get),
                    "layers": layers,
                }
            )
        direct, staged = store._device_bytes()
        print(json.dumps({"bench": "gpu_pointers", "device": device, "protocol": a.protocol, "iters": a.iters, "rows": rows,
                          "device_direct_bytes": direct, "device_staged_bytes": staged}, indent=1))
        store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
