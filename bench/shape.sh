#!/usr/bin/env bash
# The shape of the store's data path (issue 23): lines of every file under
# mooncake-core/src/store/ (largest first) and in all, the largest file, and the
# places that still pick behaviour by a transport's name (`transport_name(`, or
# "local" / "shm" / "rdma" / "tcp" compared or matched). Exits 1 when a file there
# has more than MAX_LINES (600) lines or a transport name is still compared.
#
#   bash bench/shape.sh            (also: bash bench/ab.sh shape)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STORE="$ROOT/mooncake-core/src/store"
MAX_LINES="${MAX_LINES:-600}"
[ -d "$STORE" ] || { echo "$STORE: no such directory" >&2; exit 2; }
status=0

echo "== lines of mooncake-core/src/store/ (largest first)"
mapfile -t counts < <(find "$STORE" -name '*.rs' -print0 | xargs -0 wc -l | grep -v ' total$' | sort -rn)
total=0
largest=""
for line in "${counts[@]}"; do
  n="${line%% /*}" n="${n// /}" file="/${line#* /}"
  total=$((total + n))
  [ -n "$largest" ] || largest="${file#"$ROOT"/} ($n lines)"
  mark=""
  if [ "$n" -gt "$MAX_LINES" ]; then
    mark="  <- over $MAX_LINES"
    status=1
  fi
  printf '%6d %s%s\n' "$n" "${file#"$ROOT"/}" "$mark"
done
printf '%6d total in %d files\n' "$total" "${#counts[@]}"
echo "largest: $largest"

echo "== transport-name comparisons in mooncake-core/src/store/"
# Calls of transport_name(..), and a name literal compared (==, !=), wrapped in
# Some(..), or matched (`"shm" |`, `"rdma" =>`); `feature = "rdma"` is not one.
names='transport_name\(|(==|!=)[[:space:]]*(Some\()?"(local|shm|rdma|tcp)"|Some\("(local|shm|rdma|tcp)"|"(local|shm|rdma|tcp)"[[:space:]]*(\||=>|==|!=)'
if hits=$(grep -rnE "$names" "$STORE" --include='*.rs' | grep -v 'feature = "'); then
  echo "$hits" | sed "s|$ROOT/||"
  echo "$(echo "$hits" | wc -l) comparison(s) left"
  status=1
else
  echo "none"
fi
exit "$status"
