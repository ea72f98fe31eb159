// The fused image kernel of the GPU paths: for each staged sample, crop, antialiased bilinear
// resize (the weights of server/augment/resize.cc, torchvision's), window, flip, normalise,
// cast and lay out, from uint8 RGB in the device scratch straight into the consumer's slot.
// Plain C++ types only, so the .cu file needs no Abseil.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "server/augment/staged.h"

namespace gpufeed::server {

enum class AugmentDType : int32_t { kUInt8 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

struct AugmentOutput {
  int32_t height = 0, width = 0;
  AugmentDType dtype = AugmentDType::kUInt8;
  int32_t nchw = 1;
  int32_t normalize = 0;
  float mean[3] = {0, 0, 0};
  float std[3] = {1, 1, 1};
  uint64_t image_offset = 0;  // the image tensor, from the slot's start
  uint64_t row_bytes = 0;     // one image
};

// Enqueues the kernel for `count` tasks (`tasks` in device memory) on `stream`.
cudaError_t LaunchAugment(const AugmentTask* tasks, int count, const AugmentOutput& output,
                          const uint8_t* scratch, uint8_t* slot, cudaStream_t stream);

}  // namespace gpufeed::server
