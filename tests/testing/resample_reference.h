// Test references for the antialiased resize: a noise image, and a straightforward double
// reference of one output value (the 2-D sum over the input of the product of the two 1-D
// triangle weights, computed on the spot), independent of resize.cc's and the fast path's
// tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "server/augment/crop.h"
#include "server/decode/image_decoder.h"

namespace gpufeed::testing {

inline server::Image Noise(int h, int w, unsigned seed) {
  server::Image image{h, w, std::vector<uint8_t>(static_cast<size_t>(h) * w * 3)};
  for (uint8_t& v : image.rgb) {
    seed = seed * 1103515245u + 12345u;
    v = static_cast<uint8_t>(seed >> 16);
  }
  return image;
}

inline double ResampleWeight(int out_i, int in_j, int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double support = std::max(scale, 1.0);
  const double center = scale * (out_i + 0.5);
  if (in_j < std::max(static_cast<int>(center - support + 0.5), 0) ||
      in_j >= std::min(static_cast<int>(center + support + 0.5), in_size)) {
    return 0;
  }
  return std::max(0.0, 1.0 - std::abs((in_j - center + 0.5) / std::max(scale, 1.0)));
}

// Channel c of output pixel (y, x) of `box` resized to oh x ow, in [0, 255].
inline double ResampleReference(const server::Image& image, const server::CropBox& box, int oh,
                                int ow, int y, int x, int c) {
  double num = 0, den_y = 0, den_x = 0;
  for (int j = 0; j < box.height; ++j) den_y += ResampleWeight(y, j, box.height, oh);
  for (int k = 0; k < box.width; ++k) den_x += ResampleWeight(x, k, box.width, ow);
  for (int j = 0; j < box.height; ++j) {
    const double wy = ResampleWeight(y, j, box.height, oh);
    if (wy == 0) continue;
    for (int k = 0; k < box.width; ++k) {
      const double wx = ResampleWeight(x, k, box.width, ow);
      if (wx == 0) continue;
      num += wy * wx *
             image.rgb[(static_cast<size_t>(box.top + j) * image.width + box.left + k) * 3 + c];
    }
  }
  return num / (den_y * den_x);
}

}  // namespace gpufeed::testing
