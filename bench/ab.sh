#!/usr/bin/env bash
# Builds compared in one session: `mooncake-bench remote` over shm and tcp (a master
# daemon, one storage node, a client giving no memory), ROUNDS rounds with the builds
# interleaved so that a slow minute of a shared machine hits each of them alike, and
# the median of every (build, transport, api, size). The reference Mooncake Store
# (../shared/anchors/mooncake, remote mode, same sizes) runs once per round too.
#
#   bash bench/ab.sh before=/tmp/before-bin after=target/release
#
# Each directory holds `mooncake-bench`, `mooncake-master` and `mooncake-client` of one
# build (`cargo build --release -p mooncake-cli -p mooncake-bench`; an older
# commit: `git archive <commit> | tar -x -C DIR` and build there).
# Knobs: ROUNDS (3), SIZES (64K,1M), TRANSPORTS (shm,tcp), OUT (bench/results/ab.json),
# NICE (e.g. -20, as root: shields the runs from other work on the machine),
# SKIP_ANCHOR=1, ANCHOR, MC_VENV (default bench/out/mc-venv, as compare.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ROUNDS="${ROUNDS:-3}"
SIZES="${SIZES:-64K,1M}"
TRANSPORTS="${TRANSPORTS:-shm,tcp}"
OUT="${OUT:-$ROOT/bench/results/ab.json}"
ANCHOR="${ANCHOR:-$ROOT/../shared/anchors/mooncake}"
MC_VENV="${MC_VENV:-$ROOT/bench/out/mc-venv}"
WORK="$(mktemp -d -t mooncake-ab.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
# (set KEEP=1 to keep the raw runs in $WORK)
[ -n "${KEEP:-}" ] && trap - EXIT
[ "$#" -gt 0 ] || { echo "usage: $0 NAME=BIN_DIR [NAME=BIN_DIR ...]" >&2; exit 2; }
RUN=()
[ -n "${NICE:-}" ] && RUN=(nice -n "$NICE")
NAMES=()
for arg in "$@"; do
  name="${arg%%=*}" dir="${arg#*=}"
  [ -x "$dir/mooncake-bench" ] || { echo "$dir/mooncake-bench: not built" >&2; exit 2; }
  NAMES+=("$name")
  echo "$name $(cd "$dir" && pwd)" >> "$WORK/builds"
done
T0=$(date +%s)
for r in $(seq 1 "$ROUNDS"); do
  for arg in "$@"; do
    name="${arg%%=*}" dir="${arg#*=}"
    for t in ${TRANSPORTS//,/ }; do
      echo "== [$(( $(date +%s) - T0 )) s] round $r: $name over $t" >&2
      "${RUN[@]}" "$dir/mooncake-bench" remote --transport "$t" --sizes "$SIZES" \
        --out "$WORK/run-$name-$t-$r.json" 2>&1 | grep -E "^(tcp|shm) " >&2 || true
    done
  done
  if [ -z "${SKIP_ANCHOR:-}" ] && [ -x "$MC_VENV/bin/python" ] && [ -f "$ANCHOR/run.sh" ]; then
    echo "== [$(( $(date +%s) - T0 )) s] round $r: reference Mooncake Store (remote, tcp)" >&2
    "${RUN[@]}" env MC_VENV="$MC_VENV" MC_MODES=remote MC_SIZES="$SIZES" MC_BATCHES= \
      OUT_JSON="$WORK/ref-$r.json" bash "$ANCHOR/run.sh" >/dev/null 2>"$WORK/ref-$r.log" ||
      echo "reference run failed (see its log)" >&2
  fi
done
python3 - "$WORK" "$OUT" "$ROUNDS" "$SIZES" <<'PY'
import glob, json, os, platform, statistics, sys, time
work, out, rounds, sizes = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
builds = dict(l.split(" ", 1) for l in open(os.path.join(work, "builds")).read().splitlines())
runs, cells = [], {}
for f in sorted(glob.glob(os.path.join(work, "run-*.json"))):
    name, transport, r = os.path.basename(f)[4:-5].rsplit("-", 2)
    rows = json.load(open(f))["rows"]
    runs.append({"build": name, "transport": transport, "round": int(r), "rows": rows})
    for row in rows:
        cells.setdefault((name, transport, row["api"], row["size"]), []).append(row)
for f in sorted(glob.glob(os.path.join(work, "ref-*.json"))):
    try:
        rows = [x for x in json.load(open(f))["rows"] if x.get("mode") == "remote" and x.get("batch", 1) == 1]
    except Exception:
        continue
    runs.append({"build": "reference", "transport": "tcp", "round": int(os.path.basename(f)[4:-5]), "rows": rows})
    for row in rows:
        cells.setdefault(("reference", "tcp", row["api"], row["size"]), []).append(row)
def median(rows, field):
    values = [r[field] for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None
medians = []
for (name, transport, api, size), rows in sorted(cells.items()):
    medians.append({
        "build": name, "transport": transport, "api": api, "size": size, "runs": len(rows),
        "GB_per_s": median(rows, "GB_per_s"), "p50_us": median(rows, "p50_us"),
    })
json.dump({
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "host": f"{platform.node()}: {os.cpu_count()} cores, kernel {platform.release()}, load {os.getloadavg()[0]:.1f}",
    "rounds": rounds, "sizes": sizes, "builds": builds, "medians": medians, "runs": runs,
}, open(out, "w"), indent=1)
print("| build | transport | api | size | GB/s (median) | p50 us (median) | runs |")
print("|---|---|---|---:|---:|---:|---:|")
for m in medians:
    if m["api"] in ("put", "get_into", "put_from") and None not in (m["GB_per_s"], m["p50_us"]):
        print(f"| {m['build']} | {m['transport']} | {m['api']} | {m['size']} | {m['GB_per_s']:.3g} | {m['p50_us']:.0f} | {m['runs']} |")
print(f"\nwritten: {out}", file=sys.stderr)
PY
