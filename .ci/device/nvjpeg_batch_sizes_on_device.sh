#!/usr/bin/env bash
# Whether nvJPEG's hardware batched decode keeps going at each batch size, alone and beside a
# training process on the same GPU, and whether gpufeedd's nvJPEG path does at the same sizes.
# (The interference runs of 2026-12-01/02 saw image_bench go silent with 64-image calls.)
# Each case runs image_bench nvjpeg (a progress line a second on stderr) under a watchdog: no
# new line for STALL_S (8) seconds is a stall, recorded with the process's thread states and
# kernel wait channels and the GPU's engine use, then killed. Prints a table and a JSON line.
# Here: .ci/device/bundle.sh; device: run with carry [".devbundle"]:
# bash .ci/device/nvjpeg_batch_sizes_on_device.sh. SKIP="alone beside daemon"; CASES and BESIDE_CASES
# (below) pick the runs.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-nvjpeg-sizes
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
bench=$bundle/bin/image_bench
data=/tmp/gpufeed-images
stall_s=${STALL_S:-8}
image_dataset "$data" "${IMAGES:-5000}"
export PYTHONPATH=$root/client/python/src GPUFEED_LIBRARY=$bundle/lib/libgpufeed_c.so
results=$out/results.tsv; : >"$results"

# watch TAG PID ERRFILE SECONDS: waits for PID; a stall (no stderr growth for stall_s) is
# recorded and the process killed. Appends "TAG<TAB>ok|stalled<TAB>detail" to results.
watch() {
  local tag=$1 pid=$2 err=$3 limit=$4 last=-1 still=0 t=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; t=$((t + 1))
    local size; size=$(stat -c %s "$err" 2>/dev/null || echo 0)
    if [ "$size" = "$last" ]; then still=$((still + 1)); else still=0; last=$size; fi
    if [ "$still" -ge "$stall_s" ] || [ "$t" -ge "$limit" ]; then
      local why=stalled; [ "$still" -lt "$stall_s" ] && why=overran
      {
        echo "== $tag $why at ${t}s; last line: $(tail -1 "$err")"
        for task in /proc/"$pid"/task/*; do
          echo "$(basename "$task") $(awk '{print $3}' "$task/stat") $(cat "$task/wchan" 2>/dev/null)"
        done | sort -k2 | uniq -c -f1 | head -20
        nvidia-smi dmon -s u -c 2 2>&1
      } >>"$out/$tag.stall.txt"
      kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
      printf '%s\t%s\t%s\n' "$tag" "$why" "$(tail -1 "$err")" >>"$results"
      log "$tag: $why: $(tail -1 "$err"); threads: $(grep -E '^ +[0-9]+ ' "$out/$tag.stall.txt" | tr -s ' ' | tr '\n' ';' | cut -c1-300)"
      return 1
    fi
  done
  wait "$pid"; local rc=$?
  if [ $rc = 3 ]; then  # image_bench's own watchdog: a call that did not return, named
    printf '%s\t%s\t%s\n' "$tag" stalled "$(grep 'stalled:' "$err" | tail -1)" >>"$results"
    log "$tag: $(grep 'stalled:' "$err" | tail -1)"
    return 1
  fi
  local figure; figure=$(grep -o '"images_per_s":[0-9.]*' "$out/$tag.json" | cut -d: -f2)
  [ -n "$figure" ] && figure="$figure images/s" || figure=$(grep -v '^$' "$out/$tag.err" | tail -1)
  printf '%s\t%s\t%s\n' "$tag" "$([ $rc = 0 ] && echo ok || echo "exit $rc")" "$figure" >>"$results"
  log "$tag: exit $rc: $(cat "$out/$tag.json")"
}
# run TAG SECONDS FLAGS...: image_bench nvjpeg under the watchdog.
run() {
  local tag=$1 secs=$2; shift 2
  "$bench" nvjpeg --data "$data" --seconds "$secs" --format rgbi --flags 32 \
      --stall-s $((stall_s > 4 ? stall_s - 3 : 1)) "$@" \
      >"$out/$tag.json" 2>"$out/$tag.err" &
  watch "$tag" $! "$out/$tag.err" $((secs + 30))
}
train_bg() {  # synthetic ResNet-50 on GPU 0 in the background ($train: its pid)
  timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
      "$root/client/python/examples/train_ddp.py" --data "$data" --loader synthetic \
      --steps "${STEPS:-400}" --warmup 20 --json >"$out/train-$1.log" 2>&1 &
  train=$!
  sleep 12  # past torch's start and the warm-up
}

# CASES="TAG:SECONDS:FLAGS;...": image_bench nvjpeg runs alone; BESIDE_CASES the same beside
# a training process.
cases=${CASES-"b256:8:--batch 256;b128:8:--batch 128;b96:8:--batch 96;b64:8:--batch 64;\
b48:8:--batch 48;b32:8:--batch 32;c64:8:--batch 256 --chunk 64;\
paced_b64_p15:15:--batch 64 --step-ms 15;paced_c64_p59:15:--batch 256 --chunk 64 --step-ms 59"}
beside_cases=${BESIDE_CASES-"b64_p15:15:--batch 64 --step-ms 15;\
c64_p59:15:--batch 256 --chunk 64 --step-ms 59;b128_p30:15:--batch 128 --step-ms 30;\
b256_p59:15:--batch 256 --step-ms 59"}
run_cases() {  # run_cases PREFIX "CASES"
  local prefix=$1 list=() c
  IFS=';' read -ra list <<<"$2"
  for c in "${list[@]}"; do
    local tag=${c%%:*} rest=${c#*:}
    # shellcheck disable=SC2086  # the flags split on purpose
    run "$prefix$tag" "${rest%%:*}" ${rest#*:}
  done
}
want alone && [ -n "$cases" ] && run_cases alone_ "$cases"
if want beside && [ -n "$beside_cases" ]; then
  train_bg beside
  run_cases beside_ "$beside_cases"
  kill "$train" 2>/dev/null; wait "$train" 2>/dev/null
fi
if want daemon; then  # gpufeedd's nvJPEG path at full speed, DAEMON_SIZES (its own process)
  sock=/tmp/gf-sizes.sock pipeline=$root/deploy/pipelines/imagenet_train.json
  if start_daemon "$sock" "$out/gpufeedd.log" --staging_bytes=$((4 << 30)) --threads=16; then
    for b in ${DAEMON_SIZES:-64 65 80 96 192 256}; do
      tag=daemon_b$b
      "$ctl" --socket "$sock" consume --job "sizes-$b" --kind image_folder --dataset "$data" \
          --pipeline "$pipeline" --batch-size "$b" --epochs 0 --device cuda:0 --decode nvjpeg \
          --augment gpu --timeout-ms 10000 --max-batches $((${DAEMON_IMAGES:-120000} / b)) \
          >"$out/$tag.json" 2>"$out/$tag.err" &
      watch "$tag" $! "$out/$tag.err" 60
    done
    stop_daemon
  fi
fi
{
  echo
  echo "| case | result | last figure |"
  echo "|---|---|---|"
  awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$results"
  echo
  python3 -c 'import json, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
print(json.dumps({"bench": "nvjpeg_batch_sizes", **{r[0]: r[1] for r in rows}}))' "$results"
} | tee -a "$out/summary.log"
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null
