#!/usr/bin/env bash
# Clang's thread-safety analysis over every C++ translation unit of the daemon, the clients
# and common/ (GCC, the CI compiler, ignores ABSL_GUARDED_BY). -fsyntax-only: no code is
# generated, so the pass costs a fraction of a build. Uses the compile commands of a CMake
# build directory (generated protos must exist there: run after the build).
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
count=0
fail=0
while IFS=$'\t' read -r file flags; do
  count=$((count + 1))
  if ! eval clang++ "$flags" -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror \
      -Wno-unknown-warning-option -Wno-unused-command-line-argument "$file" \
      >"$build/thread-safety.out" 2>&1; then
    fail=$((fail + 1))
    echo "thread-safety: ${file#$root/}:"
    grep -E "warning|error" "$build/thread-safety.out" | head -20
  fi
done <"$build/thread-safety.list"
echo "thread-safety: $count translation units, $fail with findings"
[ "$fail" -eq 0 ]
