#!/usr/bin/env bash
# The GPU soak on the GPU machine: .ci/device/soak.py for MINUTES (default 10) on one
# gpufeedd (--threads 12), four consumers on cuda:0 (nvJPEG and CPU-decode train paths, two
# ranks of an nvJPEG eval job), each batch against the CPU path. Here: tests/run.sh &&
# .ci/device/bundle.sh; device: run with carry [".devbundle"]:
#   bash .ci/device/soak_on_device.sh            # in the foreground (needs MINUTES < 9.5)
#   START=1 bash .ci/device/soak_on_device.sh    # starts it in the background and returns
#   WAIT=1 bash .ci/device/soak_on_device.sh     # a later call: waits for it, reports
# A soak longer than one device call (600 s) is started in one call and waited for in the
# next; the machine stays up between two calls made back to back. Logs in /tmp/gpufeed-soak;
# summary.log (the table and JSON line) and logs.tgz under $OUT.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-soak
mkdir -p "$final"
# collect: summary.log and the logs (not the dataset) into $final.
collect() {
  cp "$out/summary.log" "$final/"
  tar -czf "$final/logs.tgz" -C "$out" --exclude='data' . 2>/dev/null
}
report() {
  grep -E '^\||^\{|Error|Traceback' "$out/soak.log" | tail -20 | tee -a "$out/summary.log"
  collect
}
if [ -n "${WAIT:-}" ]; then
  source "$(dirname "$0")/device_env.sh"
  for _ in $(seq "${WAIT_S:-540}"); do [ -f "$out/soak.rc" ] && break; sleep 1; done
  [ -f "$out/soak.rc" ] || log "soak still running after ${WAIT_S:-540} s"
  tail -8 "$out/soak.log" | grep -v '^[|{]'
  cat "$out/summary.log"
  collect
  exit 0
fi
if [ -n "${START:-}" ]; then
  # The whole soak (gpufeedd included) in a session of its own, so that it outlives this
  # call: setsid leaves the call's process group, nohup its hang-up.
  rm -rf "$out"; mkdir -p "$out"
  INNER=1 START= OUT=$out setsid nohup bash "$0" >"$out/foreground.log" 2>&1 </dev/null &
  echo "== $(date +%T) soak started in the background (pid $!), ${MINUTES:-10} minutes" |
    tee -a "$final/progress.log"
  exit 0
fi
[ -n "${INNER:-}" ] || { rm -rf "$out"; mkdir -p "$out"; }
source "$(dirname "$0")/device_env.sh"
data=$out/data
python3 "$root/tests/bench/image/make_dataset.py" --out "$data" --images "${IMAGES:-2000}" \
    --classes 20 --seed 3 >"$out/make_dataset.log" 2>&1
log "dataset: $(find "$data" -name '*.jpg' | wc -l) JPEGs, $(du -sh "$data" | cut -f1)"
sock=/tmp/gf-soak.sock
start_daemon "$sock" "$out/gpufeedd.log" --threads=12 --staging_bytes=$((4 << 30)) \
    --device_bytes=$((8 << 30)) || { echo 1 >"$out/soak.rc"; exit 1; }
export PYTHONPATH=$root/client/python/src GPUFEED_LIBRARY=$bundle/lib/libgpufeed_c.so
log "soak: ${MINUTES:-10} minutes"
python3 "$root/.ci/device/soak.py" --data "$data" --socket "$sock" --minutes "${MINUTES:-10}" \
    >"$out/soak.log" 2>&1
rc=$?
stop_daemon
log "soak exit $rc; gpufeedd: $(grep -ciE 'error|fatal' "$out/gpufeedd.log") error lines"
echo $rc >"$out/soak.rc"
report
