#!/usr/bin/env bash
# Prints the distribution packages that own the shared libraries the given programs load, one
# a line: what a runtime image must install to run them (the Dockerfile's runtime stage).
# Derived from the binaries rather than listed by hand, so the list follows the distribution's
# package names (Ubuntu 24.04's libgrpc++1.51t64 is Debian 12's libgrpc++1.51) and the
# libraries the build actually linked. Fails, naming the library, when one is missing or owned
# by no package: the image would lack it.
#
#   deploy/runtime-packages.sh build/server/gpufeedd build/client/ctl/gpufeedctl ...
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 PROGRAM_OR_LIBRARY..." >&2; exit 2; }

ldd_out=$(for f in "$@"; do ldd "$f"; done)
if grep -q "not found" <<<"$ldd_out"; then
  echo "runtime-packages: unresolved libraries:" >&2
  grep "not found" <<<"$ldd_out" >&2
  exit 1
fi

libs=$(awk '$2 == "=>" && $3 ~ /^\// {print $3}' <<<"$ldd_out" | sort -u)
# With a merged /usr the loader's path (/lib/...) and the package's (/usr/lib/...) may differ:
# ask for each spelling, all in one query (dpkg reads its database once per call).
spellings=()
for lib in $libs; do
  real=$(realpath "$lib")
  spellings+=("$lib" "$real" "/usr$lib" "${real#/usr}")
done
owners=$(dpkg-query -S "${spellings[@]}" 2>/dev/null | grep -v '^diversion' || true)

failed=0
packages=()
for lib in $libs; do
  real=$(realpath "$lib")
  owner=""
  for path in "$lib" "$real" "/usr$lib" "${real#/usr}"; do
    owner=$(awk -v p="$path" '$NF == p {sub(/:.*/, "", $1); print $1; exit}' <<<"$owners")
    [ -n "$owner" ] && break
  done
  if [ -z "$owner" ]; then
    echo "runtime-packages: $lib belongs to no package" >&2
    failed=1
  else
    packages+=("$owner")
  fi
done
[ "$failed" -eq 0 ] || exit 1
printf '%s\n' "${packages[@]}" | sort -u
