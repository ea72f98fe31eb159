#!/usr/bin/env bash
# Re-attach and MPS on the GPU machine, in one call (here: tests/run.sh && .ci/device/bundle.sh;
# device: run with carry [".devbundle"]: bash .ci/device/run_round2_on_device.sh). Steps:
#   1. the GPU suite (label gpu);
#   2. PTX: the fused kernel's tests again with CUDA_FORCE_PTX_JIT=1 (the driver JIT-compiles
#      the compute_75 PTX instead of loading the sm_90 code): the same results. (nvJPEG's own
#      kernels have no PTX to force, so its tests are left out of this step.);
#   3. re-attach: device delivery across two SIGKILLs (.ci/device/reattach_on_device.sh), of
#      tokens and of images through the staged image ring (nvJPEG + the fused kernel);
#   4. MPS: with a control daemon running, gpufeedd and a consumer that use it say so
#      (gpufeedctl status, Session.mps), a consumer that does not is warned;
#   5. isolation: session A's rate (nvJPEG + GPU augment, B=128) alone, beside session B that
#      holds each batch 10 s, and alone again: B must not lower A's rate by more than 5 %.
# Writes summary.log and logs.tgz under $OUT. SKIP="suite ptx reattach mps isolation".
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-round2  # the logs; summary.log and logs.tgz go to $final
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
gtest_summary() { grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) |Failure' "$1" | head -${2:-60}; }

# gpufeedd with 2 GiB of staging and 8 GiB of device memory (device_env.sh's start_daemon).
start() { start_daemon "$1" "$2" --staging_bytes=$((2 << 30)) --device_bytes=$((8 << 30)); }

if want suite; then
  log "1. GPU suite"
  timeout 600 "$bundle/bin/gpufeed_gpu_tests" >"$out/gpu_tests.log" 2>&1
  log "exit $?"; gtest_summary "$out/gpu_tests.log" 80 | tee -a "$out/summary.log"
fi

if want ptx; then
  log "2. the fused kernel's tests with CUDA_FORCE_PTX_JIT=1 (compute_75 PTX, JIT-compiled)"
  CUDA_FORCE_PTX_JIT=1 timeout 600 "$bundle/bin/gpufeed_gpu_tests" \
      --gtest_filter='ImageGpuTest.FusedKernel*' >"$out/ptx_tests.log" 2>&1
  rc=$?
  log "exit $rc, $(grep -c '^\[       OK' "$out/ptx_tests.log") OK, $(grep -c '^\[  FAILED' "$out/ptx_tests.log") FAILED"
  gtest_summary "$out/ptx_tests.log" 40 | grep -v '^\[       OK' | tee -a "$out/summary.log"
fi

if want reattach; then
  log "3. re-attach: device delivery across two SIGKILLs"
  OUT=$out bash "$root/.ci/device/reattach_on_device.sh" >/dev/null 2>&1
  grep -E "PASS|FAIL|memory|kill|batches" "$out/reattach.log" | tee -a "$out/summary.log"
  log "3b. the same with images: decode nvjpeg, augment gpu, the staged image ring"
  images=/tmp/gpufeed-r2-reattach-images
  python3 "$root/tests/bench/image/make_dataset.py" --out "$images" --images 4000 --classes 10 \
      --seed 0 >"$out/make_dataset-reattach.log" 2>&1
  OUT=$out IMAGES=$images TAG=images bash "$root/.ci/device/reattach_on_device.sh" >/dev/null 2>&1
  grep -E "PASS|FAIL|memory|kill|batches|checksum" "$out/reattach-images.log" | tee -a "$out/summary.log"
fi

tokens=/tmp/gpufeed-r2-tokens.bin
head -c $((1 << 24)) /dev/urandom >"$tokens"
if want mps; then
  log "4. MPS"
  mps=/tmp/gpufeed-mps; rm -rf "$mps"; mkdir -p "$mps/pipe" "$mps/log"
  export CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log
  nvidia-cuda-mps-control -d && log "MPS control daemon started"
  if start /tmp/gf-mps.sock "$out/daemon-mps.log"; then
    grep -E "MPS" "$out/daemon-mps.log" | head -2 | tee -a "$out/summary.log"
    log "status: $("$ctl" --socket /tmp/gf-mps.sock status -o json)"
    cat >"$out/mps_check.py" <<'EOF'
import sys, warnings
sys.path.insert(0, sys.argv[1])
import gpufeed.torch, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    loader = gpufeed.torch.Loader(sys.argv[2], socket=sys.argv[3], kind="tokens", seq_len=255,
                                  token_dtype="uint16", batch_size=8, device="cuda:0",
                                  job=sys.argv[4])
    batch = next(iter(loader))
    print("mps (daemon, consumer):", loader._session.mps, "sum", int(batch["tokens"].sum()))
    loader.close()
print("warnings:", [str(w.message) for w in caught if "MPS" in str(w.message)])
EOF
    log "consumer under MPS: $(python3 "$out/mps_check.py" "$root/client/python/src" "$tokens" /tmp/gf-mps.sock same 2>&1 | tr '\n' ' ')"
    log "consumer not under MPS: $(CUDA_MPS_PIPE_DIRECTORY=/nonexistent python3 "$out/mps_check.py" "$root/client/python/src" "$tokens" /tmp/gf-mps.sock other 2>&1 | tr '\n' ' ')"
    stop_daemon
  fi
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  if start /tmp/gf-nomps.sock "$out/daemon-nomps.log"; then
    log "no MPS: $(grep -E "MPS" "$out/daemon-nomps.log" | head -1)"
    log "status: $("$ctl" --socket /tmp/gf-nomps.sock status | grep gpus)"
    stop_daemon
  fi
fi

if want isolation; then
  log "5. isolation: a session holding each batch 10 s beside another on the same GPU"
  data=/tmp/gpufeed-r2-images
  python3 "$root/tests/bench/image/make_dataset.py" --out "$data" --images 4000 --classes 10 \
      --seed 0 >"$out/make_dataset.log" 2>&1
  find "$data" -name '*.jpg' -print0 | xargs -0 cat >/dev/null
  sock=/tmp/gf-iso.sock
  if start "$sock" "$out/daemon-iso.log"; then
    rate() {  # rate TAG: session A's batches/s over 500 batches
      "$ctl" --socket "$sock" consume --job "a-$1" --kind image_folder --dataset "$data" \
          --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 128 \
          --device cuda:0 --decode nvjpeg --augment gpu --epochs 0 --max-batches 500 -o json \
          >"$out/iso-$1.json" 2>"$out/iso-$1.err"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d['batches_per_s'], 2))" "$out/iso-$1.json"
    }
    warm=$(rate warmup)  # nvJPEG's first use and the page cache, not measured
    alone1=$(rate alone1)
    "$ctl" --socket "$sock" consume --job holder --kind image_folder --dataset "$data" \
        --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 128 \
        --device cuda:0 --decode nvjpeg --augment gpu --epochs 0 --max-batches 1000 \
        --ring-slots 2 --step-ms 10000 >"$out/iso-holder.log" 2>&1 &
    holder=$!
    sleep 3
    beside=$(rate beside)
    kill $holder; wait $holder 2>/dev/null
    alone2=$(rate alone2)
    verdict=$(python3 -c "
a=(float('$alone1')+float('$alone2'))/2; b=float('$beside')
print(f'alone {a:.2f} batches/s (runs: $alone1, $alone2; warm-up $warm), beside a holder {b:.2f}: {100*b/a:.1f} %', 'PASS' if b >= 0.95*a else 'FAIL')")
    log "$verdict"
    stop_daemon
  fi
fi
log "done"
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null
