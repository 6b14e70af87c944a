#!/usr/bin/env python3
"""Python-side batch_put_from / batch_get_into through ours and through the reference.

Each implementation gets the same set-up, in the same run: its own master daemon, an
"owner" process that gives the pool a segment, and a "client" process with no segment
of its own, so every byte of every call crosses TCP between processes on loopback.
The client registers one buffer and times `batch_put_from` then `batch_get_into` of
BATCH objects of SIZE bytes (fresh keys every round), checking the bytes read back.

    python batch_tcp.py run --ours-master target/release/mooncake-master \\
        [--ref-python /path/to/venv/bin/python] [--rounds 30] [--repeat 3] [--out result.json]

Each repeat also measures the floor of the machine for the same traffic: plain TCP
sockets between two Python processes ("tcp-floor"), the same bytes over as many
connections as our client uses (two on a 2-core host), written and read straight
between the processes' buffers, one byte answered per connection per call, no store
at all. An implementation's speed as a share of that floor says how much of the
loopback's capacity it leaves unused.

`MOONCAKE_BENCH_PROTOCOL=shm` runs ours over same-host shared memory instead of TCP
(the reference always uses TCP). `--ref-python` names an interpreter with `mooncake-transfer-engine-non-cuda` installed
(its `mooncake_master` is used); without it only ours runs. Reported per call: p50 and
mean latency, and GB/s (1e9) of payload.
"""

import argparse
import json
import mmap
import ctypes
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

KiB, MiB = 1024, 1024 * 1024


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def store_class(impl):
    if impl == "ours":
        from mooncake_rs.store import MooncakeDistributedStore
    else:
        from mooncake.store import MooncakeDistributedStore
    return MooncakeDistributedStore


def connect(impl, master, segment):
    s = store_class(impl)()
    # The reference only knows "tcp" here; ours may be asked for same-host shared
    # memory instead (MOONCAKE_BENCH_PROTOCOL=shm) to show what TCP costs.
    protocol = os.environ.get("MOONCAKE_BENCH_PROTOCOL", "tcp") if impl == "ours" else "tcp"
    rc = s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 * MiB, protocol, "", master)
    if rc != 0:
        raise SystemExit(f"{impl}: setup failed rc={rc}")
    return s


class Buffer:
    """An anonymous mapping registered with the store."""

    def __init__(self, store, size):
        self.mm = mmap.mmap(-1, size)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.mm[:] = os.urandom(size)  # faults the pages in, and gives real bytes
        if store.register_buffer(self.addr, size) != 0:
            raise SystemExit("register_buffer failed")


# ---------------------------------------------------------------- roles


def role_owner(a):
    s = connect(a.impl, a.master, a.segment)
    # Fault the segment's pages in once, so that neither side pays first touch.
    buf = Buffer(s, 64 * MiB)
    chunk, n = 4 * MiB, int(a.segment * 0.85) // (4 * MiB)
    keys = [f"prefault-{i}" for i in range(n)]
    for j in range(0, n, 16):
        part = keys[j : j + 16]
        s.batch_put_from(part, [buf.addr + (i % 16) * chunk for i in range(len(part))], [chunk] * len(part))
    for k in keys:
        s.remove(k, True)
    pathlib.Path(a.ready).write_text("ready\n")
    deadline = time.time() + 600
    while not os.path.exists(a.stop) and time.time() < deadline:
        time.sleep(0.05)
    s.close()


def role_client(a):
    s = connect(a.impl, a.master, 0)
    n, size = a.batch, a.size
    buf = Buffer(s, 2 * n * size)
    src = [buf.addr + i * size for i in range(n)]
    dst = [buf.addr + (n + i) * size for i in range(n)]
    put_t, get_t = [], []
    for r in range(a.warmup + a.rounds):
        keys = [f"{a.tag}-r{r}-k{i}" for i in range(n)]
        t0 = time.perf_counter()
        rc = s.batch_put_from(keys, src, [size] * n)
        t1 = time.perf_counter()
        got = s.batch_get_into(keys, dst, [size] * n)
        t2 = time.perf_counter()
        if any(c != 0 for c in rc) or any(g != size for g in got):
            raise SystemExit(f"{a.impl}: round {r} failed: put {set(rc)} get {set(got)}")
        if r == 0 and buf.mm[: n * size] != buf.mm[n * size :]:
            raise SystemExit(f"{a.impl}: bytes read back differ")
        if r >= a.warmup:
            put_t.append(t1 - t0)
            get_t.append(t2 - t1)
    print(json.dumps(summary(put_t, get_t, n * size)))
    s.close()


def floor_lanes():
    # As many connections as our TCP transport uses: one per core, 2..=4.
    return max(2, min(4, os.cpu_count() or 2))


def role_floor_owner(a):
    lanes, share = floor_lanes(), a.batch * a.size // floor_lanes()
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(lanes)
        pathlib.Path(a.ready).write_text(str(ls.getsockname()[1]))
        conns = [ls.accept()[0] for _ in range(lanes)]

    def serve(c):
        buf = bytearray(share)
        view, one = memoryview(buf), bytearray(1)
        while True:
            if c.recv_into(one, 1) != 1:
                return
            if one[0] == ord("p"):  # the client writes `share` bytes: read them, answer
                got = 0
                while got < share:
                    n = c.recv_into(view[got:], share - got)
                    if n == 0:
                        return
                    got += n
                c.sendall(b"k")
            else:  # "g": send `share` bytes
                c.sendall(view)

    threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def role_floor_client(a):
    lanes, n, size = floor_lanes(), a.batch, a.size
    share = n * size // lanes
    port = int(pathlib.Path(a.ready).read_text())
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(lanes)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src, dst = bytearray(os.urandom(n * size)), bytearray(n * size)

    def put(k):
        c, part, one = conns[k], memoryview(src)[k * share : (k + 1) * share], bytearray(1)
        c.sendall(b"p")
        for j in range(0, share, size):  # one send per object, as a store sends them
            c.sendall(part[j : j + size])
        c.recv_into(one, 1)

    def get(k):
        c, part = conns[k], memoryview(dst)[k * share : (k + 1) * share]
        c.sendall(b"g")
        got = 0
        while got < share:
            got += c.recv_into(part[got:], share - got)

    def timed(fn):
        t0 = time.perf_counter()
        threads = [threading.Thread(target=fn, args=(k,)) for k in range(1, lanes)]
        for t in threads:
            t.start()
        fn(0)
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    put_t, get_t = [], []
    for r in range(a.warmup + a.rounds):
        tp, tg = timed(put), timed(get)
        if r >= a.warmup:
            put_t.append(tp)
            get_t.append(tg)
    if src[: n * size] != dst:
        raise SystemExit("tcp-floor: bytes differ")
    print(json.dumps(summary(put_t, get_t, n * size)))
    for c in conns:
        c.close()


def summary(put_t, get_t, nbytes):
    return {
        api: {
            "calls": len(ts),
            "p50_us": round(statistics.median(ts) * 1e6, 1),
            "mean_us": round(statistics.fmean(ts) * 1e6, 1),
            "GB_per_s": round(nbytes * len(ts) / sum(ts) / 1e9, 3),
        }
        for api, ts in (("batch_put_from", put_t), ("batch_get_into", get_t))
    }


def run_floor(a, work):
    ready = work / "floor.port"
    ready.unlink(missing_ok=True)
    common = ["--batch", str(a.batch), "--size", str(a.size), "--ready", str(ready)]
    owner = subprocess.Popen([sys.executable, __file__, "floor-owner", *common], stderr=open(work / "floor-owner.log", "w"))
    try:
        while not ready.exists() or not ready.read_text():
            if owner.poll() is not None:
                raise SystemExit(f"tcp-floor owner died: see {work}")
            time.sleep(0.05)
        client = subprocess.run(
            [sys.executable, __file__, "floor-client", *common, "--rounds", str(a.rounds), "--warmup", str(a.warmup)],
            capture_output=True, text=True, timeout=600,
        )
        if client.returncode != 0:
            raise SystemExit(f"tcp-floor client failed: {client.stderr[-2000:]}")
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        try:
            owner.wait(timeout=30)  # it ends when the client closes its connections
        except subprocess.TimeoutExpired:
            owner.kill()


# ---------------------------------------------------------------- driver


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc):
    for _ in range(300):
        if proc.poll() is not None:
            raise SystemExit(f"master exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit("master did not open its port")


def run_one(impl, python, master_cmd, a, work):
    port = free_port()
    cmd = {
        "ours": [master_cmd, "--listen", f"127.0.0.1:{port}"],
        "ref": [master_cmd, "--rpc_address=127.0.0.1", f"--rpc_port={port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={free_port()}"],
    }[impl]
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1", GLOG_minloglevel="2")
    procs = []
    try:
        m = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / f"{impl}-master.log", "w"), env=env)
        procs.append(m)
        wait_port(port, m)
        master = f"127.0.0.1:{port}"
        ready, stop = work / f"{impl}.ready", work / f"{impl}.stop"
        for p in (ready, stop):
            p.unlink(missing_ok=True)
        common = ["--impl", impl, "--master", master]
        owner = subprocess.Popen(
            [python, __file__, "owner", *common, "--segment", str(a.segment), "--ready", str(ready), "--stop", str(stop)],
            stderr=open(work / f"{impl}-owner.log", "w"), env=env,
        )
        procs.append(owner)
        while not ready.exists():
            if owner.poll() is not None:
                raise SystemExit(f"{impl} owner died: see {work}")
            time.sleep(0.05)
        client = subprocess.run(
            [python, __file__, "client", *common, "--batch", str(a.batch), "--size", str(a.size),
             "--rounds", str(a.rounds), "--warmup", str(a.warmup), "--tag", f"{impl}{time.time_ns()}"],
            capture_output=True, text=True, env=env, timeout=600,
        )
        if client.returncode != 0:
            raise SystemExit(f"{impl} client failed: {client.stderr[-2000:]}")
        stop.write_text("stop\n")
        owner.wait(timeout=60)
        return json.loads(client.stdout.strip().splitlines()[-1])
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


def drive(a):
    impls = [("ours", sys.executable, a.ours_master)]
    if a.ref_python:
        ref_master = subprocess.run(
            [a.ref_python, "-c", "import os, mooncake; print(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        impls.append(("ref", a.ref_python, ref_master))
    results = {impl: [] for impl, _, _ in impls}
    results["tcp-floor"] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for rep in range(a.repeat):
            # Alternate the order so that neither side always runs on a warmer machine.
            order = impls if rep % 2 == 0 else list(reversed(impls))
            for impl, python, master in order:
                r = run_one(impl, python, master, a, work)
                log(f"repeat {rep} {impl}: " + ", ".join(f"{k} p50 {v['p50_us']} us {v['GB_per_s']} GB/s" for k, v in r.items()))
                results[impl].append(r)
            r = run_floor(a, work)
            log(f"repeat {rep} tcp-floor: " + ", ".join(f"{k} p50 {v['p50_us']} us {v['GB_per_s']} GB/s" for k, v in r.items()))
            results["tcp-floor"].append(r)
    table = {}
    for impl, runs in results.items():
        table[impl] = {
            api: {
                "p50_us": statistics.median(r[api]["p50_us"] for r in runs),
                "GB_per_s": statistics.median(r[api]["GB_per_s"] for r in runs),
            }
            for api in ("batch_put_from", "batch_get_into")
        }
    print(f"{a.batch} x {a.size // KiB} KiB over TCP between processes, median of {a.repeat} runs x {a.rounds} calls")
    print(f"{'api':16} {'impl':9} {'p50 us':>10} {'GB/s':>8} {'of floor':>9}")
    for api in ("batch_put_from", "batch_get_into"):
        for impl in table:
            v = table[impl][api]
            share = table["tcp-floor"][api]["p50_us"] / v["p50_us"]
            v["share_of_floor"] = round(share, 3)
            print(f"{api:16} {impl:9} {v['p50_us']:>10.1f} {v['GB_per_s']:>8.3f} {share:>8.0%}")
        if "ref" in table:
            print(f"{api:16} ratio ours/ref speed: {table['ref'][api]['p50_us'] / table['ours'][api]['p50_us']:.2f}x")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"params": vars(a), "median": table, "runs": results}, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    r = sub.add_parser("run")
    r.add_argument("--ours-master", required=True)
    r.add_argument("--ref-python")
    r.add_argument("--out")
    r.add_argument("--repeat", type=int, default=3)
    fo, fc = sub.add_parser("floor-owner"), sub.add_parser("floor-client")
    for p in (fo, fc):
        p.add_argument("--ready", required=True)
    o = sub.add_parser("owner")
    o.add_argument("--ready", required=True)
    o.add_argument("--stop", required=True)
    c = sub.add_parser("client")
    c.add_argument("--tag", required=True)
    for p in (o, c):
        p.add_argument("--impl", choices=["ours", "ref"], required=True)
        p.add_argument("--master", required=True)
    for p in (r, o):
        p.add_argument("--segment", type=int, default=1536 * MiB)
    for p in (r, c, fo, fc):
        p.add_argument("--batch", type=int, default=64)
        p.add_argument("--size", type=int, default=256 * KiB)
    for p in (r, c, fc):
        p.add_argument("--rounds", type=int, default=30)
        p.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    roles = {"run": drive, "owner": role_owner, "client": role_client}
    roles.update({"floor-owner": role_floor_owner, "floor-client": role_floor_client})
    roles[a.role](a)


if __name__ == "__main__":
    main()
