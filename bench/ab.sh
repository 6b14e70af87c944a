#!/usr/bin/env bash
# Builds compared in one session: `mooncake-bench remote` over shm and tcp (a master
# daemon, one storage node, a client giving no memory) and `mooncake-bench micro`
# (put, get_into, batch_get, batch_put; local, shm, tcp), ROUNDS rounds with the
# builds interleaved so that a slow minute of a shared machine hits each of them
# alike; the median of every (build, bench, transport, api, size, batch), and for
# every build after the first, one row per (bench, transport, api, size, batch)
# against the first: the ratio of the medians and the noise (the larger spread,
# (max - min) / median over the rounds, of the two builds), with "slower" only
# where the ratio is below 1 - noise. The reference Mooncake Store
# (../shared/anchors/mooncake, remote mode, same sizes) runs once per round too.
#
#   bash bench/ab.sh build 35e9fc1 /tmp/before    (git archive of a commit, built there)
#   bash bench/ab.sh before=/tmp/before/target/release after=target/release
#   bash bench/ab.sh shape                        (bench/shape.sh: store/ lines, names)
#
# Each directory holds `mooncake-bench`, `mooncake-master` and `mooncake-client` of one
# build (`cargo build --release -p mooncake-cli -p mooncake-bench`).
# Knobs: ROUNDS (3), SIZES (64K,1M), TRANSPORTS (shm,tcp, for remote), MICRO (1; 0
# skips micro), MICRO_TRANSPORTS (local,shm,tcp), MICRO_BYTES (64MiB per phase),
# BATCH (16), OUT (bench/results/ab.json), NICE (e.g. -20, as root: shields the runs
# from other work on the machine), SKIP_ANCHOR=1, ANCHOR, MC_VENV (default
# bench/out/mc-venv, as compare.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in
  shape) exec bash "$ROOT/bench/shape.sh" ;;
  build)
    [ "$#" -eq 3 ] || { echo "usage: $0 build COMMIT DIR" >&2; exit 2; }
    commit="$2" dir="$3"
    mkdir -p "$dir/src"
    dir="$(cd "$dir" && pwd)"
    git -C "$ROOT" archive "$commit" | tar -x -C "$dir/src"
    (cd "$dir/src" && CARGO_TARGET_DIR="$dir/target" cargo build --release -p mooncake-cli -p mooncake-bench)
    echo "built $commit: use NAME=$dir/target/release" >&2
    exit 0
    ;;
esac
ROUNDS="${ROUNDS:-3}"
SIZES="${SIZES:-64K,1M}"
TRANSPORTS="${TRANSPORTS:-shm,tcp}"
MICRO="${MICRO:-1}"
MICRO_TRANSPORTS="${MICRO_TRANSPORTS:-local,shm,tcp}"
MICRO_BYTES="${MICRO_BYTES:-64MiB}"
BATCH="${BATCH:-16}"
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
    if [ "$MICRO" != 0 ]; then
      echo "== [$(( $(date +%s) - T0 )) s] round $r: $name micro over $MICRO_TRANSPORTS" >&2
      "${RUN[@]}" "$dir/mooncake-bench" micro --transports "$MICRO_TRANSPORTS" --sizes "$SIZES" --threads 1 \
        --batch "$BATCH" --phase-bytes "$MICRO_BYTES" --out "$WORK/micro-$name-$r.json" >/dev/null 2>&1 ||
        echo "micro run of $name failed" >&2
    fi
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
order = [l.split(" ", 1)[0] for l in open(os.path.join(work, "builds")).read().splitlines()]
runs, cells = [], {}
def add(name, bench, transport, r, rows):
    runs.append({"build": name, "bench": bench, "transport": transport, "round": r, "rows": rows})
    for row in rows:
        t = row.get("transport") or row.get("mode") or transport
        key = (name, bench, t, row["api"], row["size"], row.get("batch", 1))
        cells.setdefault(key, []).append(row)
for f in sorted(glob.glob(os.path.join(work, "run-*.json"))):
    name, transport, r = os.path.basename(f)[4:-5].rsplit("-", 2)
    add(name, "remote", transport, int(r), json.load(open(f))["rows"])
for f in sorted(glob.glob(os.path.join(work, "micro-*.json"))):
    name, r = os.path.basename(f)[6:-5].rsplit("-", 1)
    try:
        add(name, "micro", None, int(r), json.load(open(f))["rows"])
    except Exception as e:
        print(f"{f}: {e}", file=sys.stderr)
for f in sorted(glob.glob(os.path.join(work, "ref-*.json"))):
    try:
        rows = [x for x in json.load(open(f))["rows"] if x.get("mode") == "remote" and x.get("batch", 1) == 1]
    except Exception:
        continue
    for x in rows:
        x["transport"] = "tcp"
    add("reference", "remote", "tcp", int(os.path.basename(f)[4:-5]), rows)
def values(rows, field):
    return [r[field] for r in rows if r.get(field) is not None]
def median(rows, field):
    v = values(rows, field)
    return statistics.median(v) if v else None
def spread(rows, field):
    """(max - min) / median over the rounds: how far one build's runs disagree."""
    v = values(rows, field)
    m = statistics.median(v) if v else 0
    return (max(v) - min(v)) / m if len(v) > 1 and m else None
medians = []
for (name, bench, transport, api, size, batch), rows in sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0]))):
    medians.append({
        "build": name, "bench": bench, "transport": transport, "api": api, "size": size, "batch": batch,
        "runs": len(rows), "GB_per_s": median(rows, "GB_per_s"), "p50_us": median(rows, "p50_us"),
        "GB_per_s_spread": spread(rows, "GB_per_s"),
    })
# Every build after the first against the first (the baseline), row by row.
compare = []
base = order[0]
for other in order[1:]:
    for (name, bench, transport, api, size, batch), rows in sorted(cells.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if name != base or (other, bench, transport, api, size, batch) not in cells:
            continue
        after = cells[(other, bench, transport, api, size, batch)]
        b, a = median(rows, "GB_per_s"), median(after, "GB_per_s")
        if not b or a is None:
            continue
        ratio = a / b
        spreads = [x for x in (spread(rows, "GB_per_s"), spread(after, "GB_per_s")) if x is not None]
        noise = max(spreads) if spreads else None
        verdict = "?" if noise is None else "slower" if ratio < 1 - noise else "faster" if ratio > 1 + noise else "same"
        compare.append({
            "before": base, "after": other, "bench": bench, "transport": transport, "api": api, "size": size,
            "batch": batch, "before_GB_per_s": b, "after_GB_per_s": a, "ratio": ratio, "noise": noise,
            "before_p50_us": median(rows, "p50_us"), "after_p50_us": median(after, "p50_us"), "verdict": verdict,
            "runs": [len(rows), len(after)],
        })
json.dump({
    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "host": f"{platform.node()}: {os.cpu_count()} cores, kernel {platform.release()}, load {os.getloadavg()[0]:.1f}",
    "rounds": rounds, "sizes": sizes, "builds": builds, "medians": medians, "compare": compare, "runs": runs,
}, open(out, "w"), indent=1)
def num(x, fmt):
    return "-" if x is None else format(x, fmt)
print("| build | bench | transport | api | size | batch | GB/s (median) | p50 us (median) | spread | runs |")
print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
for m in medians:
    print(f"| {m['build']} | {m['bench']} | {m['transport']} | {m['api']} | {m['size']} | {m['batch']} | "
          f"{num(m['GB_per_s'], '.3g')} | {num(m['p50_us'], '.0f')} | {num(m['GB_per_s_spread'], '.0%')} | {m['runs']} |")
if compare:
    print(f"\n| after / before | bench | transport | api | size | batch | before GB/s | after GB/s | ratio | noise | p50 us before -> after | verdict |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in compare:
        print(f"| {c['after']} / {c['before']} | {c['bench']} | {c['transport']} | {c['api']} | {c['size']} | {c['batch']} | "
              f"{c['before_GB_per_s']:.3g} | {c['after_GB_per_s']:.3g} | {c['ratio']:.2f} | {num(c['noise'], '.0%')} | "
              f"{num(c['before_p50_us'], '.0f')} -> {num(c['after_p50_us'], '.0f')} | {c['verdict']} |")
    slower = [c for c in compare if c["verdict"] == "slower"]
    print(f"\n{len(slower)} of {len(compare)} rows slower than the baseline by more than their noise", file=sys.stderr)
print(f"written: {out}", file=sys.stderr)
PY
