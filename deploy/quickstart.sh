#!/usr/bin/env bash
# The gpufeed quickstart: installs what is missing, builds, generates a small demo token
# dataset, starts gpufeedd on a socket in a temp dir, runs two consumer processes (rank 0
# and 1 of one job) for one epoch, prints what each received and the throughput, and stops
# the daemon cleanly.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${GPUFEED_BUILD_DIR:-$root/build}

"$root/deploy/install-deps.sh"
echo "== building (first time: a few minutes on 2 cores)"
cmake -S "$root" -B "$build" -G Ninja >/dev/null
ninja -C "$build" gpufeedd gpufeedctl >/dev/null

work=$(mktemp -d /tmp/gpufeed-demo-XXXXXX)
daemon_pid=""
cleanup() {
  if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then kill -TERM "$daemon_pid"; wait "$daemon_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== demo dataset: 2,000,001 uint16 tokens (token k = k mod 50257) in $work/tokens.bin"
python3 - "$work/tokens.bin" <<'PY'
import array, sys
tokens = array.array("H", (k % 50257 for k in range(2_000_001)))
with open(sys.argv[1], "wb") as f:
    tokens.tofile(f)
PY

socket="$work/gpufeed.sock"
echo "== starting gpufeedd on $socket"
"$build/server/gpufeedd" --listen="unix://$socket" --staging_bytes=$((64 << 20)) 2>"$work/gpufeedd.log" &
daemon_pid=$!
ctl="$build/client/ctl/gpufeedctl"
for _ in $(seq 100); do "$ctl" --socket "$socket" status >/dev/null 2>&1 && break; sleep 0.05; done
"$ctl" --socket "$socket" status

echo "== two consumers, rank 0 and 1 of job 'demo': seq_len 256, batch 32 per rank, 1 epoch,"
echo "   each holding a batch 3 ms as a training step would"
common=(consume --job demo --world-size 2 --dataset "$work/tokens.bin" --token-dtype uint16
        --seq-len 256 --batch-size 32 --seed 1 --epochs 1 --checksum --step-ms 3)
"$ctl" --socket "$socket" "${common[@]}" --rank 0 --ids "$work/rank0.ids" >"$work/rank0.out" &
r0=$!
"$ctl" --socket "$socket" "${common[@]}" --rank 1 --ids "$work/rank1.ids" >"$work/rank1.out" &
r1=$!
sleep 0.2
echo "== while they run: gpufeedctl sessions, gpufeedctl feeds"
"$ctl" --socket "$socket" sessions || true
"$ctl" --socket "$socket" feeds || true
wait $r0 $r1

for r in 0 1; do
  echo "-- $(tr '\n' ' ' <"$work/rank$r.out")"
  echo "   first batches:"
  head -n 2 "$work/rank$r.ids" | cut -c1-110 | sed 's/^/     /'
done
python3 - "$work/rank0.ids" "$work/rank1.ids" <<'PY'
import json, sys
ids = [i for path in sys.argv[1:] for line in open(path) for i in json.loads(line)["ids"]]
print(f"== together the two ranks received {len(ids)} samples, {len(set(ids))} distinct: "
      + ("every sample of the epoch's full global batches exactly once" if len(ids) == len(set(ids)) else "DUPLICATES"))
PY

echo "== stopping gpufeedd (SIGTERM)"
kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=""
echo "== daemon log:"
sed 's/^/   /' "$work/gpufeedd.log"
