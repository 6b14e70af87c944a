#!/usr/bin/env python3
"""How soon storage nodes re-mount after their master restarts.

A `mooncake-master` (client TTL 10 s), two `mooncake-client serve` nodes holding 20
objects; then, ROUNDS times: `kill -9` of the master, DOWN seconds with no master
(env, default 0), a master started again on the same ports, and the time from its
listening until its `/status` shows both segments back. One JSON line out.

    python3 bench/remount.py target/release 15
    DOWN=1 python3 bench/remount.py target/release 8
"""
import tempfile
import subprocess, time, json, urllib.request, sys, statistics, os
B = sys.argv[1]
BLOB = os.path.join(tempfile.mkdtemp(), 'value.bin')
def start_master(port=None, mport=None):
    args = [f"{B}/mooncake-master", "--listen", f"127.0.0.1:{port or 0}", "--metrics-listen", f"127.0.0.1:{mport or 0}", "--client-ttl-ms", "10000"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addr = p.stdout.readline().strip().rsplit(" ", 1)[1]
    maddr = p.stdout.readline().strip().rsplit(" ", 1)[1]
    return p, addr, maddr
m, addr, maddr = start_master()
nodes = [subprocess.Popen([f"{B}/mooncake-client", "serve", "--master", addr, "--listen", "127.0.0.1:0", "--segment-size", "64MiB"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
for n in nodes: n.stdout.readline()
open(BLOB,"wb").write(os.urandom(65536))
for i in range(20):
    subprocess.run([f"{B}/mooncake-client", "put", "--master", addr, f"k{i}", BLOB], check=True, capture_output=True)
time.sleep(1)
def segments():
    try:
        return json.loads(urllib.request.urlopen(f"http://{maddr}/status", timeout=1).read())["segments"]
    except Exception:
        return -1
times = []
for r in range(int(sys.argv[2])):
    m.kill(); m.wait(); time.sleep(float(os.environ.get('DOWN', '0')))
    port, mport = addr.rsplit(":",1)[1], maddr.rsplit(":",1)[1]
    t0 = time.monotonic()
    m, _, _ = start_master(port, mport)
    t1 = time.monotonic()
    while segments() != 2:
        time.sleep(0.002)
    times.append((time.monotonic() - t1) * 1000)
    time.sleep(0.3)
print(json.dumps({"down_s": float(os.environ.get("DOWN", "0")), "rounds": len(times), "remount_ms_p50": round(statistics.median(times), 1), "remount_ms_min": round(min(times), 1), "remount_ms_max": round(max(times), 1)}))
m.kill(); [n.kill() for n in nodes]
