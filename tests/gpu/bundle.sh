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
# pytest for tests/gpu/run_python_on_device.sh (the GPU machine has no pytest, no network).
mkdir -p "$root/.devbundle/wheels"
cp "${GPUFEED_PYTEST_WHEELS:-/tmp/wheels}"/*.whl "$root/.devbundle/wheels/" 2>/dev/null ||
  pip download -q pytest -d "$root/.devbundle/wheels" --python-version 3.12 --only-binary=:all: ||
  echo "no pytest wheels: run_python_on_device.sh needs pytest on the GPU machine" >&2
strip --strip-unneeded "$root"/.devbundle/bin/* "$root"/.devbundle/lib/* 2>/dev/null || true
du -sh "$root/.devbundle"
