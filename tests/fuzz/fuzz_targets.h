// The fuzz targets for the parsers at the edge (docs/SECURITY.md section 6: every request
// field, memory-socket frame and dataset byte is untrusted). Each is a plain function, so the
// same code runs under libFuzzer (GPUFEED_FUZZ=ON, clang: one binary per target, whose
// LLVMFuzzerTestOneInput GPUFEED_FUZZ_TARGET defines) and in the corpus replay test of the
// normal build (corpus_replay_test.cc, GCC and its ASan pass).
//
// A target returns 0 for any input the parser handles; it aborts (FUZZ_CHECK) when an
// invariant of the parser's contract breaks, and the sanitizers report the rest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace gpufeed::fuzz {

// bytes -> v1::AttachRequest -> AttachSpecFromProto -> ValidateAttachSpec, CompilePipeline
// and the crop geometry the plan drives.
int FuzzAttachRequest(const uint8_t* data, size_t size);
// bytes -> ParseNpyHeader.
int FuzzNpyHeader(const uint8_t* data, size_t size);
// bytes as AttachOptions::pipeline_json -> AttachPlanFromOptions (the client's JSON parse,
// as gpufeedctl --pipeline and the C API's "pipeline_json" give it) -> the server's
// conversion and validation of the request that would be sent.
int FuzzPipelineJson(const uint8_t* data, size_t size);
// bytes, cut into writes with file descriptors attached, over a socketpair -> RecvFrame ->
// v1::MemRequest.
int FuzzMemFrame(const uint8_t* data, size_t size);
// bytes -> InspectJpeg, DecodeImage (pixel cap and DCT scaling).
int FuzzImageHeader(const uint8_t* data, size_t size);
// bytes as a WebDataset shard -> IndexTar.
int FuzzTarIndex(const uint8_t* data, size_t size);

}  // namespace gpufeed::fuzz

// A broken invariant: says which, then aborts (libFuzzer saves the input as a crash).
#define FUZZ_CHECK(cond)                                                              \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)

#ifdef GPUFEED_LIBFUZZER
#define GPUFEED_FUZZ_TARGET(fn)                                                   \
  extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {       \
    return ::gpufeed::fuzz::fn(data, size);                                       \
  }
#else
#define GPUFEED_FUZZ_TARGET(fn)
#endif
