#!/usr/bin/env bash
# Clang's thread-safety analysis over every C++ translation unit of the daemon, the clients
# and common/ (GCC, the CI compiler, ignores ABSL_GUARDED_BY). -fsyntax-only: no code is
# generated, so the pass costs a fraction of a build (one unit per core at a time). Uses the
# compile commands of a CMake build directory (generated protos must exist: run after the build).
#
#   .ci/thread-safety.sh [BUILD_DIR]     (default: build)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
command -v clang++ >/dev/null || { echo "thread-safety: clang++ not found" >&2; exit 1; }
db=$build/compile_commands.json
[ -f "$db" ] || { echo "thread-safety: no $db (build first)" >&2; exit 1; }
# file<TAB>flags for our own .cc files (not tests, not generated code), with GCC-only
# options dropped and the analysis added.
python3 - "$db" "$root" >"$build/thread-safety.list" <<'PY'
import json, shlex, sys
db, root = sys.argv[1], sys.argv[2]
gcc_only = {"-fno-sanitize-recover=undefined"}
for entry in json.load(open(db)):
    f = entry["file"]
    if not f.startswith(root + "/") or not f.endswith(".cc"):
        continue
    rel = f[len(root) + 1:]
    if not rel.startswith(("server/", "client/", "common/")):
        continue
    args = shlex.split(entry["command"])[1:]
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT"):
            skip = True
            continue
        if a in ("-c", "-MD", f) or a in gcc_only or a.startswith("-fsanitize"):
            continue
        keep.append(a)
    print(f + "\t" + " ".join(shlex.quote(a) for a in keep))
PY
# One translation unit per core at a time; each writes its findings to its own file.
jobs="${GPUFEED_JOBS:-$(nproc)}"
out=$build/thread-safety.d
rm -rf "$out"
mkdir -p "$out"
count=0
while IFS=$'\t' read -r file flags; do
  count=$((count + 1))
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  (
    if ! eval clang++ "$flags" -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror \
        -Wno-unknown-warning-option -Wno-unused-command-line-argument "$file" \
        >"$out/$count.log" 2>&1; then
      { echo "thread-safety: ${file#$root/}:"; grep -E "warning|error" "$out/$count.log" | head -20; } \
        >"$out/$count.fail"
    fi
  ) &
done <"$build/thread-safety.list"
wait
fail=0
for f in "$out"/*.fail; do
  [ -f "$f" ] || continue
  fail=$((fail + 1))
  cat "$f"
done
echo "thread-safety: $count translation units, $fail with findings"
[ "$fail" -eq 0 ]
