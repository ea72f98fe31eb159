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
