// One output pixel of the fused augment kernel, as a function the GPU kernel
// (augment_kernel.cu) and the CPU run alike: tests without a GPU run the kernel's own
// arithmetic through tests/testing/fake_device_backend.h.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "server/augment/staged.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define GPUFEED_HD __host__ __device__
#else
#define GPUFEED_HD
#endif

namespace gpufeed::server {

enum class AugmentDType : int32_t { kUInt8 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3 };

struct AugmentOutput {
  int32_t height = 0, width = 0;
  AugmentDType dtype = AugmentDType::kUInt8;
  int32_t nchw = 1;
  float scale[3] = {1, 1, 1};  // float outputs: v * scale + bias (OutputAffine)
  float bias[3] = {0, 0, 0};
  uint64_t image_offset = 0;  // the image tensor, from the slot's start
  uint64_t row_bytes = 0;     // one image
};

// The taps of output index `i` when resampling `in` samples to `out`: inputs [lo, hi) with
// raw triangle weights max(0, 1 - |(j - center + 0.5) * inv|), normalised by their sum: the
// arithmetic of ComputeResampleWeights (augment/resize.cc), double, then float weights.
struct AugmentTaps {
  int lo = 0, hi = 0;
  double center = 0, inv = 1, total = 0;

  GPUFEED_HD AugmentTaps(int i, int in, int out) {
    const double scale = static_cast<double>(in) / out;
    const double support = scale >= 1.0 ? scale : 1.0;
    inv = scale >= 1.0 ? 1.0 / scale : 1.0;
    center = scale * (i + 0.5);
    const int l = static_cast<int>(center - support + 0.5);
    const int h = static_cast<int>(center + support + 0.5);
    lo = l > 0 ? l : 0;
    hi = h < in ? h : in;
    for (int j = lo; j < hi; ++j) total += Raw(j);
  }
  GPUFEED_HD double Raw(int j) const {
    const double v = 1.0 - std::fabs((j - center + 0.5) * inv);
    return v > 0 ? v : 0.0;
  }
  GPUFEED_HD float Weight(int j) const {
    return total > 0 ? static_cast<float>(Raw(j) / total) : 0.0f;
  }
};

GPUFEED_HD inline void AugmentStore(float v, int c, const AugmentOutput& out, uint8_t* image,
                                    size_t index) {
  if (out.dtype == AugmentDType::kUInt8) {
    const float r = std::floor(v + 0.5f);
    image[index] = static_cast<uint8_t>(r < 0.0f ? 0.0f : (r > 255.0f ? 255.0f : r));
    return;
  }
  v = v * out.scale[c] + out.bias[c];
  if (out.dtype == AugmentDType::kFloat32) {
    reinterpret_cast<float*>(image)[index] = v;
    return;
  }
#ifdef __CUDA_ARCH__
  if (out.dtype == AugmentDType::kFloat16) {
    reinterpret_cast<__half*>(image)[index] = __float2half_rn(v);
  } else {
    reinterpret_cast<__nv_bfloat16*>(image)[index] = __float2bfloat16_rn(v);
  }
#else
  const uint16_t h = out.dtype == AugmentDType::kFloat16 ? FloatToHalf(v) : FloatToBFloat16(v);
  std::memcpy(image + 2 * index, &h, 2);
#endif
}

// Output pixel (y, X) of `task`: the sampled column is X, or its mirror when flipped; the
// window maps it into the resized crop (zeros outside); the taps read the source.
GPUFEED_HD inline void AugmentPixel(const AugmentTask& task, const AugmentOutput& out,
                                    const uint8_t* scratch, uint8_t* slot, int y, int X) {
  const StagedGeometry& g = task.geometry;
  const int x = g.flip ? out.width - 1 - X : X;
  const int ry = y + g.window_top, rx = x + g.window_left;
  float rgb[3] = {0, 0, 0};
  if (ry >= 0 && ry < g.resize_height && rx >= 0 && rx < g.resize_width) {
    const AugmentTaps ty(ry, g.crop_height, g.resize_height);
    const AugmentTaps tx(rx, g.crop_width, g.resize_width);
    const uint8_t* src = scratch + task.src_offset;
    for (int jy = ty.lo; jy < ty.hi; ++jy) {
      const float wy = ty.Weight(jy);
      const uint8_t* line = src + static_cast<size_t>(g.crop_top + jy) * task.src_pitch +
                            static_cast<size_t>(g.crop_left) * 3;
      float r = 0, gr = 0, b = 0;
      for (int jx = tx.lo; jx < tx.hi; ++jx) {
        const float wx = tx.Weight(jx);
        const uint8_t* s = line + 3 * jx;
        r += wx * s[0];
        gr += wx * s[1];
        b += wx * s[2];
      }
      rgb[0] += wy * r;
      rgb[1] += wy * gr;
      rgb[2] += wy * b;
    }
  }
  uint8_t* image = slot + out.image_offset + static_cast<size_t>(task.row) * out.row_bytes;
  const size_t plane = static_cast<size_t>(out.height) * out.width;
  const size_t p = static_cast<size_t>(y) * out.width + X;
  for (int c = 0; c < 3; ++c) AugmentStore(rgb[c], c, out, image, out.nchw ? c * plane + p : 3 * p + c);
}

}  // namespace gpufeed::server
