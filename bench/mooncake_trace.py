#!/usr/bin/env python3
"""Replays a Mooncake-format trace against the reference Mooncake Store, with the
rule and the output schema of `mooncake-bench trace` (bench/src/trace.rs).

Run it with the Python of a venv that has `mooncake-transfer-engine-non-cuda`
(bench/compare.sh makes one):

    $MC_VENV/bin/python bench/mooncake_trace.py --trace FILE --dram 256MiB \
        --bytes-per-token 128 --time-scale 20 --out trace_ref.json

It starts, on 127.0.0.1 only, the package's `mooncake_master` (same eviction
watermarks and read lease as ours: --eviction_high_watermark_ratio 0.95,
--eviction_ratio 0.05, --default_kv_lease_ttl = --lease-ms) and one owner process
that mounts the DRAM segment (`mc_bench.py owner` of ../shared/anchors/mooncake,
which pre-faults it); the replaying client mounts nothing, so every block crosses
TCP, as in our `--transport tcp` run. Requests are served in timestamp order at
timestamp / time-scale: blocks are fetched with `get_into` (registered buffer,
zero copy) until the first miss, the rest are written with `put_from`. Blocks carry
a 16-byte header (block id, run tag) that every fetch checks. Only processes
started here are stopped, by PID.
"""
import argparse
import ctypes
import json
import math
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ANCHOR = os.path.join(HERE, "..", "..", "shared", "anchors", "mooncake")


def parse_size(s):
    s = str(s).strip().upper().rstrip("B").rstrip("I")
    for suf, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if s.endswith(suf):
            return int(float(s[:-1]) * m)
    return int(s)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, proc, timeout=20.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready")


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def quantile(sorted_vals, q):
    """Value at quantile q (0..1) of a sorted list (nearest rank, as hdrhistogram)."""
    if not sorted_vals:
        return 0.0
    k = min(len(sorted_vals) - 1, max(0, int(math.ceil(q * len(sorted_vals))) - 1))
    return sorted_vals[k]


def lat_json(ns):
    v = sorted(ns)
    us = lambda q: quantile(v, q) / 1e3
    return {"count": len(v), "p50": us(0.5), "p90": us(0.9), "p99": us(0.99), "p999": us(0.999),
            "mean": (sum(v) / len(v) / 1e3) if v else 0.0, "max": (v[-1] / 1e3) if v else 0.0}


def cdf_points(ns):
    v = sorted(ns)
    qs = [i / 100 for i in range(100)] + [0.995, 0.999, 0.9999, 1.0]
    return [[quantile(v, q) / 1e3, q] for q in qs]


class Slab:
    """Anonymous mmap registered with the store (zero-copy source/destination)."""

    def __init__(self, store, size):
        self.mm = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        for off in range(0, size, 4096):
            self.mm[off] = 0
        if store.register_buffer(self.addr, size) != 0:
            raise RuntimeError("register_buffer failed")


def load_trace(path, max_requests):
    reqs = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            if max_requests and len(reqs) >= max_requests:
                break
            r = json.loads(line)
            reqs.append((float(r["timestamp"]), r["hash_ids"]))
    reqs.sort(key=lambda r: r[0])
    return reqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--bytes-per-token", type=int, default=128)
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--dram", default="256MiB")
    ap.add_argument("--max-requests", type=int, default=0)
    ap.add_argument("--lease-ms", type=int, default=100)
    ap.add_argument("--anchor", default=os.environ.get("ANCHOR", DEFAULT_ANCHOR))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import importlib.util
    from importlib.metadata import version
    from mooncake.store import MooncakeDistributedStore
    pkg = os.path.dirname(importlib.util.find_spec("mooncake").origin)
    block = a.block_tokens * a.bytes_per_token
    dram = parse_size(a.dram)
    reqs = load_trace(a.trace, a.max_requests)
    work = tempfile.mkdtemp(prefix="mctrace.")
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", MC_SEGMENT_SIZE=str(dram))
    master = owner = None
    try:
        rpc, metrics = free_port(), free_port()
        master = subprocess.Popen(
            [os.path.join(pkg, "mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--metrics_host=127.0.0.1", f"--metrics_port={metrics}", f"--default_kv_lease_ttl={a.lease_ms}",
             "--eviction_high_watermark_ratio=0.95", "--eviction_ratio=0.05"],
            stdout=open(os.path.join(work, "master.log"), "w"), stderr=subprocess.STDOUT, env=env)
        wait_port(rpc, master)
        addr = f"127.0.0.1:{rpc}"
        ready, stopf = os.path.join(work, "owner.ready"), os.path.join(work, "owner.stop")
        owner = subprocess.Popen(
            [sys.executable, os.path.join(a.anchor, "mc_bench.py"), "owner", "--master", addr,
             "--ready-file", ready, "--stop-file", stopf, "--max-seconds", "900"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, "owner.log"), "w"), env=env)
        t0 = time.time()
        while not os.path.exists(ready):
            if owner.poll() is not None or time.time() - t0 > 120:
                raise RuntimeError("owner did not start: see " + os.path.join(work, "owner.log"))
            time.sleep(0.1)

        store = MooncakeDistributedStore()
        if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", addr) != 0:
            raise RuntimeError("setup failed")
        src, dst = Slab(store, block), Slab(store, block)
        base = os.urandom(block)
        src.mm[:] = base
        tag = int(time.time() * 1000) & 0xFFFFFFFF
        run = f"trace/{os.getpid()}-{tag}"

        fetch, fetch_hit, gets, puts, lags = [], [], [], [], []
        n_blocks = hits = n_puts = present = put_fail = get_errors = verify_fail = 0
        rcs = {}
        pc = time.perf_counter_ns
        start = pc()
        ts0 = reqs[0][0] if reqs else 0.0
        for i, (ts, ids) in enumerate(reqs):
            due = start + int((ts - ts0) / 1e3 / a.time_scale * 1e9) if a.time_scale > 0 else pc()
            now = pc()
            if due > now:
                time.sleep((due - now) / 1e9)
            lags.append(max(0, pc() - due))
            t0 = pc()
            first_miss = len(ids)
            h = 0
            for j, bid in enumerate(ids):
                tg = pc()
                rc = store.get_into(f"{run}/{bid}", dst.addr, block)
                if rc == block:
                    gets.append(pc() - tg)
                    h += 1
                    if dst.mm[0:16] != struct.pack("<QQ", bid, tag):
                        verify_fail += 1
                    continue
                if rc >= 0 or rc not in (-704,):  # -704: OBJECT_NOT_FOUND
                    get_errors += 1
                    rcs[f"get:{rc}"] = rcs.get(f"get:{rc}", 0) + 1
                first_miss = j
                break
            f = pc() - t0
            fetch.append(f)
            if h:
                fetch_hit.append(f)
            hits += h
            n_blocks += len(ids)
            for bid in ids[first_miss:]:
                src.mm[0:16] = struct.pack("<QQ", bid, tag)
                tp = pc()
                rc = store.put_from(f"{run}/{bid}", src.addr, block)
                if rc == 0:
                    puts.append(pc() - tp)
                    n_puts += 1
                elif rc == -707:  # OBJECT_ALREADY_EXISTS
                    present += 1
                else:
                    put_fail += 1
                    rcs[f"put:{rc}"] = rcs.get(f"put:{rc}", 0) + 1
            if i % 500 == 0:
                print(f"  {i}/{len(reqs)} requests, hit ratio {hits / max(1, n_blocks):.3f}", file=sys.stderr, flush=True)
        wall = (pc() - start) / 1e9
        store.close()
        open(stopf, "w").close()
    finally:
        stop(owner)
        stop(master)

    fetched, put_bytes = hits * block, n_puts * block
    busy = lambda xs: sum(xs) / 1e9
    out = {
        "system": "mooncake-store",
        "version": version("mooncake-transfer-engine-non-cuda"),
        "bench": "trace",
        "trace": a.trace,
        "params": {"transport": "tcp", "nodes": 1, "workers": 1, "block_bytes": block,
                   "bytes_per_token": a.bytes_per_token, "block_tokens": a.block_tokens,
                   "time_scale": a.time_scale, "dram_bytes": dram, "ssd_bytes": 0, "ssd_backend": "none",
                   "lease_ms": a.lease_ms, "max_requests": a.max_requests or None,
                   "eviction_high_watermark_ratio": 0.95, "eviction_ratio": 0.05},
        "requests": len(reqs), "blocks": n_blocks, "hits": hits, "dram_hits": hits, "ssd_hits": 0,
        "hit_ratio": hits / max(1, n_blocks), "dram_hit_ratio": hits / max(1, n_blocks), "ssd_hit_ratio": 0.0,
        "puts": n_puts, "present_after_miss": present, "put_failures": put_fail, "get_errors": get_errors,
        "verify_failures": verify_fail, "return_codes": rcs,
        "wall_s": wall, "requests_per_s": len(reqs) / wall,
        "fetched_bytes": fetched, "put_bytes": put_bytes,
        "fetch_GB_per_s": fetched / wall / 1e9, "put_GB_per_s": put_bytes / wall / 1e9,
        "get_GB_per_s_busy": fetched / max(busy(gets), 1e-9) / 1e9,
        "put_GB_per_s_busy": put_bytes / max(busy(puts), 1e-9) / 1e9,
        "fetch_latency_us": lat_json(fetch), "fetch_latency_hit_us": lat_json(fetch_hit),
        "get_block_us": lat_json(gets), "put_block_us": lat_json(puts),
        "schedule_lag_ms": {"p50": quantile(sorted(lags), 0.5) / 1e6, "p99": quantile(sorted(lags), 0.99) / 1e6,
                            "max": max(lags) / 1e6 if lags else 0.0},
        "cdf": cdf_points(fetch),
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"reference trace: {len(reqs)} requests, {n_blocks} blocks of {block} B: hit ratio {out['hit_ratio']:.4f}; "
          f"fetch p50 {out['fetch_latency_us']['p50']:.0f} us p99 {out['fetch_latency_us']['p99']:.0f} us; "
          f"put failures {put_fail} {rcs}; {wall:.1f} s", file=sys.stderr)
    if verify_fail:
        print(f"{verify_fail} fetched blocks had the wrong header", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
