#!/usr/bin/env bash
# Everything the GPU machine runs for the image paths, in one call:
#   here:   tests/run.sh && .ci/device/bundle.sh
#   device: run with carry [".devbundle"]:  bash .ci/device/run_images_on_device.sh [SECONDS]
# GPU tests, compute-sanitizer on the kernel and nvJPEG, the 20,000-JPEG dataset, nvJPEG's
# decode limit, gpufeed's three paths, torchvision's two baselines, the torchvision output
# comparison, then one table (images.md) and JSON lines (images.jsonl) under $OUT, with the
# logs in logs.tgz. SKIP="torchvision compare sanitizer tests" leaves those steps out.
set -u
seconds=${1:-20}
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-run
rm -rf "$out"
mkdir -p "$out" "$final"
skip=" ${SKIP:-} "
want() { [[ "$skip" != *" $1 "* ]]; }
root=$(cd "$(dirname "$0")/../.." && pwd)
bundle=$root/.devbundle
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
export GPUFEEDD=$bundle/bin/gpufeedd GPUFEEDCTL=$bundle/bin/gpufeedctl
if [ -z "${GPUFEED_NVJPEG_LIBRARY:-}" ]; then
  GPUFEED_NVJPEG_LIBRARY=$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvjpeg.so.1[23] \
                               /usr/local/cuda*/lib64/libnvjpeg.so.1[23] 2>/dev/null | head -1)
  export GPUFEED_NVJPEG_LIBRARY
fi
bench=$bundle/bin/image_bench
data=/tmp/gpufeed-images
jsonl=$out/images.jsonl
: >"$jsonl"
log() { echo "== $(date +%T) $*" | tee -a "$out/summary.log"; }

log "machine: $(nvidia-smi -L | tr '\n' ' ') $(nproc) cores; nvJPEG: ${GPUFEED_NVJPEG_LIBRARY:-none}"
if want tests; then
  log "GPU tests"
  "$bundle/bin/gpufeed_gpu_tests" 2>&1 | tee "$out/gpu_tests.log" |
    grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |\[ measure \]' | tee -a "$out/summary.log"
  grep -E -A12 '^[^ ]*:[0-9]+: Failure' "$out/gpu_tests.log" | grep -v '^\[20' | head -60 | tee -a "$out/summary.log"
fi

log "dataset"
python3 "$root/tests/bench/image/make_dataset.py" --out "$data" --images 20000 --classes 100 \
    --seed 0 >"$out/make_dataset.log" 2>&1
tail -3 "$out/make_dataset.log" | tee -a "$out/summary.log"
# Into the page cache, for every contender.
find "$data" -name '*.jpg' -print0 | xargs -0 cat >/dev/null

start_daemon() {  # start_daemon THREADS [sanitizer]
  sock=/tmp/gpufeed-bench.sock
  rm -f "$sock"
  $2 "$GPUFEEDD" --listen="unix://$sock" --threads="$1" --staging_bytes=$((2 << 30)) \
      --device_bytes=$((8 << 30)) >>"$out/gpufeedd.log" 2>&1 &
  daemon=$!
  for _ in $(seq 600); do "$GPUFEEDCTL" --socket "$sock" status >/dev/null 2>&1 && return; sleep 0.1; done
  log "gpufeedd did not start:"
  tail -5 "$out/gpufeedd.log" | tee -a "$out/summary.log"
}
stop_daemon() {  # TERM to gpufeedd itself (a sanitizer in front would not pass it on)
  pkill -TERM -x gpufeedd
  wait "$daemon"
  while pgrep -x gpufeedd >/dev/null; do sleep 0.1; done
}

log "compute-sanitizer memcheck: nvJPEG + kernel, CPU decode + kernel"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ] && want sanitizer; then
  start_daemon 8 "$sanitizer --tool memcheck --print-limit 20"
  for decode in nvjpeg cpu; do
    "$GPUFEEDCTL" --socket "$sock" consume --kind image_folder --dataset "$data" \
        --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 64 --epochs 0 \
        --max-batches 20 --device cuda:0 --decode $decode --augment gpu --checksum 2>&1 |
      tail -2 | tee -a "$out/summary.log"
  done
  stop_daemon
  grep -E "ERROR SUMMARY" "$out/gpufeedd.log" | tee -a "$out/summary.log"
fi

log "nvJPEG decode alone"
"$bench" nvjpeg --data "$data" --batch 256 --seconds "$seconds" 2>>"$out/bench.err" | tee -a "$jsonl"
"$bench" nvjpeg --data "$data" --batch 256 --seconds "$seconds" --flags 32 2>>"$out/bench.err" | tee -a "$jsonl"

log "gpufeed paths"
pipeline=$root/deploy/pipelines/imagenet_train.json
start_daemon 15 ""
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment cpu \
    --seconds "$seconds" --label "gpufeed CPU decode + CPU augment (15 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment gpu \
    --seconds "$seconds" --label "gpufeed CPU decode + GPU kernel (15 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode nvjpeg --augment gpu \
    --seconds "$seconds" --label "gpufeed nvJPEG + GPU kernel (15 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment cpu \
    --device host --seconds "$seconds" --label "gpufeed CPU path, host delivery (15 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
stop_daemon
start_daemon 3 ""
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode nvjpeg --augment gpu \
    --seconds "$seconds" --label "gpufeed nvJPEG + GPU kernel (3 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
stop_daemon
export GPUFEED_NVJPEG_INTERPOLATION=0
start_daemon 3 ""
unset GPUFEED_NVJPEG_INTERPOLATION
"$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode nvjpeg --augment gpu \
    --seconds "$seconds" --label "gpufeed nvJPEG (own upsampling) + GPU kernel (3 threads)" 2>>"$out/bench.err" | tee -a "$jsonl"
stop_daemon
grep -c "decoding those on the CPU" "$out/gpufeedd.log" | sed 's/^/nvJPEG batches redone on the CPU: /' | tee -a "$out/summary.log"

log "libjpeg-turbo single-core decode rate"
"$bench" decode --data "$data" --files 2000 2>>"$out/bench.err" | tee -a "$jsonl"

log "nvJPEG vs libjpeg-turbo on the dataset: centre 320x320 of 256 images, uint8"
cat >"$out/centre.json" <<'JSON'
{"ops": [{"center_crop": {"size": 320}}, {"cast": {"dtype": "DTYPE_UINT8"}},
         {"layout": {"layout": "IMAGE_LAYOUT_NHWC"}}]}
JSON
start_daemon 8 ""
for decode in nvjpeg cpu; do
  "$GPUFEEDCTL" --socket "$sock" consume --job "dump-$decode" --kind image_folder --dataset "$data" \
      --pipeline "$out/centre.json" --batch-size 256 --max-batches 1 --epochs 0 --seed 3 \
      --device cuda:0 --decode $decode --augment gpu --dump "$out/dump-$decode" >/dev/null 2>>"$out/bench.err"
done
stop_daemon
python3 - "$out/dump-nvjpeg" "$out/dump-cpu" <<'PY' | tee -a "$out/summary.log" | tee -a "$jsonl"
import json, sys
import numpy as np
a, b = (np.load(p + ".image.npy").astype(np.int16) for p in sys.argv[1:3])
same = (np.load(sys.argv[1] + ".ids.npy") == np.load(sys.argv[2] + ".ids.npy")).all()
d = np.abs(a - b)
print(json.dumps({"tool": "nvjpeg_vs_turbo", "images": int(a.shape[0]), "same_ids": bool(same),
                  "mad": round(float(d.mean()), 4), "max": int(d.max()),
                  "p99": float(np.percentile(d, 99)), "pass": bool(same and d.mean() <= 1.0)}))
PY

if want torchvision; then
log "torchvision baselines"
python3 "$root/tests/bench/image/torchvision_bench.py" --data "$data" --batch 256 --workers 15 \
    --seconds "$seconds" --json "$out/torchvision.json" >"$out/torchvision.log" 2>&1
tail -12 "$out/torchvision.log" | tee -a "$out/summary.log"
fi

if want compare; then
log "outputs vs torchvision (fixed crops, DCT scaling off)"
for spec in "0:10,20,200,300" "1:0,0,300,300" "2:50,60,120,90" "3:60,100,250,200"; do
  n=${spec%%:*}
  crop=${spec#*:}
  img=$(find "$data" -name '*.jpg' | sort | sed -n "$((n * 997 + 1))p")
  "$bench" crop --image "$img" --crop "$crop" --size 224 --out "$out/crop$n.npy" \
      --decoded "$out/decoded$n.npy" >/dev/null 2>>"$out/bench.err" || { log "crop $n: $img too small"; continue; }
  python3 "$root/tests/bench/image/compare_torchvision.py" --image "$img" --ours "$out/crop$n.npy" \
      --crop "$crop" --size 224 --ref-decode "$out/decoded$n.npy" 2>&1 | tee -a "$out/summary.log"
done
fi

log "table"
python3 - "$jsonl" "$out/torchvision.json" <<'PY' | tee "$out/images.md" | tee -a "$out/summary.log"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
rows = [r for r in rows if "images_per_s" in r]
try:
    tv = json.load(open(sys.argv[2]))
    tv = tv.get("results", tv) if isinstance(tv, dict) else tv
    for r in (tv if isinstance(tv, list) else []):
        rows.append({"label": r.get("label", r.get("name", "torchvision")),
                     "images_per_s": r.get("images_per_s"), "busy_cores": r.get("busy_cores")})
except Exception as e:  # the table still shows ours
    print(f"(torchvision.json unreadable: {e})")
print("| contender | images/s | busy CPU cores |")
print("|---|---:|---:|")
for r in rows:
    ips = r.get("images_per_s")
    cores = r.get("busy_cores")
    ips_text = "failed" if ips is None else f"{ips:,.0f}"
    print(f"| {r.get('label', '?')} | {ips_text} | {'' if cores is None else f'{cores:.1f}'} |")
print(json.dumps({"bench": "images", "rows": rows}))
PY
log "done"
cp "$out/summary.log" "$out/images.md" "$jsonl" "$final/"
tar czf "$final/logs.tgz" -C "$out" --exclude='*.npy' .
