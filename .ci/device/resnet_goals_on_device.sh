#!/usr/bin/env bash
# The training-rate goals, measured the way users train (client/python/examples/train_ddp.py under
# torchrun): ResNet-50, bf16, channels_last, SGD, batch 256 per rank, STEPS measured steps
# after 20 warm-up, on 20,000 ~110 KB JPEGs in the page cache, gpufeedd --threads 4. Runs
# on every GPU of the machine (1 or 2 H200: one call per machine kind):
#   synthetic (the ceiling), gpufeed (nvJPEG + GPU augment, device delivery), torchvision's
#   DataLoader (15 workers a rank, pin_memory); then under MPS: synthetic and gpufeed.
# Prints a table (images/s, % of synthetic, the ranks' data wait) and one JSON line; logs
# under $OUT. Here: tests/run.sh && .ci/device/bundle.sh; device: run with carry
# [".devbundle"]: bash .ci/device/resnet_goals_on_device.sh [STEPS]. ONLY="gpufeed ..." runs
# those tags alone; RINGS="2 4" runs the gpufeed tags once per ring depth (--ring-slots);
# THREADS="4 12:4" runs the gpufeed tag once per daemon thread count, T:R with a ring of R
# slots (tags gpufeed-tT[-rR] past the first; the first is the plain gpufeed row);
# MPS_FLAGS="--ring-slots 4": train_ddp.py flags for the MPS gpufeed rows; MPS_THREADS: the
# daemon's --threads under MPS (4); MPS_DECODE_CPU=1 adds an MPS row with --decode cpu. IMAGES=N: a dataset of N images.
# DAEMON_FLAGS="--adaptive_decode": more gpufeedd flags. AB="--nocheapest_cpu_rows": an A/B of
# daemon flags on one host, after the plain gpufeed row: AB_ROUNDS (2) rounds of a row with
# those flags (gpufeed-abN-flags) and one without (gpufeed-abN-base), at the first THREADS.
set -u
steps=${1:-300}
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-goals
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
gpus=$(nvidia-smi -L | wc -l)
data=/tmp/gpufeed-images
image_dataset "$data" "${IMAGES:-20000}"
export PYTHONPATH=$root/client/python/src GPUFEED_LIBRARY=$bundle/lib/libgpufeed_c.so
sock=/tmp/gf-goals.sock
export GPUFEED_SOCKET=$sock

# gpufeedd with 8 GiB of staging and 16 GiB of device memory (device_env.sh's start_daemon).
start() {  # start [THREADS]
  start_daemon "$sock" "$out/gpufeedd.log" --staging_bytes=$((8 << 30)) \
      --device_bytes=$((16 << 30)) --threads="${1:-4}" ${DAEMON_FLAGS:-}
}
train() {  # train TAG LOADER [flags]: one torchrun; the JSON line goes to $out/TAG.json
  local tag=$1 loader=$2; shift 2
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $tag "* && " $ONLY " != *" ${tag%%-*} "* ]] && return 0
  if [ "$loader" = gpufeed ] && [ -n "${RINGS:-}" ]; then
    local k
    for k in $RINGS; do train_one "$tag-ring$k" "$loader" --ring-slots "$k" "$@"; done
    return 0
  fi
  train_one "$tag" "$loader" "$@"
}
train_one() {
  local tag=$1 loader=$2; shift 2
  local sampler=
  if [ "$loader" = gpufeed ]; then  # the sessions' rates, waits and CPU decode share mid-run
    (sleep "${STATS_AFTER_S:-20}"; "$ctl" --socket "$sock" -o json stats --interval 5s --count 1 \
         >"$out/$tag.stats.json" 2>&1) &
    sampler=$!
  fi
  timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$gpus" \
      "$root/client/python/examples/train_ddp.py" --data "$data" --loader "$loader" \
      --steps "$steps" --warmup 20 --json "$@" >"$out/$tag.log" 2>&1
  grep '^{' "$out/$tag.log" | tail -1 >"$out/$tag.json"
  log "$tag: $(grep -E '^(gpufeed|torch|synthetic):' "$out/$tag.log" | tail -1)"
  if [ -n "$sampler" ]; then
    log "$tag: ring $(grep -o '[0-9]* slots x [0-9]* bytes' "$out/gpufeedd.log" | tail -1)"
    wait "$sampler"
    log "$tag: stats mid-run: $(grep -o '"sessions":.*' "$out/$tag.stats.json" | cut -c1-400)"
  fi
}

log "ResNet-50, $gpus GPU(s), $steps steps"
train synthetic synthetic
first=1
for tr in ${THREADS:-4}; do  # T or T:R (R ring slots, the consumer's --ring-slots)
  t=${tr%%:*} ring=; [[ $tr == *:* ]] && ring=${tr#*:}
  tag=gpufeed; [ "$first" = 1 ] || tag=gpufeed-t$t${ring:+-r$ring}
  first=0
  start "$t" && { train "$tag" gpufeed ${ring:+--ring-slots "$ring"}; stop_daemon; }
done
if [ -n "${AB:-}" ]; then
  t=${THREADS:-4}; t=${t%% *}; t=${t%%:*}
  for r in $(seq "${AB_ROUNDS:-2}"); do
    # shellcheck disable=SC2086  # AB splits on purpose
    DAEMON_FLAGS="${DAEMON_FLAGS:-} $AB" start "$t" && { train "gpufeed-ab$r-flags" gpufeed; stop_daemon; }
    start "$t" && { train "gpufeed-ab$r-base" gpufeed; stop_daemon; }
  done
fi
train dataloader torch --workers 15
mps=/tmp/gpufeed-goals-mps; rm -rf "$mps"; mkdir -p "$mps/pipe" "$mps/log"
export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
if nvidia-cuda-mps-control -d; then
  train mps_synthetic synthetic
  # shellcheck disable=SC2086  # MPS_FLAGS splits on purpose
  start "${MPS_THREADS:-4}" && {
    log "$(grep MPS "$out/gpufeedd.log" | tail -1)"
    train mps_gpufeed gpufeed ${MPS_FLAGS:-}
    [ "${MPS_DECODE_CPU:-0}" = 1 ] && train mps_gpufeed-cpu gpufeed --decode cpu ${MPS_FLAGS:-}
    stop_daemon
  }
  echo quit | nvidia-cuda-mps-control
fi
python3 - "$out" "$gpus" "$steps" <<'EOF' | tee -a "$out/summary.log"
import json, pathlib, sys
out, gpus, steps = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def load(tag):
    try:
        return json.loads((out / f"{tag}.json").read_text())
    except Exception:
        return None
rows = [("synthetic", "synthetic", "synthetic"), ("gpufeed", "gpufeed", "synthetic"),
        ("torchvision DataLoader, 15 workers", "dataloader", "synthetic"),
        ("MPS: synthetic", "mps_synthetic", "mps_synthetic"),
        ("MPS: gpufeed", "mps_gpufeed", "mps_synthetic")]
print(f"\n| {gpus}xH200, ResNet-50, {steps} steps | images/s | vs synthetic | data wait |")
print("|---|---:|---:|---:|")
summary = {"bench": "resnet_goals", "gpus": int(gpus), "steps": int(steps)}
for f in sorted({*out.glob("*-ring*.json"), *out.glob("gpufeed-t*.json"),  # RINGS, THREADS
                 *out.glob("gpufeed-ab*.json"),  # AB
                 *out.glob("mps_gpufeed-*.json")}):  # MPS_DECODE_CPU
    tag = f.stem
    if tag.endswith(".stats"):  # the mid-run gpufeedctl stats, not a training run
        continue
    rows.append((tag, tag, "mps_synthetic" if tag.startswith("mps_") else "synthetic"))
for name, tag, ref in rows:
    r, base = load(tag), load(ref)
    if r is None:
        print(f"| {name} | failed | | |")
        continue
    share = r["images_per_s"] / base["images_per_s"] if base else float("nan")
    print(f"| {name} | {r['images_per_s']:,.0f} | {100 * share:.1f} % | "
          f"{100 * r['data_wait_share']:.1f} % |")
    summary[tag] = {"images_per_s": round(r["images_per_s"]), "vs_synthetic": round(share, 4),
                    "data_wait_share": round(r["data_wait_share"], 4)}
print()
print(json.dumps(summary))
EOF
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" --exclude='*.npy' . 2>/dev/null
