#!/usr/bin/env bash
# The SSD tier (mooncake-storage) against fio, in one run, on one directory.
#
# The disk of this kind of VM drifts by 2x within a minute, so the reference is taken
# next to each measurement, ROUNDS times:
#   fio 1 MiB sequential write (O_DIRECT, io_uring, QD32), fio 1 MiB sequential read
#   of that file (QD32), then `mooncake-bench ssd` offload + load of as many bytes;
#   fio 4 KiB random read (QD32) over SMALL_COUNT*4 KiB, then `mooncake-bench ssd`
#   random loads of SMALL_COUNT 4 KiB objects.
# Two more fio jobs explain the store's figures (not targets): a 1 MiB write at QD1
# (what one batch_offload call issues) and a 4 KiB random read submitted and reaped
# 32 at a time (what one batch_load call of 32 keys does).
# Prints ours/fio per round and their median for the the performance targets targets, and writes
# every row and fio result to one JSON.
#
#   bash bench/ssd.sh [--dir DIR] [--out FILE]     (~2.5 min with the defaults)
#   ROUNDS=3 TOTAL_MIB=2048 SMALL_COUNT=200000 SECS=4 READERS=1,2 WRITERS=1,2 \
#     SMALL_READERS=1,2,2x16 BACKENDS=bucket bash bench/ssd.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${DIR:-/var/tmp/mooncake-ssd-bench}"
OUT_JSON="${OUT_JSON:-$ROOT/bench/out/ssd-$(date +%Y%m%d-%H%M%S).json}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR="$2"; shift 2 ;;
    --out) OUT_JSON="$2"; shift 2 ;;
    *) echo "usage: $0 [--dir DIR] [--out FILE]" >&2; exit 2 ;;
  esac
done
ROUNDS="${ROUNDS:-3}"
TOTAL_MIB="${TOTAL_MIB:-2048}"        # large-object bytes, ours and fio's
SMALL_COUNT="${SMALL_COUNT:-200000}"  # 4 KiB objects; fio's random-read span
SECS="${SECS:-4}"                     # seconds of each random-read measurement
READERS="${READERS:-1,2}"
WRITERS="${WRITERS:-1,2}"
SMALL_READERS="${SMALL_READERS:-1,2,2x16}"
BACKENDS="${BACKENDS:-bucket}"
EXTRA="${EXTRA:-}"                    # more `mooncake-bench ssd` flags

if ! command -v fio >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get install -y fio >/dev/null || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y fio >/dev/null; }
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
(cd "$ROOT" && cargo build --release -q -p mooncake-bench)
BIN="$CARGO_TARGET_DIR/release/mooncake-bench"

mkdir -p "$DIR" "$(dirname "$OUT_JSON")"
case "$(stat -f -c %T "$DIR")" in tmpfs|ramfs) echo "$DIR is $(stat -f -c %T "$DIR"): O_DIRECT needs a real disk" >&2; exit 1 ;; esac
TMP="$(mktemp -d)"
FIOFILE="$DIR/fio-$$.dat"
trap 'rm -rf "$TMP"; rm -f "$FIOFILE"' EXIT
COMMON=(--filename="$FIOFILE" --direct=1 --ioengine=io_uring --numjobs=1 --output-format=json)

START=$(date +%s)
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS: fio 1 MiB write/read, ours offload/load ..." >&2
  rm -f "$FIOFILE"
  fio --name=write_qd1 --rw=write --bs=1M --iodepth=1 --size="${TOTAL_MIB}m" --end_fsync=1 "${COMMON[@]}" >"$TMP/fio_write_qd1_$r.json"
  rm -f "$FIOFILE"
  fio --name=write --rw=write --bs=1M --iodepth=32 --size="${TOTAL_MIB}m" --end_fsync=1 "${COMMON[@]}" >"$TMP/fio_write_$r.json"
  fio --name=read --rw=read --bs=1M --iodepth=32 --size="${TOTAL_MIB}m" "${COMMON[@]}" >"$TMP/fio_read_$r.json"
  BUF="--no-buffered"; [ "$r" = 1 ] && BUF=""
  # shellcheck disable=SC2086
  "$BIN" ssd --dir "$DIR" --no-small $BUF --total "${TOTAL_MIB}MiB" --readers "$READERS" --writers "$WRITERS" \
    --backends "$BACKENDS" $EXTRA --out "$TMP/ours_large_$r.json"
  echo "round $r/$ROUNDS: fio 4 KiB random read, ours random loads ..." >&2
  fio --name=randread --rw=randread --bs=4k --iodepth=32 --size="$((SMALL_COUNT * 4))k" --time_based \
    --runtime="$SECS" --randrepeat=0 "${COMMON[@]}" >"$TMP/fio_randread_$r.json"
  fio --name=randread_batch32 --rw=randread --bs=4k --iodepth=32 --iodepth_batch_submit=32 \
    --iodepth_batch_complete_min=32 --size="$((SMALL_COUNT * 4))k" --time_based --runtime="$SECS" --randrepeat=0 \
    "${COMMON[@]}" >"$TMP/fio_randread_batch32_$r.json"
  rm -f "$FIOFILE"
  # shellcheck disable=SC2086
  "$BIN" ssd --dir "$DIR" --no-large --small-count "$SMALL_COUNT" --small-secs "$SECS" \
    --small-readers "$SMALL_READERS" --backends "$BACKENDS" $EXTRA --out "$TMP/ours_small_$r.json"
done
echo "done in $(($(date +%s) - START)) s" >&2

python3 - "$TMP" "$OUT_JSON" "$DIR" "$ROUNDS" <<'PY'
import json, os, statistics, sys, time
tmp, out, d, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
load = lambda n: json.load(open(os.path.join(tmp, n)))
JOBS = ("write", "write_qd1", "read", "randread", "randread_batch32")

def fio(job, r):
    j = load(f"fio_{job}_{r}.json")["jobs"][0]
    side = j["write"] if job.startswith("write") else j["read"]
    pct = side.get("clat_ns", {}).get("percentile", {})
    return {"GB_per_s": side["bw_bytes"] / 1e9, "iops": side["iops"],
            "p50_us": pct.get("50.000000", 0) / 1e3, "p99_us": pct.get("99.000000", 0) / 1e3}

R = range(1, rounds + 1)
fios = {r: {job: fio(job, r) for job in JOBS} for r in R}
ours = {r: load(f"ours_large_{r}.json")["rows"] + load(f"ours_small_{r}.json")["rows"] for r in R}

def key(row):
    return (row["phase"], row["backend"], row["direct"], row["api"], row["size"], row["batch"], row["threads"])

def reference(row):
    """The fio job a row compares with, and the figure compared."""
    if row["phase"] == "offload":
        return "write", "GB_per_s"
    if row["phase"] == "load":
        return "read", "GB_per_s"
    return "randread", "iops"

def figure(row, what):
    return row["GB_per_s"] if what == "GB_per_s" else row["ops_per_s"]

med = statistics.median
print(f"fio on {d} (O_DIRECT, io_uring), per round:")
for job in JOBS:
    what = "GB_per_s" if "read" not in job or job == "read" else "iops"
    vals = " ".join(f"{fios[r][job][what]:9.3f}" if what == "GB_per_s" else f"{fios[r][job][what]:9.0f}" for r in R)
    unit = "GB/s" if what == "GB_per_s" else "IOPS"
    print(f"  {job:17} {vals}  {unit}   p50 {med(fios[r][job]['p50_us'] for r in R):7.0f} us  "
          f"p99 {med(fios[r][job]['p99_us'] for r in R):7.0f} us per op (median)")

# Every distinct row of ours: per-round ratio to the fio job run next to it.
table = {}
for r in R:
    for row in ours[r]:
        job, what = reference(row)
        table.setdefault(key(row), []).append((r, row, figure(row, what) / fios[r][job][what]))

print("\nours, per round (ratio to the fio job of the same round), median ratio:")
for k, entries in table.items():
    row = entries[0][1]
    job, what = reference(row)
    unit = "GB/s" if what == "GB_per_s" else "ops/s"
    per = "  ".join(f"{figure(e[1], what):8.3f}/{e[2]:4.2f}" if what == "GB_per_s" else f"{figure(e[1], what):8.0f}/{e[2]:4.2f}" for e in entries)
    fails = sum(e[1]["fail"] for e in entries)
    print(f"  {row['phase']:11} {row['backend']:6} {'direct' if row['direct'] else 'buffer':6} {row['api']:17} "
          f"{row['size']:>7} x{row['batch']:<3} {row['threads']}thr | {per} | med {med(e[2] for e in entries):4.2f} vs {job}"
          f"  p50 {med(e[1]['p50_us'] for e in entries):7.0f} us p99 {med(e[1]['p99_us'] for e in entries):7.0f} us/call"
          f"  cpu {med(e[1]['cpu_cores'] for e in entries):4.2f}" + (f"  FAILED {fails}" if fails else ""))

checks = [
    ("offload write 1 MiB, 1 thread", ("offload", "bucket", True, "batch_offload", 1 << 20, None, 1), 0.90),
    ("load 1 MiB x32, 1 thread", ("load", "bucket", True, "load_into_staging", 1 << 20, 32, 1), 0.90),
    ("4 KiB random load x32, 1 thread", ("load_random", "bucket", True, "batch_load", 4096, 32, 1), 0.80),
    ("  same, 2 threads x16 (QD<=32)", ("load_random", "bucket", True, "batch_load", 4096, 16, 2), 0.80),
    ("  same, 2 threads x32", ("load_random", "bucket", True, "batch_load", 4096, 32, 2), 0.80),
    ("  offload, 2 threads", ("offload", "bucket", True, "batch_offload", 1 << 20, None, 2), 0.90),
    ("  load, 2 threads", ("load", "bucket", True, "load_into_staging", 1 << 20, 32, 2), 0.90),
]
print(f"\n{'the performance targets target':34} {'ours':>10} {'fio':>10} {'median ratio':>12} {'goal':>5}  met")
summary = []
for name, want, goal in checks:
    hits = [v for k, v in table.items() if all(w is None or w == x for w, x in zip(want, k))]
    if not hits:
        continue
    entries = hits[0]
    row = entries[0][1]
    job, what = reference(row)
    mine = med(figure(e[1], what) for e in entries)
    ref = med(fios[r][job][what] for r in R)
    ratio = med(e[2] for e in entries)
    print(f"{name:34} {mine:10.3f} {ref:10.3f} {ratio:12.2f} {goal:5.2f}  {'yes' if ratio >= goal else 'NO'}"
          f"   ({'GB/s' if what == 'GB_per_s' else 'ops/s'}; per round {', '.join(f'{e[2]:.2f}' for e in entries)})")
    summary.append({"target": name.strip(), "ours_median": mine, "fio_median": ref, "median_ratio": ratio,
                    "per_round_ratios": [e[2] for e in entries], "goal": goal, "met": ratio >= goal})

json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dir": d, "rounds": rounds,
           "fio": {str(r): fios[r] for r in R}, "ours": {str(r): ours[r] for r in R}, "summary": summary},
          open(out, "w"), indent=1)
print(f"\nwritten: {out}")
PY
