#!/usr/bin/env bash
# Remote put/get between processes: mooncake-rs over Tcp and Shm, the reference
# Mooncake Store (../shared/anchors/mooncake, TCP) and memcpy, in one run.
# Prints the ratios of the performance targets and writes every JSON under $OUT (default bench/out).
#
#   bash bench/remote.sh            # all of it (~3 min, plus the anchor's pip install once)
#   SKIP_ANCHOR=1 bash bench/remote.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/bench/out}"
ANCHOR="${ANCHOR:-$ROOT/../shared/anchors/mooncake}"
mkdir -p "$OUT"
cd "$ROOT"
cargo build --release -q -p mooncake-cli -p mooncake-bench
BIN="$ROOT/target/release"
SIZES="${SIZES:-4K,64K,1M,4M}"

"$BIN/mooncake-bench" memcpy --size 4MiB > "$OUT/memcpy.json"
for t in tcp shm; do
  "$BIN/mooncake-bench" remote --transport "$t" --sizes "$SIZES" --out "$OUT/ours_$t.json"
done
if [ -z "${SKIP_ANCHOR:-}" ]; then
  MC_VENV="${MC_VENV:-$OUT/mc-venv}" MC_MODES=remote MC_SIZES="$SIZES" OUT_JSON="$OUT/mooncake.json" \
    bash "$ANCHOR/run.sh" || echo "anchor run failed; ratios to the reference are skipped" >&2
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
load = lambda n: json.load(open(os.path.join(out, n))) if os.path.exists(os.path.join(out, n)) else None
memcpy = load("memcpy.json")["GB_per_s"]
ours = {t: {(r["api"], r["size"]): r for r in load(f"ours_{t}.json")["rows"]} for t in ("tcp", "shm")}
ref = load("mooncake.json")
refrows = {}
if ref:
    for r in ref["rows"]:
        if r.get("mode") == "remote" and r.get("batch", 1) == 1:
            refrows[(r["api"], r["size"])] = r
m = load("memcpy.json")
print(f"memcpy 4 MiB: {memcpy:.2f} GB/s from 256 MiB of sources (cache-warm: {m.get('warm_GB_per_s', 0):.2f} GB/s)")
print(f"{'api':9} {'size':>8} | {'tcp GB/s':>8} {'p50 us':>8} {'p99 us':>8} | {'shm GB/s':>8} {'p50 us':>8} | {'ref GB/s':>8} {'ref p50':>8} | {'tcp/ref':>7} {'shm/memcpy':>10}")
summary = {}
for (api, size), t in sorted(ours["tcp"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
    s = ours["shm"].get((api, size), {})
    ref_api = {"get": "get", "put": "put", "get_into": "get_into"}[api]
    r = refrows.get((ref_api, size))
    ratio = t["GB_per_s"] / r["GB_per_s"] if r and r["GB_per_s"] else float("nan")
    shm_ratio = s.get("GB_per_s", 0) / memcpy
    summary[f"{api}/{size}"] = {"tcp_over_ref": ratio, "shm_over_memcpy": shm_ratio}
    print(f"{api:9} {size:>8} | {t['GB_per_s']:8.3f} {t['p50_us']:8.1f} {t['p99_us']:8.1f} | {s.get('GB_per_s', 0):8.3f} {s.get('p50_us', 0):8.1f} | "
          f"{(r or {}).get('GB_per_s', float('nan')):8.3f} {(r or {}).get('p50_us', float('nan')):8.1f} | {ratio:7.2f} {shm_ratio:10.2f}")
json.dump({"memcpy_GB_per_s": memcpy, "ratios": summary}, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
