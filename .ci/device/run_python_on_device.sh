#!/usr/bin/env bash
# The Python package on the GPU machine, in one call:
#   here:   tests/run.sh && .ci/device/bundle.sh   (the bundle carries pytest's wheels too)
#   device: run with carry [".devbundle"]:  bash .ci/device/run_python_on_device.sh [STEPS]
# pytest tests/python (device tests included), then train_ddp.py (ResNet-50, bf16,
# channels_last, batch 256, one GPU) fed synthetically, by gpufeed and by a torchvision
# DataLoader(num_workers=15), on the 20,000-JPEG dataset; a table in $OUT/python.md.
set -u
steps=${1:-60}
out=${OUT:-/tmp/gpufeed-out}
mkdir -p "$out"
source "$(dirname "$0")/device_env.sh"
python_env

log "pytest tests/python on $(nvidia-smi -L | head -1)"
python3 -m pytest "$root/tests/python" -q -rs -p no:cacheprovider >"$out/pytest.log" 2>&1
tail -15 "$out/pytest.log" | tee -a "$out/summary.log"

data=/tmp/gpufeed-images
make_images "$data" 20000

sock=/tmp/gpufeed-train.sock
"$GPUFEEDD" --listen="unix://$sock" --threads=4 --staging_bytes=$((2 << 30)) \
    --device_bytes=$((8 << 30)) >"$out/gpufeedd.log" 2>&1 &
daemon=$!
for _ in $(seq 300); do [ -S "$sock" ] && break; sleep 0.1; done
: >"$out/train.jsonl"
for loader in synthetic gpufeed torch; do
  log "train_ddp.py --loader $loader"
  python3 -m torch.distributed.run --nproc_per_node=1 --master-port=29517 "$root/client/python/examples/train_ddp.py" \
      --data "$data" --loader $loader --steps "$steps" --warmup 15 --workers 15 \
      --socket "$sock" --ring-slots 4 --json >"$out/train-$loader.log" 2>&1
  grep -E "^(synthetic|gpufeed|torch):" "$out/train-$loader.log" | tee -a "$out/summary.log"
  grep -E '^\{' "$out/train-$loader.log" >>"$out/train.jsonl" || tail -5 "$out/train-$loader.log" | tee -a "$out/summary.log"
done
kill -TERM "$daemon"
wait "$daemon"
python3 - "$out/train.jsonl" <<'PY' | tee "$out/python.md" | tee -a "$out/summary.log"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
synthetic = next((r["images_per_s"] for r in rows if r["loader"] == "synthetic"), None)
print("| loader | images/s | step ms | data wait share | vs synthetic |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    vs = f"{100 * r['images_per_s'] / synthetic:.0f} %" if synthetic else ""
    print(f"| {r['loader']} | {r['images_per_s']:,.0f} | {r['step_ms']:.1f} | "
          f"{100 * r['data_wait_share']:.1f} % | {vs} |")
print(json.dumps({"bench": "train_ddp", "rows": rows}))
PY
log "done"
