// The fused image kernel of the GPU paths: for each staged sample, crop, antialiased bilinear
// resize (the weights of server/augment/resize.cc, torchvision's), window, flip, normalise,
// cast and lay out, from uint8 RGB in the device scratch straight into the consumer's slot
// (augment_pixel.h has the per-pixel arithmetic). Plain C++ types only: no Abseil in nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "server/augment/augment_pixel.h"

namespace gpufeed::server {

// Enqueues the kernel for `count` tasks (`tasks` in device memory) on `stream`.
cudaError_t LaunchAugment(const AugmentTask* tasks, int count, const AugmentOutput& output,
                          const uint8_t* scratch, uint8_t* slot, cudaStream_t stream);

}  // namespace gpufeed::server
