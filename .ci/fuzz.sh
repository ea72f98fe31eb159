#!/usr/bin/env bash
# The fuzz stage: builds the libFuzzer targets of tests/fuzz/ with clang
# (-fsanitize=fuzzer,address,undefined) in build-fuzz/, replays each target's committed
# regressions, then fuzzes each for GPUFEED_FUZZ_SECONDS (default 60) on a copy of its seed
# corpus, as many targets at once as there are cores (GPUFEED_FUZZ_JOBS). Fails on any crash,
# leak, timeout or out-of-memory, naming the input libFuzzer saved
# (build-fuzz/artifacts/<target>/) and how to reproduce it.
#
#   .ci/fuzz.sh                 build and fuzz every target
#   .ci/fuzz.sh npy_header ...  only these targets
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${GPUFEED_FUZZ_SECONDS:-60}"
build=build-fuzz
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(attach_request npy_header pipeline_json mem_frame image_header tar_index)

start=$(date +%s)
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGPUFEED_FUZZ=ON -DGPUFEED_CUDA=OFF >/dev/null
ninja -C "$build" "${targets[@]/#/fuzz_}"
echo "fuzz: built in $(( $(date +%s) - start )) s"

# Leaks are findings too; the limits keep a pathological input from passing as slow.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# One target's regressions, then its timed run; prints its result line, and on a finding
# the log's tail and how to reproduce.
fuzz_one() {
  local t=$1
  local bin="$build/tests/fuzz/fuzz_$t"
  local seeds="tests/fuzz/corpus/$t"
  local regressions="tests/fuzz/regressions/$t"
  local artifacts="$build/artifacts/$t"
  local work="$build/corpus/$t"  # new inputs go here, never into the committed seeds
  rm -rf "$artifacts"
  mkdir -p "$artifacts" "$work"
  local flags=(-timeout=10 -rss_limit_mb=2048 -max_len=16384 -artifact_prefix="$artifacts/")
  # Committed findings replay first; those ending in .open are known, not yet fixed.
  local fixed=() f
  for f in "$regressions"/*; do
    [ -f "$f" ] || continue
    case "$f" in
      *.open) echo "fuzz: $t: known open finding $f (not replayed)" ;;
      *) fixed+=("$f") ;;
    esac
  done
  if [ ${#fixed[@]} -gt 0 ]; then
    if ! "$bin" "${flags[@]}" "${fixed[@]}" >"$artifacts/regressions.log" 2>&1; then
      tail -n 40 "$artifacts/regressions.log"
      echo "fuzz: $t: a committed regression in $regressions fails again"
      return 1
    fi
  fi
  local t0
  t0=$(date +%s)
  if ! "$bin" "${flags[@]}" -max_total_time="$seconds" -print_final_stats=1 \
      "$work" "$seeds" >"$artifacts/fuzz.log" 2>&1; then
    tail -n 60 "$artifacts/fuzz.log"
    echo "fuzz: $t: FAILED (the fuzzer's log: $artifacts/fuzz.log)"
    for f in "$artifacts"/*; do
      case "$f" in *.log) continue ;; esac
      echo "fuzz: $t: FOUND $f ($(stat -c %s "$f") bytes): reproduce with $bin $f"
    done
    return 1
  fi
  echo "fuzz: $t: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$artifacts/fuzz.log" |
                     grep -o '[0-9]*$') runs in $(( $(date +%s) - t0 )) s, no crash"
}

# libFuzzer runs one process on one core: run a target per core at once (CI has two), each
# for the full time, and report in the targets' order once all have ended.
jobs="${GPUFEED_FUZZ_JOBS:-$(nproc)}"
declare -A pid
failed=0
mkdir -p "$build/results"
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  fuzz_one "$t" >"$build/results/$t.txt" 2>&1 &
  pid[$t]=$!
done
for t in "${targets[@]}"; do
  if ! wait "${pid[$t]}"; then failed=1; cat "$build/results/$t.txt" >&2; else cat "$build/results/$t.txt"; fi
done
[ "$failed" -eq 0 ] || exit 1
echo "fuzz: done in $(( $(date +%s) - start )) s"
