#!/usr/bin/env bash
# A release's checks on the GPU machine, in one call (here: tests/run.sh && .ci/device/bundle.sh;
# the previous release's gpufeedd, gpufeedctl and image_bench in .devbundle/old/, if any, for
# the before/after steps). Steps:
#   1. the GPU suite (label gpu), new daemon;
#   2. the multi-session nvJPEG tests against the previous daemon, if bundled (they must fail
#      or time out there: proof they catch the faults they were written for);
#   3. the multi-session repro as users drive it: gpufeedctl consume, ImageNet training pipeline,
#      B=256, device delivery, 3 epochs, on ~80 KB JPEGs; with the new daemon (and the old);
#   4. compute-sanitizer memcheck, racecheck and synccheck of a daemon serving sequential and
#      concurrent nvJPEG sessions;
#   5. pytest tests/python; 6. image_bench feed old/new, interleaved; 7. feed_bench (host
#      delivery, tokens, gpufeedctl consume) old/new.
# Writes summary.log (and the logs) under $OUT.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-release
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
# SKIP="suite old sanitizer racecheck pytest bench hostbench" leaves those steps out.
gtest_summary() { grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |\[ measure \]|Failure|bad rows|epoch .* row' "$1" | head -${2:-60}; }

if want suite; then
  log "1. GPU suite, this daemon"
  timeout 900 "$bundle/bin/gpufeed_gpu_tests" >"$out/gpu_tests.log" 2>&1
  echo "exit $?" >>"$out/gpu_tests.log"
  gtest_summary "$out/gpu_tests.log" 80 | tee -a "$out/summary.log"
fi

if [ -x "$bundle/old/gpufeedd" ] && want old; then
  log "2. the multi-session nvJPEG tests against the previous daemon (expected to fail)"
  GPUFEEDD=$bundle/old/gpufeedd timeout 300 "$bundle/bin/gpufeed_gpu_tests" \
      --gtest_filter='NvjpegSessionsTest.*' >"$out/old_tests.log" 2>&1
  echo "exit $?" | tee -a "$out/old_tests.log" "$out/summary.log"
  gtest_summary "$out/old_tests.log" 40 | tee -a "$out/summary.log"
fi

log "3. multi-session repro: gpufeedctl consume, imagenet_train, B=256, device, 3 epochs"
data=/tmp/gpufeed-jpegs
python3 "$root/tests/bench/image/make_dataset.py" --out "$data" --images ${IMAGES:-8000} \
    --classes 100 --min-kb 70 --max-kb 90 >"$out/make_dataset.log" 2>&1
tail -1 "$out/make_dataset.log" | tee -a "$out/summary.log"
find "$data" -name '*.jpg' -print0 | xargs -0 cat >/dev/null
repro() {  # repro NAME DAEMON [consume flags]; the old daemon is driven by the old gpufeedctl
  local name=$1 daemon=$2; shift 2
  local ctl=$ctl
  [ "$daemon" = "$bundle/old/gpufeedd" ] && [ -x "$bundle/old/gpufeedctl" ] && ctl=$bundle/old/gpufeedctl
  local sock=/tmp/gf-$name.sock
  rm -f "$sock"
  "$daemon" --listen="unix://$sock" --threads=4 --staging_bytes=$((4 << 30)) \
      --device_bytes=$((16 << 30)) >"$out/daemon-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && break; sleep 0.1; done
  local t0=$(date +%s%3N)
  timeout 240 "$ctl" --socket "$sock" consume --job j --rank 0 --world-size 1 --kind image_folder \
      --dataset "$data" --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 256 \
      --device cuda:0 --epochs 3 "$@" >"$out/consume-$name.log" 2>&1
  local rc=$? t1=$(date +%s%3N)
  log "$name: consume exit $rc after $(( (t1 - t0) / 1000 )) s: $(tail -2 "$out/consume-$name.log" | tr '\n' ' ')"
  local t2=$(date +%s%3N)
  kill -TERM $pid
  for _ in $(seq 150); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if kill -0 $pid 2>/dev/null; then
    log "$name: gpufeedd did not exit 15 s after SIGTERM"; kill -KILL $pid
  else
    wait $pid; log "$name: gpufeedd exited $? $(( $(date +%s%3N) - t2 )) ms after SIGTERM"
  fi
}
repro new "$GPUFEEDD"
repro new-ring4 "$GPUFEEDD" --ring-slots 4
[ -x "$bundle/old/gpufeedd" ] && want old && repro old "$bundle/old/gpufeedd"

log "4. compute-sanitizer on a daemon serving sequential and concurrent nvJPEG sessions"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
tools=""
want sanitizer && tools="memcheck synccheck" && want racecheck && tools="$tools racecheck"
for tool in $tools; do
  sock=/tmp/gf-san.sock; rm -f "$sock"
  "$sanitizer" --tool $tool --print-limit 20 "$GPUFEEDD" --listen="unix://$sock" --threads=4 \
      --staging_bytes=$((2 << 30)) --device_bytes=$((8 << 30)) >"$out/sanitizer-$tool.log" 2>&1 &
  for _ in $(seq 600); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && break; sleep 0.1; done
  for s in 1 2; do
    timeout 120 "$ctl" --socket "$sock" consume --job s$s --kind image_folder --dataset "$data" \
        --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 64 --epochs 0 \
        --max-batches 12 --device cuda:0 --decode nvjpeg --augment gpu --checksum >/dev/null 2>&1
  done
  pids=()
  for s in 3 4; do
    timeout 120 "$ctl" --socket "$sock" consume --job s$s --kind image_folder --dataset "$data" \
        --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 64 --epochs 0 \
        --max-batches 12 --device cuda:0 --decode nvjpeg --augment gpu --checksum >/dev/null 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"; sleep 1
  pkill -TERM -x gpufeedd; sleep 3; pkill -KILL -x gpufeedd 2>/dev/null; wait 2>/dev/null
  log "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' "$out/sanitizer-$tool.log" | tr '\n' ' ')"
done

if want pytest; then
  log "5. pytest tests/python on the GPU (device variants of the batch lifetime tests included)"
  python_env
  timeout 600 python3 -m pytest "$root/tests/python" -q -rs -p no:cacheprovider >"$out/pytest.log" 2>&1
  tail -6 "$out/pytest.log" | tee -a "$out/summary.log"
fi

if [ -x "$bundle/old/gpufeedd" ] && want bench; then
  log "6. throughput before/after (image_bench feed, imagenet_train, B=256, the step-3 dataset)"
  for name in old new old new; do
    d=$GPUFEEDD; bench=$bundle/bin/image_bench
    [ $name = old ] && d=$bundle/old/gpufeedd && bench=$bundle/old/image_bench
    sock=/tmp/gf-bench.sock; rm -f "$sock"
    "$d" --listen="unix://$sock" --threads=3 --staging_bytes=$((4 << 30)) \
        --device_bytes=$((16 << 30)) >>"$out/daemon-bench.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && break; sleep 0.1; done
    "$bench" feed --socket "$sock" --data "$data" --pipeline "$root/deploy/pipelines/imagenet_train.json" \
        --decode nvjpeg --augment gpu --seconds 12 --label "$name nvJPEG + kernel (3 threads)" \
        2>>"$out/bench.err" | tee -a "$out/summary.log"
    kill -TERM $pid; wait $pid
  done
fi

if [ -x "$bundle/old/gpufeedd" ] && want hostbench; then
  log "7. host delivery before/after (feed_bench: gpufeedctl consume, tokens, 1 and 2 consumers)"
  for name in old new old new; do
    if [ $name = old ]; then
      GPUFEEDD=$bundle/old/gpufeedd GPUFEEDCTL=$bundle/old/gpufeedctl "$bundle/old/feed_bench" \
          >"$out/feed_bench-$name.log" 2>&1
    else
      "$bundle/bin/feed_bench" >"$out/feed_bench-$name.log" 2>&1
    fi
    log "$name:"; grep -E '^\| B=' "$out/feed_bench-$name.log" | tee -a "$out/summary.log"
  done
fi

cp "$out/summary.log" "$final/"
tar czf "$final/logs.tgz" -C "$out" . 2>/dev/null
