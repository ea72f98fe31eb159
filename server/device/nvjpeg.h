// nvJPEG, loaded at run time (DESIGN.md §3: the daemon runs where it is absent). The few
// entry points the daemon uses are declared here rather than taken from nvjpeg.h: the header
// is not part of the CUDA toolkit on our build machines (it ships in the nvidia-nvjpeg wheel),
// and these declarations are the library's stable C ABI (same since CUDA 10).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace gpufeed::server::nvjpeg {

using Handle = struct nvjpegHandle*;
using State = struct nvjpegJpegState*;
using DecodeParams = struct nvjpegDecodeParams*;
struct Image {  // nvjpegImage_t
  unsigned char* channel[4];
  size_t pitch[4];
};
enum Backend : int { kDefault = 0, kHybrid = 1, kGpuHybrid = 2, kHardware = 3 };
enum OutputFormat : int { kRgbInterleaved = 5 };  // NVJPEG_OUTPUT_RGBI
inline constexpr unsigned kFlagUpsamplingWithInterpolation = 1u << 5;  // nvjpegCreateEx flags

struct Api {
  std::string library;  // the file that was loaded
  int (*CreateEx)(int backend, void* dev_allocator, void* pinned_allocator, unsigned flags,
                  Handle* handle);
  int (*Destroy)(Handle handle);
  int (*JpegStateCreate)(Handle handle, State* state);
  int (*JpegStateDestroy)(State state);
  int (*DecodeBatchedInitialize)(Handle handle, State state, int batch_size, int max_cpu_threads,
                                 int output_format);
  int (*DecodeBatched)(Handle handle, State state, const unsigned char* const* data,
                       const size_t* lengths, Image* destinations, cudaStream_t stream);
  int (*Decode)(Handle handle, State state, const unsigned char* data, size_t length,
                int output_format, Image* destination, cudaStream_t stream);
  int (*GetHardwareDecoderInfo)(Handle handle, unsigned* engines, unsigned* cores_per_engine);
  // Optional (null where the library lacks them): the batched decode of a region of each
  // image (nvjpegDecodeBatchedEx with nvjpegDecodeParams_t). Only image_bench's --roi uses them.
  int (*DecodeParamsCreate)(Handle handle, DecodeParams* params) = nullptr;
  int (*DecodeParamsDestroy)(DecodeParams params) = nullptr;
  int (*DecodeParamsSetOutputFormat)(DecodeParams params, int output_format) = nullptr;
  int (*DecodeParamsSetROI)(DecodeParams params, int offset_x, int offset_y, int roi_width,
                            int roi_height) = nullptr;
  int (*DecodeBatchedEx)(Handle handle, State state, const unsigned char* const* data,
                         const size_t* lengths, Image* destinations, DecodeParams* params,
                         cudaStream_t stream) = nullptr;
};

// Loads `library` (the config's nvjpeg_library), or when empty libnvjpeg.so.13 / .so.12 on
// the loader path or under /usr/local/cuda. FAILED_PRECONDITION naming what was tried when
// absent. The library is never unloaded: handles may outlive any owner we could name.
absl::StatusOr<Api> Load(const std::string& library);

// "NVJPEG_STATUS_BAD_JPEG (3)" and the like.
std::string StatusName(int status);

// Owns a decoder state (nvjpegJpegStateCreate), destroyed with `device` current.
class UniqueState {
 public:
  static absl::StatusOr<UniqueState> Create(const Api* api, Handle handle, int device);
  UniqueState() = default;
  ~UniqueState() { reset(); }
  UniqueState(UniqueState&& other) noexcept { *this = std::move(other); }
  UniqueState& operator=(UniqueState&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = std::exchange(other.api_, nullptr);
      state_ = std::exchange(other.state_, nullptr);
      device_ = other.device_;
    }
    return *this;
  }
  UniqueState(const UniqueState&) = delete;
  UniqueState& operator=(const UniqueState&) = delete;
  State get() const { return state_; }
  explicit operator bool() const { return state_ != nullptr; }
  void reset();

 private:
  const Api* api_ = nullptr;
  State state_ = nullptr;
  int device_ = 0;
};

}  // namespace gpufeed::server::nvjpeg
