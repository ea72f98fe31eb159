# gpufeedd image (unverified here: no Docker engine on the development machines).
# Build stage installs exactly what tests/run.sh installs, through the same script.
FROM debian:12 AS build
COPY deploy/install-deps.sh /src/deploy/install-deps.sh
RUN /src/deploy/install-deps.sh
COPY . /src
RUN cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
 && ninja -C /build gpufeedd gpufeedctl gpufeed_c

FROM debian:12-slim
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends libgrpc++1.51 libprotobuf32 libspdlog1.10 \
    libabsl20220623 libturbojpeg0 libpng16-16 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home /nonexistent --shell /usr/sbin/nologin gpufeed
COPY --from=build /build/server/gpufeedd /build/client/ctl/gpufeedctl /usr/local/bin/
COPY --from=build /build/client/c/libgpufeed_c.so /usr/local/lib/
USER gpufeed
ENTRYPOINT ["/usr/local/bin/gpufeedd"]
CMD ["--listen=unix:///run/gpufeed/gpufeed.sock"]
