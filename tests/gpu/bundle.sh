#!/usr/bin/env bash
# Packs what tests/gpu/run_on_device.sh needs into .devbundle/ (ignored by git), stripped to
# stay well inside the device tool's 64 MiB carry limit.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${GPUFEED_BUILD_DIR:-$root/build}
rm -rf "$root/.devbundle"
bash "$root/../shared/tools/device-bundle" "$root/.devbundle" \
  "$build/server/gpufeedd" "$build/client/ctl/gpufeedctl" "$build/client/c/libgpufeed_c.so" \
  "$build/tests/gpu/gpufeed_gpu_tests" "$build/tests/bench/device_bench" \
  "$build/tests/bench/image_bench"
strip --strip-unneeded "$root"/.devbundle/bin/* "$root"/.devbundle/lib/* 2>/dev/null || true
du -sh "$root/.devbundle"
