#!/bin/bash
# Sharing groups on one GPU under MPS: four training jobs (train_ddp.py, one rank each, their
# own seeds) side by side on one image folder, fed by synthetic data, by gpufeed with a feed
# each, and by gpufeed in one sharing group; the aggregate images/s of the four, and the
# daemon's decodes per delivered image. Run on the device machine with .devbundle carried:
#   bash .ci/device/share_groups_on_device.sh [ARCH] [THREADS]    (resnet18, 4)
set -u
arch=${1:-resnet18}
threads=${2:-4}
steps=${STEPS:-100}
out=${OUT:-/tmp/gpufeed-out}
mkdir -p "$out"
source "$(dirname "$0")/device_env.sh"
python_env

data=/tmp/gpufeed-images
make_images "$data" 20000

nvidia-cuda-mps-control -d && log "MPS on"
sock=/tmp/gpufeed-share.sock
start_daemon "$sock" "$out/gpufeedd.log" --threads="$threads" --staging_bytes=$((8 << 30)) \
    --device_bytes=$((16 << 30)) --share_cache_bytes=$((16 << 30)) \
    --metrics_listen=127.0.0.1:9464 || exit 1
decodes() {
  curl -s 127.0.0.1:9464/metrics | awk '/^gpufeed_decodes_total/ {s += $2} END {print s + 0}'
}
: >"$out/share.jsonl"
for mode in synthetic gpufeed shared; do
  loader=$mode; extra=""
  [ "$mode" = shared ] && { loader=gpufeed; extra="--share-group sweep"; }
  d0=$(decodes)
  log "4 x $arch, $mode"
  pids=""
  for i in 0 1 2 3; do
    python3 -m torch.distributed.run --nproc_per_node=1 --master-port=$((29600 + i)) \
        --rdzv-id="share-$mode-$i" "$root/client/python/examples/train_ddp.py" \
        --data "$data" --loader "$loader" --arch "$arch" --batch-size 256 --steps "$steps" \
        --warmup 20 --seed "$i" --socket "$sock" --json $extra \
        >"$out/share-$mode-$i.log" 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  d1=$(decodes)
  for i in 0 1 2 3; do
    grep '^{' "$out/share-$mode-$i.log" | tail -1 | \
        python3 -c "import json,sys; r=json.load(sys.stdin); r['mode']='$mode'; r['job']=$i; \
                    r['decodes']=$d1-$d0; print(json.dumps(r))" \
        >>"$out/share.jsonl" || tail -5 "$out/share-$mode-$i.log" | tee -a "$out/summary.log"
  done
done
stop_daemon
echo quit | nvidia-cuda-mps-control
python3 - "$out/share.jsonl" "$arch" "$threads" <<'PY' | tee -a "$out/summary.log"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["mode"], []).append(r)
syn = sum(r["images_per_s"] for r in by.get("synthetic", []))
print(f"4 jobs x {sys.argv[2]} on 1 H200 (MPS), B=256, gpufeedd --threads {sys.argv[3]}")
print("| 4 jobs | aggregate images/s | vs synthetic | data wait (mean) | decodes per image |")
print("|---|---:|---:|---:|---:|")
summary = {"bench": "share_groups_h200", "arch": sys.argv[2], "threads": int(sys.argv[3])}
for mode in ("synthetic", "gpufeed", "shared"):
    rs = by.get(mode, [])
    if not rs:
        print(f"| {mode} | failed | | | |")
        continue
    agg = sum(r["images_per_s"] for r in rs)
    wait = sum(r["data_wait_share"] for r in rs) / len(rs)
    # Per image the four jobs took (steps + 20 warm-up batches of 256 each; read-ahead extra).
    per = (rs[0]["decodes"] / (4 * 256 * (rs[0]["steps"] + 20)) if mode != "synthetic"
           else float("nan"))
    print(f"| {mode} | {agg:,.0f} | {100 * agg / syn:.0f} % | {100 * wait:.1f} % | {per:.2f} |")
    summary[mode] = round(agg, 1)
print(json.dumps(summary))
PY
log "done"
