#!/usr/bin/env bash
# One run, on this machine, of everything the performance targets compares, and the table of ratios:
#   - mooncake-rs: `remote` over Tcp and Shm (1 client, 4K..4M), `meta` (embedded
#     metadata ops/s), `ssd` through bench/ssd.sh when it is there, and `trace`
#     (the Mooncake FAST'25 trace replayed over Tcp: DRAM only, then DRAM + SSD);
#   - the reference Mooncake Store (../shared/anchors/mooncake: run.sh remote mode,
#     and the same trace replayed through its Python API by bench/mooncake_trace.py);
#   - physical limits: iperf3 on loopback, fio (O_DIRECT, io_uring) on the directory
#     the SSD tier uses, memcpy, and redis-benchmark (4 KiB GET, one client).
# Installs what it needs (apt-get; pip into a venv for the reference). Writes every
# JSON, table.md and the PNG charts into $RESULTS (default bench/results).
#
#   bash bench/compare.sh     # ~4.5 min on 2 cores once built; ~6.5 min with a fresh release build
#   SKIP_ANCHOR=1 SKIP_SSD=1 bash bench/compare.sh
# Knobs: RESULTS, DIR (disk directory for fio/SSD, not tmpfs), MC_VENV, SIZES,
# TRACE, TIME_SCALE, BYTES_PER_TOKEN, TRACE_DRAM, TRACE_SSD, SSD_ROUNDS, SSD_TOTAL_MIB.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RESULTS="${RESULTS:-$ROOT/bench/results}"
WORK="${WORK:-$ROOT/bench/out}"
ANCHOR="${ANCHOR:-$ROOT/../shared/anchors/mooncake}"
TRACE="${TRACE:-$ROOT/../shared/data/traces/synthetic_trace.jsonl}"
DIR="${DIR:-/var/tmp/mooncake-compare}"
MC_VENV="${MC_VENV:-$WORK/mc-venv}"
SIZES="${SIZES:-4K,64K,1M,4M}"
TIME_SCALE="${TIME_SCALE:-20}"
BYTES_PER_TOKEN="${BYTES_PER_TOKEN:-128}"   # 64 KiB blocks of 512 tokens
TRACE_DRAM="${TRACE_DRAM:-256MiB}"
TRACE_SSD="${TRACE_SSD:-1GiB}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
BIN="$CARGO_TARGET_DIR/release"
mkdir -p "$RESULTS" "$WORK" "$DIR"
T0=$(date +%s)
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  rm -f "$DIR"/fio-compare.dat
}
trap cleanup EXIT
phase() { echo "== [$(( $(date +%s) - T0 )) s] $*" >&2; }

# ---------------------------------------------------------------- installs
phase "installing what is missing (iperf3 fio redis libibverbs1 python venv)"
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
need=()
command -v iperf3 >/dev/null || need+=(iperf3)
command -v fio >/dev/null || need+=(fio)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-benchmark >/dev/null || need+=(redis-tools)
# (grep -c reads all of its input: with pipefail, grep -q could fail the pipe by SIGPIPE)
[ "$(ldconfig -p 2>/dev/null | grep -c libibverbs.so.1)" -gt 0 ] || need+=(libibverbs1)
python3 -c 'import venv' 2>/dev/null || need+=(python3-venv)
if [ "${#need[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null || echo "apt-get install ${need[*]} failed" >&2
fi
if [ -z "${SKIP_ANCHOR:-}" ]; then
  [ -x "$MC_VENV/bin/python" ] || python3 -m venv "$MC_VENV"
  "$MC_VENV/bin/python" -c "import importlib.metadata as m; m.version('mooncake-transfer-engine-non-cuda')" 2>/dev/null ||
    "$MC_VENV/bin/python" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi

phase "building (release)"
(cd "$ROOT" && cargo build --release -q -p mooncake-cli -p mooncake-bench)

# ---------------------------------------------------------------- physical limits
phase "memcpy"
"$BIN/mooncake-bench" memcpy --size 4MiB > "$RESULTS/memcpy.json"

phase "iperf3 loopback (one stream, 5 s)"
IPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
iperf3 -s -1 -B 127.0.0.1 -p "$IPORT" >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.5
iperf3 -c 127.0.0.1 -p "$IPORT" -t 5 -J > "$WORK/iperf3.json" || echo '{}' > "$WORK/iperf3.json"

phase "fio on $DIR (O_DIRECT, io_uring): 1 MiB seq write/read QD32, 4 KiB random read QD32"
case "$(stat -f -c %T "$DIR")" in tmpfs|ramfs) echo "$DIR is a RAM filesystem: set DIR to a disk" >&2; exit 1 ;; esac
FIO=(--filename="$DIR/fio-compare.dat" --direct=1 --ioengine=io_uring --numjobs=1 --output-format=json --size=1g)
fio --name=write --rw=write --bs=1M --iodepth=32 --end_fsync=1 "${FIO[@]}" > "$WORK/fio_write.json"
fio --name=read --rw=read --bs=1M --iodepth=32 "${FIO[@]}" > "$WORK/fio_read.json"
fio --name=randread --rw=randread --bs=4k --iodepth=32 --time_based --runtime=5 --randrepeat=0 "${FIO[@]}" > "$WORK/fio_randread.json"
rm -f "$DIR/fio-compare.dat"

phase "redis-benchmark 4 KiB GET, 1 client"
RPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
  redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize no >/dev/null 2>&1 &
  RPID=$!
  PIDS+=("$RPID")
  for _ in $(seq 1 50); do redis-cli -p "$RPORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  redis-benchmark -h 127.0.0.1 -p "$RPORT" -c 1 -n 30000 -d 4096 -t get --csv > "$WORK/redis.csv" 2>/dev/null || true
  kill "$RPID" 2>/dev/null || true
else
  : > "$WORK/redis.csv"
fi

python3 - "$WORK" "$RESULTS/limits.json" <<'PY'
import csv, json, os, sys
w, out = sys.argv[1], sys.argv[2]
def load(n):
    try:
        return json.load(open(os.path.join(w, n)))
    except Exception:
        return {}
lim = {}
ip = load("iperf3.json")
bps = ip.get("end", {}).get("sum_received", {}).get("bits_per_second")
lim["iperf3_GB_per_s"] = bps / 8e9 if bps else None
for job in ("write", "read", "randread"):
    j = load(f"fio_{job}.json").get("jobs", [{}])[0]
    side = j.get("write" if job == "write" else "read", {})
    lim[f"fio_{job}_GB_per_s"] = side.get("bw_bytes", 0) / 1e9 or None
    lim[f"fio_{job}_iops"] = side.get("iops") or None
rows = list(csv.reader(open(os.path.join(w, "redis.csv")))) if os.path.exists(os.path.join(w, "redis.csv")) else []
for r in rows:
    if r and r[0].upper().startswith("GET"):
        lim["redis_get_4k_1client_ops_per_s"] = float(r[1])
        if len(r) > 4:
            lim["redis_get_4k_1client_p50_us"] = float(r[4]) * 1e3
json.dump(lim, open(out, "w"), indent=1)
print("limits: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in lim.items()), file=sys.stderr)
PY

# ---------------------------------------------------------------- ours: remote, meta
phase "mooncake-rs embedded metadata (meta)"
"$BIN/mooncake-bench" meta --secs 1 --out "$RESULTS/meta.json"
for t in tcp shm; do
  phase "mooncake-rs remote over $t ($SIZES)"
  "$BIN/mooncake-bench" remote --transport "$t" --sizes "$SIZES" --out "$RESULTS/ours_$t.json"
done

# ---------------------------------------------------------------- reference: remote
if [ -z "${SKIP_ANCHOR:-}" ]; then
  phase "reference Mooncake Store, remote mode ($SIZES)"
  MC_VENV="$MC_VENV" MC_MODES=remote MC_SIZES="$SIZES" MC_BATCHES="${MC_BATCHES:-16}" OUT_JSON="$RESULTS/mooncake.json" \
    bash "$ANCHOR/run.sh" >/dev/null || echo "anchor run failed; ratios to the reference are skipped" >&2
fi

# ---------------------------------------------------------------- SSD tier vs fio
if [ -z "${SKIP_SSD:-}" ] && [ -f "$ROOT/bench/ssd.sh" ]; then
  phase "mooncake-rs SSD tier vs fio (bench/ssd.sh)"
  ROUNDS="${SSD_ROUNDS:-1}" TOTAL_MIB="${SSD_TOTAL_MIB:-1024}" \
    bash "$ROOT/bench/ssd.sh" --dir "$DIR/ssd" --out "$RESULTS/ssd.json" > "$WORK/ssd.txt" ||
    echo "bench/ssd.sh failed; SSD ratios are skipped" >&2
  tail -n 12 "$WORK/ssd.txt" >&2 || true
fi

# ---------------------------------------------------------------- trace replay
TRACE_ARGS=(--bytes-per-token "$BYTES_PER_TOKEN" --time-scale "$TIME_SCALE" --dram "$TRACE_DRAM" --transport tcp --no-progress)
phase "trace replay, mooncake-rs over tcp, $TRACE_DRAM DRAM (time scale $TIME_SCALE)"
"$BIN/mooncake-bench" trace "$TRACE" "${TRACE_ARGS[@]}" --check-sim --out "$RESULTS/trace_ours.json" ||
  echo "trace replay (DRAM) failed or missed the simulation" >&2
phase "trace replay, mooncake-rs over tcp, $TRACE_DRAM DRAM + $TRACE_SSD SSD"
"$BIN/mooncake-bench" trace "$TRACE" "${TRACE_ARGS[@]}" --ssd-dir "$DIR/trace-ssd" --ssd-capacity "$TRACE_SSD" \
  --check-sim --out "$RESULTS/trace_ours_ssd.json" || echo "trace replay (SSD) failed or missed the simulation" >&2
if [ -z "${SKIP_ANCHOR:-}" ]; then
  phase "trace replay, reference Mooncake Store over tcp, $TRACE_DRAM DRAM"
  "$MC_VENV/bin/python" "$ROOT/bench/mooncake_trace.py" --trace "$TRACE" --bytes-per-token "$BYTES_PER_TOKEN" \
    --time-scale "$TIME_SCALE" --dram "$TRACE_DRAM" --anchor "$ANCHOR" --out "$RESULTS/trace_ref.json" 2>"$WORK/trace_ref.log" ||
    { echo "reference trace replay failed (see $WORK/trace_ref.log)" >&2; tail -5 "$WORK/trace_ref.log" >&2; }
  grep -E "^reference trace" "$WORK/trace_ref.log" >&2 || true
fi

phase "plots"
"$BIN/mooncake-bench" plot --results "$RESULTS"

# ---------------------------------------------------------------- the table
WALL=$(( $(date +%s) - T0 ))
python3 - "$RESULTS" "$WALL" <<'PY'
import json, os, platform, sys, time
res, wall = sys.argv[1], int(sys.argv[2])
def load(n):
    try:
        return json.load(open(os.path.join(res, n)))
    except Exception:
        return None
lim = load("limits.json") or {}
memcpy = (load("memcpy.json") or {}).get("GB_per_s")
meta = load("meta.json") or {}
ours = {t: {(r["api"], r["size"]): r for r in (load(f"ours_{t}.json") or {"rows": []})["rows"]} for t in ("tcp", "shm")}
ref = {}
for r in (load("mooncake.json") or {"rows": []})["rows"]:
    if r.get("mode") == "remote" and r.get("batch", 1) == 1:
        ref[(r["api"], r["size"])] = r
ssd = load("ssd.json") or {}
tr, trs, trr = load("trace_ours.json"), load("trace_ours_ssd.json"), load("trace_ref.json")

rows = []  # (target, ours, reference, ratio, goal, met)
def add(target, mine, other, ratio, goal, note=""):
    met = None if ratio is None else ratio >= goal
    rows.append((target, mine, other, ratio, goal, met, note))
def div(a, b):
    return a / b if a is not None and b else None
def best_ref(apis, size):
    c = [ref[(a, size)] for a in apis if (a, size) in ref and ref[(a, size)].get("GB_per_s")]
    return max(c, key=lambda r: r["GB_per_s"]) if c else None

MiB = 1 << 20
for size in (MiB, 4 * MiB):
    sz = f"{size // MiB} MiB"
    for op, mine_api, ref_apis in (("get", "get_into", ("get_into", "get")), ("put", "put", ("put_from", "put"))):
        m = ours["tcp"].get((mine_api, size), {}).get("GB_per_s")
        r = best_ref(ref_apis, size)
        add(f"tcp {op} {sz}: ours / Mooncake", m, r and r["GB_per_s"], div(m, r and r["GB_per_s"]), 2.0,
            f"reference {r['api']}" if r else "no reference run")
        add(f"tcp {op} {sz}: ours / iperf3", m, lim.get("iperf3_GB_per_s"), div(m, lim.get("iperf3_GB_per_s")), 0.8)
for size in (MiB, 4 * MiB):
    for op, api in (("get", "get_into"), ("put", "put")):
        m = ours["shm"].get((api, size), {}).get("GB_per_s")
        add(f"shm {op} {size // MiB} MiB: ours / memcpy", m, memcpy, div(m, memcpy), 0.7)
lk = meta.get("lookup_ops_per_s")
add("embedded metadata lookups / 1 M ops/s", lk, 1e6, div(lk, 1e6), 1.0,
    f"put+end+lookup+remove: {meta.get('cycle_calls_per_s', 0) / 1e6:.2f} M calls/s" if meta else "")
g4 = ours["tcp"].get(("get_into", 4096), {})
p50 = g4.get("p50_us")
add("remote 4 KiB get p50: 50 us / ours", p50, 50.0, div(50.0, p50), 1.0, "p50 in us")
add("remote 4 KiB get ops/s: ours / Redis GET (1 client)", g4.get("ops_per_s"), lim.get("redis_get_4k_1client_ops_per_s"),
    div(g4.get("ops_per_s"), lim.get("redis_get_4k_1client_ops_per_s")), 1.0)
names = {"offload write 1 MiB, 1 thread": ("SSD offload write: ours / fio seq write", 0.9),
         "load 1 MiB x32, 1 thread": ("SSD load: ours / fio QD32 read", 0.9),
         "4 KiB random load x32, 1 thread": ("SSD 4 KiB loads: ours / fio random-read IOPS", 0.8)}
found = {s["target"]: s for s in ssd.get("summary", [])}
for key, (name, goal) in names.items():
    s = found.get(key)
    if s:
        add(name, s["ours_median"], s["fio_median"], s["median_ratio"], goal, "bench/ssd.sh, fio in the same round")
    else:
        add(name, None, None, None, goal, "no bench/ssd.sh result")
if tr:
    add("trace hit ratio: replay - LRU simulation (points, |x| <= 2)", tr["hit_ratio"], tr["sim"]["hit_ratio"],
        None, 2.0, f"{tr['sim_delta_points']:+.2f} points")
    rows[-1] = rows[-1][:3] + (abs(tr["sim_delta_points"]), 2.0, abs(tr["sim_delta_points"]) <= 2.0, rows[-1][6])
if trs:
    add("trace (+SSD) hit ratio: replay - simulation (points)", trs["hit_ratio"], trs["sim"]["hit_ratio"], None, 2.0,
        f"{trs['sim_delta_points']:+.2f} points; DRAM {trs['dram_hit_ratio']:.3f} SSD {trs['ssd_hit_ratio']:.3f}")
    rows[-1] = rows[-1][:3] + (abs(trs["sim_delta_points"]), 2.0, abs(trs["sim_delta_points"]) <= 2.0, rows[-1][6])
if tr and trr:
    add("trace prefix-fetch p50 (requests with hits): ref / ours", tr["fetch_latency_hit_us"]["p50"],
        trr["fetch_latency_hit_us"]["p50"], div(trr["fetch_latency_hit_us"]["p50"], tr["fetch_latency_hit_us"]["p50"]), 1.0,
        f"hit ratio ours {tr['hit_ratio']:.3f} ref {trr['hit_ratio']:.3f}")
    add("trace block get GB/s (busy): ours / Mooncake", tr["get_GB_per_s_busy"], trr["get_GB_per_s_busy"],
        div(tr["get_GB_per_s_busy"], trr["get_GB_per_s_busy"]), 1.0, "64 KiB blocks, informational")

def f(x):
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
lines = ["| target | ours | reference / limit | ratio | goal | met | note |", "|---|---:|---:|---:|---:|:-:|---|"]
for t, m, o, r, g, met, note in rows:
    flag = "-" if met is None else ("yes" if met else "**no**")
    if t.startswith("trace hit") or t.startswith("trace (+SSD)"):
        lines.append(f"| {t} | {f(m)} | {f(o)} | {f(r)} | <= {g:g} | {flag} | {note} |")
    else:
        lines.append(f"| {t} | {f(m)} | {f(o)} | {f(r)} | >= {g:g} | {flag} | {note} |")
lim_line = (f"limits: iperf3 {f(lim.get('iperf3_GB_per_s'))} GB/s, memcpy {f(memcpy)} GB/s, fio write {f(lim.get('fio_write_GB_per_s'))} GB/s, "
            f"read {f(lim.get('fio_read_GB_per_s'))} GB/s, 4K randread {f(lim.get('fio_randread_iops'))} IOPS, "
            f"redis GET 4K 1 client {f(lim.get('redis_get_4k_1client_ops_per_s'))} ops/s")
host = f"{platform.node()}: {os.cpu_count()} cores, kernel {platform.release()}"
text = "\n".join(lines) + f"\n\n{lim_line}\n\n{time.strftime('%Y-%m-%d %H:%M %Z')}, {host}, compare run {wall} s\n"
print(text)
open(os.path.join(res, "table.md"), "w").write(text)
json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": host, "wall_s": wall,
           "rows": [dict(zip(("target", "ours", "other", "ratio", "goal", "met", "note"), r)) for r in rows]},
          open(os.path.join(res, "summary.json"), "w"), indent=1)
PY
phase "done: $RESULTS"
