#!/usr/bin/env bash
# Cluster-mode benchmarks, each writing JSON into bench/results/:
#   throughput  metadata ops/s with 1 and with 2 masters, each master pinned to its own
#               core (taskset), pipelined batch clients   -> cluster-throughput.json
#   failover    KILLS x kill -9 of a leading master in a cluster of 3: time until every
#               slot group has a live leader, and until a get of a moved group
#               succeeds; p50 and max                      -> cluster-failover.json
#   memory      one master's RSS growth per object over OBJECTS small objects
#                                                          -> cluster-memory.json
#
#   bash bench/cluster.sh                      # all three
#   bash bench/cluster.sh throughput failover  # some
#   OBJECTS=5000000 KILLS=20 SECS=5 ROUNDS=3 THREADS=8 BATCH=256 CORES=0,1 bash bench/cluster.sh
#
# Needs etcd (Debian: etcd-server) and taskset. etcd runs on loopback for the run, in a
# temporary directory; each phase names its own cluster in it.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/results
OBJECTS=${OBJECTS:-10000000}
KILLS=${KILLS:-20}
SECS=${SECS:-5}
ROUNDS=${ROUNDS:-3}
THREADS=${THREADS:-8}
BATCH=${BATCH:-256}
CORES=${CORES:-0,1}
PHASES=("$@")
[ ${#PHASES[@]} -eq 0 ] && PHASES=(throughput failover memory)

for tool in etcd taskset curl; do
    command -v "$tool" >/dev/null || { echo "cluster.sh: $tool is not installed" >&2; exit 1; }
done

cargo build --release -p mooncake-cli -p mooncake-bench
B=${CARGO_TARGET_DIR:-target}/release/mooncake-bench
mkdir -p "$OUT"

# etcd on loopback. A port may be taken by another process between our choice and
# etcd's bind: etcd then exits, and we try other ports.
ETCD_DIR=$(mktemp -d)
ETCD_PID=
cleanup() {
    local status=$?
    if [ -n "$ETCD_PID" ]; then
        kill "$ETCD_PID" 2>/dev/null || true
        wait "$ETCD_PID" 2>/dev/null || true
    fi
    rm -rf "$ETCD_DIR"
    exit "$status"
}
trap cleanup EXIT
ETCD=
for _ in 1 2 3 4 5 6 7 8 9 10; do
    CP=$((20000 + RANDOM % 20000))
    PP=$((CP + 1))
    etcd --name bench --data-dir "$ETCD_DIR/data" \
        --listen-client-urls "http://127.0.0.1:$CP" --advertise-client-urls "http://127.0.0.1:$CP" \
        --listen-peer-urls "http://127.0.0.1:$PP" --initial-advertise-peer-urls "http://127.0.0.1:$PP" \
        --initial-cluster "bench=http://127.0.0.1:$PP" >"$ETCD_DIR/etcd.log" 2>&1 &
    ETCD_PID=$!
    for _ in $(seq 150); do
        kill -0 "$ETCD_PID" 2>/dev/null || break
        if curl -sf "http://127.0.0.1:$CP/health" | grep -q '"health":"true"'; then
            ETCD="http://127.0.0.1:$CP"
            break
        fi
        sleep 0.1
    done
    [ -n "$ETCD" ] && kill -0 "$ETCD_PID" 2>/dev/null && break
    ETCD=
    kill "$ETCD_PID" 2>/dev/null || true
    wait "$ETCD_PID" 2>/dev/null || true
    ETCD_PID=
    rm -rf "$ETCD_DIR/data"
done
[ -n "$ETCD" ] || { echo "cluster.sh: etcd did not start (log: $ETCD_DIR/etcd.log)" >&2; exit 1; }
echo "etcd at $ETCD ($(nproc) cores on this host)"

for phase in "${PHASES[@]}"; do
    case "$phase" in
    throughput)
        "$B" cluster throughput --etcd "$ETCD" --masters 1,2 --cores "$CORES" --threads "$THREADS" \
            --batch "$BATCH" --secs "$SECS" --rounds "$ROUNDS" --out "$OUT/cluster-throughput.json"
        ;;
    failover)
        "$B" cluster failover --etcd "$ETCD" --kills "$KILLS" --masters 3 --out "$OUT/cluster-failover.json"
        ;;
    memory)
        "$B" cluster memory --objects "$OBJECTS" --out "$OUT/cluster-memory.json"
        ;;
    *)
        echo "cluster.sh: unknown phase $phase (throughput, failover, memory)" >&2
        exit 1
        ;;
    esac
    echo "wrote $OUT/cluster-$phase.json"
done
