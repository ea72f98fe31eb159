#!/usr/bin/env bash
# Everything the GPU machine runs for device delivery, in one call (see .ci/device/bundle.sh for what travels):
#   here:   .ci/device/bundle.sh            (build must exist: tests/run.sh)
#   device: run with carry [".devbundle"]:  bash .ci/device/run_on_device.sh
# Writes its logs under $OUT (default /tmp/gpufeed-out).
set -u
out=${OUT:-/tmp/gpufeed-out}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$root/.devbundle
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
export GPUFEEDD=$bundle/bin/gpufeedd GPUFEEDCTL=$bundle/bin/gpufeedctl
log() { echo "== $*" | tee -a "$out/summary.log"; }

log "machine: $(nvidia-smi -L | tr '\n' ' ')"
log "GPU tests"
"$bundle/bin/gpufeed_gpu_tests" 2>&1 | tee "$out/gpu_tests.log" | grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) ' | tee -a "$out/summary.log"

log "compute-sanitizer memcheck on the daemon's GPU path"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  work=$(mktemp -d)
  python3 -c "import numpy as np; np.arange(1<<20, dtype=np.uint16).tofile('$work/t.bin')"
  "$sanitizer" --tool memcheck --print-limit 20 "$GPUFEEDD" --listen="unix://$work/gf.sock" \
      --staging_bytes=268435456 >"$out/sanitizer.log" 2>&1 &
  for _ in $(seq 200); do "$GPUFEEDCTL" --socket "$work/gf.sock" status >/dev/null 2>&1 && break; sleep 0.1; done
  for ipc in vmm legacy; do
    "$GPUFEEDCTL" --socket "$work/gf.sock" consume --dataset "$work/t.bin" --seq-len 64 \
        --batch-size 64 --max-batches 200 --epochs 0 --device cuda:0 --ipc $ipc --checksum \
        2>&1 | tail -2 | tee -a "$out/summary.log"
  done
  kill -TERM "$(pgrep -x gpufeedd)"
  wait
  grep -E "ERROR SUMMARY" "$out/sanitizer.log" | tee -a "$out/summary.log"
  rm -rf "$work"
else
  log "compute-sanitizer not found"
fi

log "device benchmark"
data=/tmp/gpufeed-records.npy
python3 - "$data" <<'PY'
import sys, numpy as np
rows = int(4e9 // (3 * 224 * 224))
a = np.lib.format.open_memmap(sys.argv[1], mode="w+", dtype=np.uint8, shape=(rows, 3, 224, 224))
a[:] = (np.arange(rows, dtype=np.uint8)[:, None, None, None] * 7)
a.flush()
PY
"$bundle/bin/device_bench" --dataset "$data" --batches 1000 --latency-batches 10000 \
    2>"$out/device_bench.err" | tee "$out/device_bench.log"
python3 "$root/tests/bench/torch_loader_bench.py" "$data" 100 2>"$out/torch.err" | tee -a "$out/device_bench.log"
log "done"
