#!/bin/bash
# Interleaved A/B of room held ahead (emulation): MOONCAKE_PLACE_AHEAD=0 vs default.
out=${1:-.}
for round in 1 2 3; do
  for mode in off on; do
    if [ $mode = off ]; then export MOONCAKE_PLACE_AHEAD=0; else unset MOONCAKE_PLACE_AHEAD; fi
    timeout 300 ./target/release/examples/gpu_store --bench --emulate --iters 300 --min-size 1048576 --max-size 1048576 --replicas shm_peer,own_remote_master 2>/dev/null | grep -v "^device memory" > $out/$mode-$round.json
  done
done
