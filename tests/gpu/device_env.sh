# Sourced by the scripts that run on the GPU machine, after they set $out (their log folder):
# the bundle's binaries and libraries (tests/gpu/bundle.sh), nvJPEG's library, and the helpers
# every such script uses. Sets root, bundle, ctl, GPUFEEDD, GPUFEEDCTL, GPUFEED_NVJPEG_LIBRARY.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$root/.devbundle
export LD_LIBRARY_PATH=$bundle/lib:${LD_LIBRARY_PATH:-}
export GPUFEEDD=$bundle/bin/gpufeedd GPUFEEDCTL=$bundle/bin/gpufeedctl
ctl=$bundle/bin/gpufeedctl
if [ -z "${GPUFEED_NVJPEG_LIBRARY:-}" ]; then
  GPUFEED_NVJPEG_LIBRARY=$(ls /usr/local/cuda*/targets/x86_64-linux/lib/libnvjpeg.so.1[23] \
                               /usr/local/cuda*/lib64/libnvjpeg.so.1[23] 2>/dev/null | head -1)
  export GPUFEED_NVJPEG_LIBRARY
fi
log() { echo "== $(date +%T) $*" | tee -a "$out/summary.log"; }
# SKIP="step step ..." leaves those steps out.
want() { [[ " ${SKIP:-} " != *" $1 "* ]]; }
log "machine: $(nvidia-smi -L | tr '\n' ' ') $(nproc) cores; nvJPEG: ${GPUFEED_NVJPEG_LIBRARY:-none}"
