#!/usr/bin/env bash
# The self-contained wheel on the GPU machine, which has no gRPC, protobuf or Abseil.
# Here: tests/run.sh && client/python/build_wheel.sh && .ci/device/bundle.sh (which copies
# dist/gpufeed-*.whl into the bundle); device: run with carry [".devbundle"]:
#   bash .ci/device/wheel_on_device.sh
# Installs the wheel into a fresh venv (torch and numpy from the system's site-packages,
# pytest from the bundle's wheels), checks that every library of the package resolves inside
# the venv or is the system's glibc/libstdc++, and runs tests/python against the installed
# package (GPUFEED_PYTHON_SRC="") with no LD_LIBRARY_PATH, no GPUFEED_LIBRARY and no
# PYTHONPATH in the tests' environment. Only gpufeedd itself (from the bundle, not part of
# the wheel) gets the bundle's libraries, through a wrapper. summary.log under $OUT.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-wheel
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
wheel=$(ls "$bundle"/wheels/gpufeed-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { log "no gpufeed wheel in the bundle"; exit 1; }
venv=$out/venv
python3 -m venv --system-site-packages "$venv"
# torch and numpy come from the interpreter that runs this (on the GPU machine a venv of its
# own, /opt/torch/.venv, whose packages a venv made from it would not see): a .pth adds them.
python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base.pth"
"$venv/bin/pip" install -q --no-index --no-deps "$wheel" >"$out/pip.log" 2>&1 &&
  "$venv/bin/pip" install -q --no-index --find-links "$bundle/wheels" pytest >>"$out/pip.log" 2>&1
log "installed $(basename "$wheel"): $(tail -2 "$out/pip.log" | tr '\n' ' ')"
pkg=$("$venv/bin/python" -c 'import gpufeed, os; print(os.path.dirname(gpufeed.__file__))')
log "package at $pkg"
for so in $(find "$pkg" "$pkg/../gpufeed.libs" -name '*.so*' 2>/dev/null); do
  env -u LD_LIBRARY_PATH ldd "$so" | grep -E 'not found' && log "UNRESOLVED in $so"
done
log "libraries: $(find "$pkg" "$pkg/../gpufeed.libs" -name '*.so*' 2>/dev/null | wc -l) files, \
$(for so in $(find "$pkg" "$pkg/../gpufeed.libs" -name '*.so*' 2>/dev/null); do env -u LD_LIBRARY_PATH ldd "$so"; done | grep -c 'not found') unresolved"
cat >"$out/gpufeedd" <<WRAP
#!/bin/sh
LD_LIBRARY_PATH=$bundle/lib exec $bundle/bin/gpufeedd "\$@"
WRAP
chmod +x "$out/gpufeedd"
log "pytest tests/python against the installed wheel"
(cd "$out" && env -u LD_LIBRARY_PATH -u GPUFEED_LIBRARY -u PYTHONPATH GPUFEED_PYTHON_SRC= \
     GPUFEEDD="$out/gpufeedd" "$venv/bin/python" -m pytest "$root/tests/python" -q \
     -rs -p no:cacheprovider --ignore="$root/tests/python/test_wheel.py" >"$out/pytest.log" 2>&1)
log "pytest exit $?"
grep -E "passed|failed|error" "$out/pytest.log" | tail -3 | tee -a "$out/summary.log"
grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -20 | tee -a "$out/summary.log"
cp "$out/summary.log" "$out/pytest.log" "$final/"
