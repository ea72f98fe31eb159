#!/usr/bin/env bash
# Builds gpufeed and runs the whole test suite (unit, integration, C ABI; GPU tests skip
# visibly without a GPU). Installs missing build dependencies first.
#
#   tests/run.sh                     # build/ , RelWithDebInfo
#   GPUFEED_SANITIZE=address tests/run.sh   # ASan+UBSan build in build-asan/
#   GPUFEED_SANITIZE=thread tests/run.sh    # TSan build in build-tsan/
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/deploy/install-deps.sh"

sanitize=${GPUFEED_SANITIZE:-}
case "$sanitize" in
  "") build=${GPUFEED_BUILD_DIR:-$root/build} ;;
  address) build=${GPUFEED_BUILD_DIR:-$root/build-asan} ;;
  thread) build=${GPUFEED_BUILD_DIR:-$root/build-tsan} ;;
  *) echo "GPUFEED_SANITIZE: want address or thread, got '$sanitize'" >&2; exit 2 ;;
esac

# A sanitized build leaves out CUDA (its GPU tests only skip where the sanitizers run: CI has
# no GPU) and the benchmarks (programs, not tests): ~12 % of a build's compile time (250 of
# 2,068 s of compiler time in one build of 2026-12-03).
extra=()
[ -z "$sanitize" ] || extra=(-DGPUFEED_CUDA=OFF -DGPUFEED_BENCHMARKS=OFF)
cmake -S "$root" -B "$build" -G Ninja -DGPUFEED_SANITIZE="$sanitize" "${extra[@]}" >/dev/null
ninja -C "$build"
# GPUFEED_BUILD_ONLY=1: stop after the build (.ci/run starts the thread-safety pass then).
[ "${GPUFEED_BUILD_ONLY:-}" != 1 ] || exit 0
# The S3 tests' server (tests/unit/server/objstore): moto from PyPI, which Debian does not
# package, in a venv of Debian's python3 under the build directory; Debian's own packages
# (boto3's dependencies among them) stay visible to it. Made once, then only checked. Where
# PyPI cannot be reached those tests skip, saying so; the rest of the suite runs.
s3_venv="$build/s3-venv"
if ! "$s3_venv/bin/python3" -c "import moto.server" 2>/dev/null; then
  /usr/bin/python3 -m venv --system-site-packages "$s3_venv" &&
    "$s3_venv/bin/pip" install -q --disable-pip-version-check 'moto[server]>=5,<6' ||
    echo "gpufeed: no moto in $s3_venv (PyPI unreachable?): the S3 tests will skip" >&2
fi
cd "$build"
if [ "$sanitize" = "thread" ]; then
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
fi
ctest --output-on-failure -j2 --timeout 300

# The Python package: pytest against this build's daemon and C library, with Debian's
# python3 and python3-torch. Not under sanitizers (python would need their runtime preloaded).
if [ -z "$sanitize" ]; then
  GPUFEEDD="$build/server/gpufeedd" GPUFEED_LIBRARY="$build/client/c/libgpufeed_c.so" \
    /usr/bin/python3 -m pytest "$root/tests/python" -q -rs -p no:cacheprovider
fi
