#!/usr/bin/env bash
# What the daemon's GPU work costs a training context on the same GPU
# without MPS, stage by stage and per nvJPEG output format, and what nvJPEG launches per batch.
#   1. ncu's per-kernel list of nvJPEG's batched decode (batch 32, "batch N" printed after
#      each): kernels per batch, per output format.
#   2. train_ddp.py on synthetic data (ResNet-50, bf16, batch 256, one GPU) alone, then beside
#      image_bench nvjpeg decoding one batch of 256 every STEP_MS (the training's own pace)
#      in each output format, and beside the daemon's nvJPEG + kernel path
#      (gpufeedctl consume --device cuda:0 --step-ms STEP_MS).
#   3. nvJPEG's batched decode alone with the batch size fixed, then alternating (the decoder
#      re-initialised before every batch, as when the rows nvJPEG takes vary).
#   4. the CPU image path (decode cpu, augment cpu, 16 threads), libjpeg-turbo's one-core
#      rate and torchvision's DataLoader (15 workers), for part 4's goal (CPU_AUGMENT_BENCH=0
#      leaves out the one-core augment table).
# Here: tests/run.sh && .ci/device/bundle.sh; device: run with carry [".devbundle"]:
# bash .ci/device/interference_on_device.sh. SKIP="ncu train vary cpu" leaves parts out.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-interference
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
bench=$bundle/bin/image_bench
steps=${STEPS:-150}
step_ms=${STEP_MS:-59}
data=/tmp/gpufeed-images
image_dataset "$data" "${IMAGES:-5000}"
export PYTHONPATH=$root/client/python/src GPUFEED_LIBRARY=$bundle/lib/libgpufeed_c.so
pipeline=$root/deploy/pipelines/imagenet_train.json
sock=/tmp/gf-interference.sock

if want ncu; then
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for fmt in rgbi yuv; do
    timeout 90 "$ncu" --target-processes all -c "${NCU_KERNELS:-80}" --print-summary per-kernel \
        --metrics gpu__time_duration.sum "$bench" nvjpeg --data "$data" --batch 32 --seconds 1 \
        --trace 1 --format "$fmt" --flags 32 >"$out/ncu-$fmt.log" 2>&1
    # Kernels profiled before each "batch N" line, then the per-kernel summary's names.
    log "ncu $fmt: kernels per batch: $(awk '/==PROF== Profiling/ {k++} /^batch / {printf "%s ", k; k=0}' \
        "$out/ncu-$fmt.log")"
    log "ncu $fmt: kernels: $(grep -oE '^  [A-Za-z_][A-Za-z0-9_:<>, ]*\(' "$out/ncu-$fmt.log" | sort | uniq -c | \
        tr -s ' ' | tr '\n' ';' | cut -c1-600)"
  done
fi

train() {  # train TAG: synthetic ResNet-50 on GPU 0; its JSON line to $out/TAG.json
  local tag=$1
  # The GPU's clocks, power and throttle reasons meanwhile, every 200 ms.
  nvidia-smi --query-gpu=pstate,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active \
      --format=csv,noheader,nounits -lms 200 >"$out/$tag.smi.csv" 2>/dev/null &
  local smi=$!
  timeout "${TRAIN_TIMEOUT:-120}" python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
      "$root/client/python/examples/train_ddp.py" --data "$data" --loader synthetic \
      --steps "$steps" --warmup 20 --json >"$out/$tag.log" 2>&1
  grep '^{' "$out/$tag.log" | tail -1 >"$out/$tag.json"
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  log "$tag: $(grep -E '^synthetic:' "$out/$tag.log" | tail -1)"
  log "$tag: pstate/sm MHz/mem MHz/W/throttle (most common): $(cut -d, -f1-5 "$out/$tag.smi.csv" | \
      awk -F, '{printf "%s,%d,%s,%d,%s\n", $1, $2 / 50 * 50, $3, $4 / 25 * 25, $5}' | sort | uniq -c | \
      sort -rn | head -3 | tr -s ' ' | tr '\n' ';')"
}
beside() {  # beside TAG FLAGS...: train while image_bench nvjpeg decodes at the training's pace
  local tag=$1; shift
  local flags=("$@"); flags=("${flags[@]/STEP/$step_ms}")
  "$bench" nvjpeg --data "$data" --batch 256 --seconds "${BESIDE_S:-36}" "${flags[@]}" \
      >"$out/$tag.bench.json" 2>"$out/$tag.bench.err" &
  local pid=$!
  sleep 4  # the files into pinned memory, the decoder warmed up
  train "$tag"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill "$pid" 2>/dev/null && log "$tag: image_bench still running 20 s after the training: stopped"
  wait "$pid"
  log "$tag: beside $(cat "$out/$tag.bench.json")"
}
# BESIDE="TAG:FLAGS;TAG:FLAGS": the image_bench nvjpeg runs to train beside (STEP in FLAGS
# is the training's pace; BESIDE="" runs none); DAEMON=0 leaves out the daemon's own paths,
# DAEMON_ROWS="nvjpeg cpu auto" picks among them; THREADS: the daemon's --threads (4).
default_beside="nvjpeg_rgbi_interp:--format rgbi --flags 32 --step-ms STEP;nvjpeg_rgbi:--format rgbi --step-ms STEP;\
nvjpeg_yuv:--format yuv --step-ms STEP;nvjpeg_y:--format y --step-ms STEP;\
nvjpeg_unchanged:--format unchanged --step-ms STEP;nvjpeg_rgbi_interp_full:--format rgbi --flags 32"
daemon_beside() {  # daemon_beside TAG DECODE: train beside gpufeedctl consume at its pace
  local tag=$1 decode=$2
  "$ctl" --socket "$sock" consume --job "beside-$decode" --kind image_folder --dataset "$data" \
      --pipeline "$pipeline" --batch-size 256 --epochs 0 --device cuda:0 --decode "$decode" \
      --augment gpu --step-ms "$step_ms" --max-batches 100000 >"$out/$tag.consume.log" 2>&1 &
  local cpid=$!
  sleep 6
  train "$tag"
  log "$tag: $("$ctl" --socket "$sock" -o json stats --interval 2s --count 1 2>&1 | grep -o '"sessions":.*' | cut -c1-300)"
  # SIGTERM: a background job of a non-interactive shell ignores SIGINT.
  kill -TERM "$cpid" && log "$tag: consume still running at the end, as it should"
  wait "$cpid" 2>/dev/null
}
if want train; then
  train alone
  variants=()  # BESIDE="" runs none
  [ -n "${BESIDE-$default_beside}" ] && IFS=';' read -ra variants <<<"${BESIDE-$default_beside}"
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086  # the flags split on purpose
    beside "${v%%:*}" ${v#*:}
  done
  tags=$(for v in "${variants[@]}"; do printf '%s ' "${v%%:*}"; done)
  if [ "${DAEMON:-1}" = 1 ] && start_daemon "$sock" "$out/gpufeedd.log" --staging_bytes=$((4 << 30)) --device_bytes=$((8 << 30)) --threads="${THREADS:-4}"; then
    for d in ${DAEMON_ROWS:-nvjpeg cpu auto}; do
      case $d in
        nvjpeg) daemon_beside daemon_nvjpeg nvjpeg ;;
        cpu) daemon_beside daemon_cpu_decode_gpu_kernel cpu ;;
        auto) daemon_beside daemon_auto auto ;;
      esac
    done
    stop_daemon
  fi
  # Under MPS when its control daemon runs (started by the caller, as for the MPS rows).
  mps_on=no; pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1 && mps_on=yes
  python3 - "$out" "$step_ms" "$tags" "$mps_on" <<'EOF' | tee -a "$out/summary.log"
import json, pathlib, sys
out, step, tags = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
under = "under MPS" if sys.argv[4] == "yes" else "no MPS"
def load(tag):
    try:
        return json.loads((out / f"{tag}.json").read_text())
    except Exception:
        return None
base = load("alone")
def label(tag):  # what image_bench ran beside, from its own JSON line
    try:
        b = json.loads((out / f"{tag}.bench.json").read_text())
    except Exception:
        return tag
    pace = f"a batch every {b['step_ms']} ms" if b["step_ms"] else "full speed"
    flags = ", interpolation" if "flags 32" in b["label"] else ""
    return f"image_bench nvjpeg: {b['backend']} {b['format']}{flags}, {pace}"
rows = ([("training alone", "alone")] + [(label(t), t) for t in tags] +
        [(f"gpufeedd nvJPEG + kernel, consume --step-ms {step}", "daemon_nvjpeg"),
         (f"gpufeedd CPU decode + kernel, consume --step-ms {step}", "daemon_cpu_decode_gpu_kernel"),
         (f"gpufeedd decode auto (adaptive CPU share), consume --step-ms {step}", "daemon_auto")])
print(f"\n| beside synthetic ResNet-50 training, 1 GPU, {under} | training images/s | vs alone | decode images/s |")
print("|---|---:|---:|---:|")
summary = {"bench": "interference"}
for name, tag in rows:
    r = load(tag)
    if r is None:
        print(f"| {name} | failed | | |")
        continue
    try:
        beside = json.loads((out / f"{tag}.bench.json").read_text())["images_per_s"]
    except Exception:
        beside = None
    share = r["images_per_s"] / base["images_per_s"] if base else float("nan")
    print(f"| {name} | {r['images_per_s']:,.0f} | {100 * share:.1f} % | "
          f"{'' if beside is None else f'{beside:,.0f}'} |")
    summary[tag] = {"images_per_s": round(r["images_per_s"]), "vs_alone": round(share, 4)}
print()
print(json.dumps(summary))
EOF
fi

if want vary; then  # what re-initialising the batched decoder before every batch costs
  for n in 0 4; do
    "$bench" nvjpeg --data "$data" --batch 256 --seconds 10 --flags 32 --vary "$n" \
        2>>"$out/vary.err" | tee -a "$out/vary.jsonl"
  done
  log "vary: $(tr '\n' ' ' <"$out/vary.jsonl")"
fi

if want cpu; then
  [ "${CPU_AUGMENT_BENCH:-1}" = 1 ] &&
    "$bundle/bin/cpu_augment_bench" --data "$data" --files 200 2>>"$out/cpu.err" | tee "$out/cpu_augment.md"
  "$bench" decode --data "$data" --files 2000 2>>"$out/cpu.err" | tee "$out/cpu.jsonl"
  if start_daemon "$sock" "$out/gpufeedd-cpu.log" --threads=16 --staging_bytes=$((4 << 30)); then
    "$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment cpu \
        --seconds 15 --label "CPU decode + CPU augment (16 threads)" 2>>"$out/cpu.err" | tee -a "$out/cpu.jsonl"
    "$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment gpu \
        --seconds 15 --label "CPU decode + GPU kernel (16 threads)" 2>>"$out/cpu.err" | tee -a "$out/cpu.jsonl"
    stop_daemon
  fi
  # The same CPU path decoding every pixel (--noregion_decode): what the region decode gains.
  if start_daemon "$sock" "$out/gpufeedd-cpu-whole.log" --threads=16 --staging_bytes=$((4 << 30)) \
      --noregion_decode; then
    "$bench" feed --socket "$sock" --data "$data" --pipeline "$pipeline" --decode cpu --augment cpu \
        --seconds 15 --label "CPU decode + CPU augment (16 threads, whole decode)" 2>>"$out/cpu.err" | \
        tee -a "$out/cpu.jsonl"
    stop_daemon
  fi
  # The goal's other baseline on the same cores, in the same call: torchvision's DataLoader
  # (15 workers, decode, RandomResizedCrop, flip and normalise in the workers, float32 to
  # the GPU).
  python3 "$root/tests/bench/image/torchvision_bench.py" --data "$data" --batch 256 --workers 15 \
      --seconds 15 --contenders float --json "$out/torchvision.json" >"$out/torchvision.log" 2>&1
  log "cpu: $(tr '\n' ' ' <"$out/cpu.jsonl")"
  log "cpu: torchvision DataLoader: $(tr '\n' ' ' <"$out/torchvision.json" | cut -c1-400)"
  # The CPU-path goal: images/s against 16 cores x the one-core decode rate of this call.
  python3 "$root/tests/bench/image/cpu_path_table.py" "$out/cpu.jsonl" "$out/torchvision.json" | \
      tee -a "$out/summary.log"
fi
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null
