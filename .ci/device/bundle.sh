#!/usr/bin/env bash
# Packs what .ci/device/run_on_device.sh needs into .devbundle/ (ignored by git), stripped to
# stay well inside the device tool's 64 MiB carry limit.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${GPUFEED_BUILD_DIR:-$root/build}
out=$root/.devbundle
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
# Each binary with the shared libraries it links that the GPU machine (Ubuntu 24.04) lacks:
# the Debian gRPC/protobuf/Abseil/spdlog/... libraries. glibc, libstdc++, libgcc and the
# NVIDIA driver are the GPU machine's own (newer) and never copied.
own='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread|librt\.so|libcuda\.so|libnvidia-|libgcc_s|libstdc\+\+)'
for f in "$build/server/gpufeedd" "$build/client/ctl/gpufeedctl" "$build/client/c/libgpufeed_c.so" \
         "$build/tests/gpu/gpufeed_gpu_tests" "$build/tests/bench/device_bench" \
         "$build/tests/bench/image_bench" "$build/tests/bench/feed_bench" \
         "$build/tests/bench/cpu_augment_bench" "$build/tests/bench/lm_rows_bench"; do
  case "$f" in *.so) cp -L "$f" "$out/lib/" ;; *) cp -L "$f" "$out/bin/" ;; esac
  ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ $name =~ $own ]] || cp -Ln "$path" "$out/lib/$name" 2>/dev/null || true
  done
done
# pytest for .ci/device/run_python_on_device.sh (the GPU machine has no pytest, no network).
mkdir -p "$root/.devbundle/wheels"
cp "${GPUFEED_PYTEST_WHEELS:-/tmp/wheels}"/*.whl "$root/.devbundle/wheels/" 2>/dev/null ||
  pip download -q pytest -d "$root/.devbundle/wheels" --python-version 3.12 --only-binary=:all: ||
  echo "no pytest wheels: run_python_on_device.sh needs pytest on the GPU machine" >&2
# The self-contained wheel (client/python/build_wheel.sh), for .ci/device/wheel_on_device.sh.
cp "$root"/dist/gpufeed-*.whl "$root/.devbundle/wheels/" 2>/dev/null ||
  echo "no dist/gpufeed-*.whl: run client/python/build_wheel.sh for wheel_on_device.sh" >&2
strip --strip-unneeded "$root"/.devbundle/bin/* "$root"/.devbundle/lib/* 2>/dev/null || true
du -sh "$root/.devbundle"
