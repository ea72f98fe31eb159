// Helpers of the GPU image tests: whether a GPU is there, textured test pictures, and the
// element-wise comparison of a delivered image with the CPU path's.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/dtype.h"
#include "tests/testing/half.h"
#include "tests/testing/image_files.h"

namespace gpufeed::testing {

inline bool HaveGpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

// A picture with texture: the smooth test picture plus deterministic brightness noise (as a
// camera sensor's is, mostly), so decoders and filters have edges to disagree on.
inline std::vector<uint8_t> Textured(int h, int w, int seed) {
  std::vector<uint8_t> p = Picture(h, w, 3, seed);
  uint32_t state = static_cast<uint32_t>(seed) * 2654435761u + 1;
  for (size_t i = 0; i < p.size(); i += 3) {
    state = state * 1664525u + 1013904223u;
    const int noise = static_cast<int>(state >> 27) - 16;
    for (size_t c = 0; c < 3; ++c) {
      p[i + c] = static_cast<uint8_t>(std::clamp(static_cast<int>(p[i + c]) + noise, 0, 255));
    }
  }
  return p;
}

struct Diff {
  double sum = 0;
  int64_t count = 0;
  double max = 0;
  void Add(double a, double b) {
    sum += std::abs(a - b);
    max = std::max(max, std::abs(a - b));
    ++count;
  }
  double mean() const { return count == 0 ? 0 : sum / static_cast<double>(count); }
};

inline double Element(const std::byte* p, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kUInt8: return static_cast<double>(reinterpret_cast<const uint8_t*>(p)[i]);
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return HalfToDouble(h);
    }
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    default: return 0;
  }
}

}  // namespace gpufeed::testing
