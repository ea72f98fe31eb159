#!/bin/bash
# Blends and packing (issue 35) on the GPU machine, in one call (carry [".devbundle"]):
#   bash .ci/device/blend_on_device.sh
# 1. the blend and packing Python tests (host delivery) and the batch-lifetime and device
#    tests (device delivery too: a batch's tensors views of one carrier) on this machine's
#    Python and torch; 2. device delivery: blend_device_check.py (every tensor of every batch
#    in cuda:0 equal to host delivery's, and across a state_dict resume);
#    3. tests/bench/blend_bench.py on this machine's cores, host delivery and cuda:0,
#    --threads 4 and 8, and, where the bundle holds bin/gpufeedd.base (another build's daemon,
#    stripped), the same with it right after, for a before/after on one machine;
#    4. lm_rows_bench: the token dataset's own rows/s by fill threads, 1 to 16.
#    SKIP="pytest device bench rows" leaves steps out; THREADS="4 8" the daemon's --threads
#    for step 3, BENCH_SECONDS its seconds a case.
set -u
out=${OUT:-/tmp/gpufeed-out}
final=${OUT:-}
mkdir -p "$out"
source "$(dirname "$0")/device_env.sh"
python_env
rc=0
if want pytest; then
  log "1. pytest test_blend_pack.py test_blend_options.py test_batch_lifetime.py test_device.py"
  timeout 400 python3 -m pytest "$root/tests/python/test_blend_pack.py" \
      "$root/tests/python/test_blend_options.py" "$root/tests/python/test_batch_lifetime.py" \
      "$root/tests/python/test_device.py" -q -rs -p no:cacheprovider \
      >"$out/pytest.log" 2>&1 || rc=1
  tail -4 "$out/pytest.log" | tee -a "$out/summary.log"
fi
if want device; then
  sock=/tmp/gpufeed-blend.sock
  start_daemon "$sock" "$out/gpufeedd.log" --staging_bytes=$((2 << 30)) || exit 1
  log "2. device delivery of blends and packed rows"
  timeout 300 python3 "$root/.ci/device/blend_device_check.py" "$sock" >"$out/device.log" 2>&1 || rc=1
  tail -3 "$out/device.log" | tee -a "$out/summary.log"
  stop_daemon
fi
if want bench; then
  daemons=("$GPUFEEDD")
  [ -x "$bundle/bin/gpufeedd.base" ] && daemons+=("$bundle/bin/gpufeedd.base")
  for threads in ${THREADS:-4 8}; do
    for dev in cpu cuda:0; do
      for d in "${daemons[@]}"; do
        tag=${dev%%:*}_t$threads$([ "$d" = "$GPUFEEDD" ] || echo _base)
        log "3. blend_bench --threads $threads --device $dev, daemon $(basename "$d")"
        GPUFEEDD=$d GPUFEEDCTL=$ctl timeout 250 python3 "$root/tests/bench/blend_bench.py" \
            --threads "$threads" --device "$dev" --seconds "${BENCH_SECONDS:-5}" \
            >"$out/bench_$tag.log" 2>&1 || rc=1
        tail -8 "$out/bench_$tag.log" | tee -a "$out/summary.log"
      done
    done
  done
fi
if want rows; then
  log "4. lm_rows_bench --threads 1,2,4,8,16"
  timeout 200 "$bundle/bin/lm_rows_bench" --threads 1,2,4,8,16 --seconds 2 \
      >"$out/lm_rows.log" 2>&1 || rc=1
  tee -a "$out/summary.log" < "$out/lm_rows.log"
fi
[ -n "$final" ] && cp "$out"/*.log "$final/" 2>/dev/null
exit $rc
