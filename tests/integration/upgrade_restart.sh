#!/usr/bin/env bash
# A gpufeedd upgrade in the middle of a job: gpufeedctl consume (2 ranks, a directory of token
# shards, 2 epochs) starts against OLD gpufeedd, which is SIGKILLed mid-stream and replaced on
# the same socket by NEW; each rank's ids and checksum must equal a fault-free run's on NEW.
# Not part of ctest (it needs an older build):
#   tests/integration/upgrade_restart.sh OLD_GPUFEEDD [NEW_GPUFEEDD [GPUFEEDCTL]]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
old=$1 new=${2:-$root/build/server/gpufeedd} ctl=${3:-$root/build/client/ctl/gpufeedctl}
work=$(mktemp -d); sock=$work/gf.sock
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
mkdir "$work/shards"
for k in 0 1 2; do head -c $((3 << 20)) /dev/urandom >"$work/shards/train_$k.bin"; done
start() {  # start BINARY: a daemon on $sock ($pid)
  "$1" --listen="unix://$sock" --threads=2 --staging_bytes=$((256 << 20)) >>"$work/daemon.log" 2>&1 &
  pid=$!
  for _ in $(seq 200); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && return; sleep 0.05; done
  echo "daemon $1 did not start"; exit 1
}
consume() {  # consume TAG: both ranks in the background ($pids)
  pids=()
  for r in 0 1; do
    "$ctl" --socket "$sock" consume --job "j$1" --rank $r --world-size 2 --dataset "$work/shards" \
        --seq-len 255 --batch-size 16 --epochs 2 --ids "$work/$1-$r.ids" --checksum --step-ms 2 \
        --reconnect-timeout 60s >"$work/$1-$r.out" 2>&1 &
    pids+=($!)
  done
}
start "$new"; consume clean; wait "${pids[@]}"; kill -TERM $pid; wait $pid
start "$old"; consume upgrade
sleep 1.5; kill -9 $pid; wait $pid 2>/dev/null
start "$new"
fail=0
for r in 0 1; do
  wait "${pids[$r]}" || { echo "rank $r failed: $(tail -2 "$work/upgrade-$r.out")"; fail=1; continue; }
  # The ids of each batch as delivered once (a batch re-delivered after the restart is not
  # counted twice: consume writes what it handed out).
  if cmp -s <(grep -o '"ids":\[[^]]*\]' "$work/clean-$r.ids") \
            <(grep -o '"ids":\[[^]]*\]' "$work/upgrade-$r.ids") &&
     [ "$(grep '^checksum ' "$work/clean-$r.out")" = "$(grep '^checksum ' "$work/upgrade-$r.out")" ]; then
    echo "rank $r: PASS ($(grep -c ids "$work/upgrade-$r.ids") batches, $(grep '^checksum ' "$work/upgrade-$r.out"))"
  else
    echo "rank $r: FAIL: the stream differs from the fault-free run's"; fail=1
  fi
done
grep -hE "re-attach|resum" "$work"/upgrade-*.out | head -4
exit $fail
