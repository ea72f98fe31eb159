#!/usr/bin/env bash
# Re-attach on the GPU machine: device delivery across daemon restarts. A 2-rank tokens job
# (gpufeedctl consume --device cuda:0 --ids --checksum, 2 epochs) while gpufeedd is SIGKILLed
# twice and restarted on the same socket; each rank's ids and checksum must equal a fault-free
# run's, and the GPU's memory must be back to its baseline after. Needs .devbundle (bundle.sh).
# IMAGES=DIR: the same with an ImageFolder instead (imagenet_train.json, decode nvjpeg, augment
# gpu: the staged image ring, batch 64, 2 epochs; DECODE=cpu AUGMENT=cpu DEV= for a CPU-only
# try); TAG names its log (reattach-TAG.log).
set -u
out=${OUT:-/tmp/gpufeed-out}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$root/.devbundle
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
d=$bundle/bin/gpufeedd ctl=$bundle/bin/gpufeedctl
work=$(mktemp -d); sock=$work/gf.sock
logfile=$out/reattach${TAG:+-$TAG}.log
log() { echo "== $(date +%T) $*" | tee -a "$logfile"; }
if [ -n "${IMAGES:-}" ]; then
  # nvJPEG and the fused kernel are deterministic, so a fault-free run's checksums are the
  # reference; decode auto would not be (its CPU share follows timing).
  feed=(--kind image_folder --dataset "$IMAGES" --pipeline "$root/deploy/pipelines/imagenet_train.json"
        --decode "${DECODE:-nvjpeg}" --augment "${AUGMENT:-gpu}" --batch-size 64 --epochs 2 --step-ms 30)
else
  head -c $((1 << 26)) /dev/urandom >"$work/t.bin"  # 32 Mi uint16 tokens
  feed=(--dataset "$work/t.bin" --seq-len 255 --batch-size 64 --epochs 2 --step-ms 2)
fi
start() { "$d" --listen="unix://$sock" --threads=4 --staging_bytes=$((1 << 30)) >>"$work/daemon.log" 2>&1 &
          pid=$!; for _ in $(seq 200); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && return; sleep 0.05; done; }
mem() { command -v nvidia-smi >/dev/null || { echo n/a; return; }; nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
consume() {  # consume TAG: both ranks in the background
  for r in 0 1; do
    "$ctl" --socket "$sock" consume --job j --rank $r --world-size 2 "${feed[@]}" \
        ${DEV---device cuda:0} --ids "$work/$1-$r.ids" \
        --checksum --reconnect-timeout 60s >"$work/$1-$r.out" 2>&1 &
    pids+=($!)
  done
}
base=$(mem); log "GPU memory before: $base MiB"
start; pids=(); consume clean; wait "${pids[@]}"; kill -TERM $pid; wait $pid
log "fault-free: $(grep -hE "^rank|checksum" "$work"/clean-0.out "$work"/clean-1.out | tr "\n" " ")"
start; pids=(); consume fault
for k in 1 2; do
  sleep 0.7; kill -KILL $pid; wait $pid 2>/dev/null; t0=$(date +%s%3N); sleep 0.5; start
  log "kill $k: restarted after $(( $(date +%s%3N) - t0 )) ms"
done
wait "${pids[@]}"; kill -TERM $pid; wait $pid
ok=1
for r in 0 1; do
  grep -E "^rank|checksum" "$work/fault-$r.out" | tee -a "$logfile"
  [ -s "$work/clean-$r.ids" ] && grep -q checksum "$work/fault-$r.out" &&
    cmp -s "$work/clean-$r.ids" "$work/fault-$r.ids" &&
    cmp -s <(grep checksum "$work/clean-$r.out") <(grep checksum "$work/fault-$r.out") ||
    { ok=0; log "rank $r: no run, or ids or checksum DIFFER"; }
  log "rank $r: $(wc -l <"$work/fault-$r.ids") batches"
done
sleep 1; after=$(mem); log "GPU memory after: $after MiB (before: $base MiB)"
# Every consumer and daemon has exited: the GPU's memory is what it was (a few MiB of slack
# for the driver's own bookkeeping).
if [ "$base" != n/a ] && [ "$after" -gt $((base + 8)) ]; then ok=0; log "GPU memory not back to its baseline"; fi
[ $ok = 1 ] && log "PASS: both ranks' ids and checksums equal the fault-free run's, GPU memory back to baseline" || log "FAIL"
for f in "$work"/*.out "$work/daemon.log"; do cp "$f" "$out/${TAG:+$TAG-}$(basename "$f")" 2>/dev/null; done
