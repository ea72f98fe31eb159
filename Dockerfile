# gpufeedd image: the daemon, gpufeedctl, libgpufeed_c.so and the gpufeed Python package on
# the CUDA runtime. UNVERIFIED: no Docker engine runs on the machines this project is built
# and tested on, so this file has never been built. What is tested (tests/deploy): the
# install script it shares with tests/run.sh, deploy/runtime-packages.sh on the built
# binaries, and the DaemonSet that runs the image.
#
#   docker build -t gpufeedd:0.1.0 .
#   docker build --build-arg CUDA_ARCHITECTURES="80;90" -t gpufeedd:0.1.0 .   # + Ampere SASS

# ---- build: the build packages of the script tests/run.sh uses (--build-only) -------------
FROM nvidia/cuda:13.0.0-devel-ubuntu24.04 AS build
# Copied alone first, so that the package layer is rebuilt only when the script changes.
COPY deploy/install-deps.sh /src/deploy/install-deps.sh
RUN /src/deploy/install-deps.sh --build-only && rm -rf /var/lib/apt/lists/*
COPY . /src
# Hopper code plus its PTX by default (CMakeLists.txt): other GPUs JIT-compile the PTX at
# start-up. GPUFEED_CUDA=ON: fail here rather than build a daemon without device delivery.
ARG CUDA_ARCHITECTURES=90
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
      -DGPUFEED_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
 && ninja -C /build gpufeedd gpufeedctl gpufeed_c \
 && /src/deploy/runtime-packages.sh /build/server/gpufeedd /build/client/ctl/gpufeedctl \
      /build/client/c/libgpufeed_c.so > /build/runtime-packages \
 && cat /build/runtime-packages

# ---- runtime ------------------------------------------------------------------------------------
# The runtime image, not base: gpufeedd links the CUDA runtime statically, but loads nvJPEG
# (libnvjpeg.so.13) at run time for GPU JPEG decoding, and only the runtime image has it. The
# driver (libcuda) comes from the host, through the NVIDIA container runtime.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04
# The shared libraries the binaries load, as packages: for Ubuntu 24.04 these are grpc++ and
# grpc (libgrpc++1.51t64, libgrpc29t64), protobuf (libprotobuf32t64), abseil
# (libabsl20220623t64), spdlog and fmt, libjpeg-turbo (libturbojpeg), libpng16-16t64,
# Highway (libhwy1t64; Debian 12: libhwy1), prometheus-cpp (libprometheus-cpp-core1.0, -pull1.0, civetweb), libsystemd0 and,
# once the daemon reads S3 (server/objstore), libcurl (libcurl4t64; Debian 12: libcurl4). The list
# is computed from the binaries in the build stage (deploy/runtime-packages.sh), so no name
# here can go stale. python3 and numpy: the gpufeed package.
COPY --from=build /build/runtime-packages /tmp/runtime-packages
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      $(cat /tmp/runtime-packages) python3 python3-numpy \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-packages

# The user the DaemonSet runs as. Fixed ids: the DaemonSet's runAsUser and its config's
# admin_uids name uid 10000 (the daemon's alone: no training pod runs as it), its runAsGroup
# and the training pods' supplementalGroups name gid 10001 (the sockets' group).
RUN groupadd --system --gid 10001 gpufeed \
 && useradd --system --uid 10000 --gid gpufeed --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin gpufeed \
 && install -d -o gpufeed -g gpufeed -m 0750 /run/gpufeed

# The same paths as the systemd unit's and the DaemonSet's.
COPY --from=build /build/server/gpufeedd /build/client/ctl/gpufeedctl /usr/bin/
COPY --from=build /build/client/c/libgpufeed_c.so /usr/local/lib/
# The Python package is pure Python (ctypes over libgpufeed_c.so, which it finds through the
# loader's cache), so copying it installs it; Ubuntu 24.04's pip refuses to install into the
# system's Python (PEP 668). The build fails here if the package cannot load the library.
COPY client/python/src/gpufeed /usr/lib/python3/dist-packages/gpufeed
RUN ldconfig && python3 -c "import gpufeed; print('gpufeed C API', gpufeed.library_api_version())"
# For training images built FROM this one (deploy/k8s/examples/training-job.yaml).
COPY client/python/examples /usr/share/gpufeed/examples
COPY deploy/pipelines /usr/share/gpufeed/pipelines
# The example config, for `docker run`; the DaemonSet mounts its own over /etc/gpufeed.
COPY deploy/gpufeedd.textproto /etc/gpufeed/gpufeedd.textproto

USER gpufeed
# Metrics (/metrics) and gRPC health, when the config turns them on.
EXPOSE 9090 9091
ENTRYPOINT ["/usr/bin/gpufeedd"]
CMD ["--config=/etc/gpufeed/gpufeedd.textproto"]
