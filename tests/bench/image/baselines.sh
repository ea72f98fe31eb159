#!/usr/bin/env bash
# The Python half of the image benchmark, for the GPU machine's one scripted call:
# make the dataset (or reuse a complete one), then measure the torchvision baselines.
# Usage: tests/bench/image/baselines.sh DATA_DIR OUT_DIR [SECONDS]
# Writes OUT_DIR/make_dataset.log, torchvision.log, torchvision.json and torchvision.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data=${1:?usage: baselines.sh DATA_DIR OUT_DIR [SECONDS]}
out=${2:?usage: baselines.sh DATA_DIR OUT_DIR [SECONDS]}
seconds=${3:-20}
mkdir -p "$out"

echo "== dataset: $data"
python3 "$here/make_dataset.py" --out "$data" --images 20000 --classes 100 --seed 0 \
    2>&1 | tee "$out/make_dataset.log"

echo "== torchvision baselines, ${seconds}s each"
python3 "$here/torchvision_bench.py" --data "$data" --batch 256 --workers 15 \
    --seconds "$seconds" --json "$out/torchvision.json" 2>&1 | tee "$out/torchvision.log"
