#!/bin/bash
# Round 3 on the GPU machine, in one call (carry [".devbundle"]):
#   bash .ci/device/elastic_on_device.sh
# 1. the GPU test binary (ctest label gpu); 2. elastic resume with device delivery
#    (elastic_device_check.py: 4 -> 2 ranks keeping the global batch, bytes equal with the
#    CPU decoder and ids equal with nvJPEG; 4 -> 3 keeping the per-rank batch, each sample
#    once); 3. the sharing-group and elastic Python tests (host delivery) on this machine's
#    Python. SKIP="gputests elastic pytest" leaves steps out.
set -u
out=${OUT:-/tmp/gpufeed-out}
final=${OUT:-}
mkdir -p "$out"
source "$(dirname "$0")/device_env.sh"
python_env
rc=0
if want gputests; then
  log "1. gpufeed_gpu_tests"
  timeout 300 "$bundle/bin/gpufeed_gpu_tests" --gtest_brief=1 >"$out/gpu_tests.log" 2>&1 || rc=1
  tail -4 "$out/gpu_tests.log" | tee -a "$out/summary.log"
fi
if want elastic; then
  data=/tmp/gpufeed-elastic-images
  make_images "$data" 2000
  sock=/tmp/gpufeed-elastic.sock
  start_daemon "$sock" "$out/gpufeedd.log" --staging_bytes=$((2 << 30)) || exit 1
  log "2. elastic resume, device delivery"
  timeout 400 python3 "$root/.ci/device/elastic_device_check.py" "$data" "$sock" \
      >"$out/elastic.log" 2>&1 || rc=1
  tail -3 "$out/elastic.log" | tee -a "$out/summary.log"
  stop_daemon
fi
if want pytest; then
  log "3. pytest test_elastic_resume.py test_share_groups.py"
  timeout 300 python3 -m pytest "$root/tests/python/test_elastic_resume.py" \
      "$root/tests/python/test_share_groups.py" -q -rs -p no:cacheprovider \
      >"$out/pytest.log" 2>&1 || rc=1
  tail -4 "$out/pytest.log" | tee -a "$out/summary.log"
fi
[ -n "$final" ] && cp "$out"/*.log "$final/" 2>/dev/null
exit $rc
