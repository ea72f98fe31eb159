# Sourced by the scripts that run on the GPU machine, after they set $out (their log folder):
# the bundle's binaries and libraries (.ci/device/bundle.sh), nvJPEG's library, and the helpers
# every such script uses. Sets root, bundle, ctl, GPUFEEDD (unless set: another daemon binary
# to run), GPUFEEDCTL, GPUFEED_NVJPEG_LIBRARY.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$root/.devbundle
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
export GPUFEEDD=${GPUFEEDD:-$bundle/bin/gpufeedd} GPUFEEDCTL=$bundle/bin/gpufeedctl
ctl=$bundle/bin/gpufeedctl
if [ -z "${GPUFEED_NVJPEG_LIBRARY:-}" ]; then
  GPUFEED_NVJPEG_LIBRARY=$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvjpeg.so.1[23] \
                               /usr/local/cuda*/lib64/libnvjpeg.so.1[23] 2>/dev/null | head -1)
  export GPUFEED_NVJPEG_LIBRARY
fi
# log: to the terminal and $out/summary.log, and, where the script set $final (its $OUT), to
# $final/progress.log as it happens: a run cut short by the device's limit says how far it got.
log() { echo "== $(date +%T) $*" | tee -a "$out/summary.log" ${final:+"$final/progress.log"}; }
# SKIP="step step ..." leaves those steps out.
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
# start_daemon SOCKET LOG [FLAG...]: gpufeedd on SOCKET in the background ($daemon: its pid)
# with --threads=4 and the flags given, appending to LOG; returns once it answers (30 s).
start_daemon() {
  local sock=$1 logfile=$2; shift 2
  rm -f "$sock"
  "$GPUFEEDD" --listen="unix://$sock" --threads=4 "$@" >>"$logfile" 2>&1 &
  daemon=$!
  for _ in $(seq 300); do "$ctl" --socket "$sock" status >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "gpufeedd did not start: $(tail -3 "$logfile" | tr '\n' ' ')"; return 1
}
stop_daemon() { kill -TERM "$daemon"; wait "$daemon" 2>/dev/null; }
# image_dataset DIR N: N ImageNet-like JPEGs in 100 classes under DIR
# (tests/bench/image/make_dataset.py, seed 0; its log: $out/make_dataset.log), then read once
# so that they sit in the page cache.
image_dataset() {
  python3 "$root/tests/bench/image/make_dataset.py" --out "$1" --images "$2" --classes 100 \
      --seed 0 >"$out/make_dataset.log" 2>&1
  find "$1" -name '*.jpg' -print0 | xargs -0 cat >/dev/null
}
log "machine: $(nvidia-smi -L | tr '\n' ' ') $(nproc) cores; nvJPEG: ${GPUFEED_NVJPEG_LIBRARY:-none}"
# python_env: the Python package from this tree on its bundled C library, and pytest from the
# bundle's wheels where the machine has none.
python_env() {
  export GPUFEED_LIBRARY=$bundle/lib/libgpufeed_c.so
  export PYTHONPATH=$root/client/python/src${PYTHONPATH:+:$PYTHONPATH}
  if ! python3 -c 'import pytest' 2>/dev/null; then
    mkdir -p /tmp/pywheels
    for w in "$bundle"/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/pywheels; done
    export PYTHONPATH=$PYTHONPATH:/tmp/pywheels
  fi
}
# make_images DIR COUNT: tests/bench/image/make_dataset.py's ImageNet-like JPEGs (100 classes,
# seed 0) in DIR, then read once so that the page cache holds them.
make_images() {
  log "dataset"
  python3 "$root/tests/bench/image/make_dataset.py" --out "$1" --images "$2" --classes 100 \
      --seed 0 >"$out/make_dataset.log" 2>&1
  tail -1 "$out/make_dataset.log" | tee -a "$out/summary.log"
  find "$1" -name '*.jpg' -print0 | xargs -0 cat >/dev/null
}
