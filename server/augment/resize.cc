#include "server/augment/resize.h"

#include <algorithm>
#include <cmath>

namespace gpufeed::server {

ResampleWeights ComputeResampleWeights(int in_size, int out_size) {
  ResampleWeights r;
  r.first.resize(static_cast<size_t>(out_size));
  r.weights.resize(static_cast<size_t>(out_size));
  const double scale = static_cast<double>(in_size) / out_size;
  const double support = scale >= 1.0 ? scale : 1.0;  // bilinear: half-width 1, widened
  const double inv = scale >= 1.0 ? 1.0 / scale : 1.0;
  for (int i = 0; i < out_size; ++i) {
    const double center = scale * (i + 0.5);
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    std::vector<float>& w = r.weights[static_cast<size_t>(i)];
    double total = 0;
    std::vector<double> raw;
    for (int j = lo; j < hi; ++j) {
      const double x = (j - center + 0.5) * inv;
      const double v = std::max(0.0, 1.0 - std::abs(x));
      raw.push_back(v);
      total += v;
    }
    for (double v : raw) w.push_back(static_cast<float>(total > 0 ? v / total : 0));
    r.first[static_cast<size_t>(i)] = lo;
  }
  return r;
}

void ResizedCrop(const Image& image, const CropBox& box, int out_height, int out_width, bool hflip,
                 float* out) {
  const ResampleWeights wx = ComputeResampleWeights(box.width, out_width);
  const ResampleWeights wy = ComputeResampleWeights(box.height, out_height);
  // Horizontal pass over the crop's rows into a float buffer, then the vertical pass.
  std::vector<float> rows(static_cast<size_t>(box.height) * out_width * 3);
  for (int y = 0; y < box.height; ++y) {
    const uint8_t* src = image.rgb.data() + (static_cast<size_t>(box.top + y) * image.width + box.left) * 3;
    float* dst = rows.data() + static_cast<size_t>(y) * out_width * 3;
    for (int x = 0; x < out_width; ++x) {
      const std::vector<float>& w = wx.weights[static_cast<size_t>(x)];
      const uint8_t* s = src + static_cast<size_t>(wx.first[static_cast<size_t>(x)]) * 3;
      float r = 0, g = 0, b = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        r += w[k] * s[3 * k];
        g += w[k] * s[3 * k + 1];
        b += w[k] * s[3 * k + 2];
      }
      float* d = dst + static_cast<size_t>(hflip ? out_width - 1 - x : x) * 3;
      d[0] = r;
      d[1] = g;
      d[2] = b;
    }
  }
  // Vertical pass: taps outer, pixels inner (contiguous, vectorised); per output value the
  // sum still runs over the taps in order, so the result is the same as tap by tap.
  const size_t line = static_cast<size_t>(out_width) * 3;
  for (int y = 0; y < out_height; ++y) {
    const std::vector<float>& w = wy.weights[static_cast<size_t>(y)];
    const float* src = rows.data() + static_cast<size_t>(wy.first[static_cast<size_t>(y)]) * line;
    float* dst = out + static_cast<size_t>(y) * line;
    std::fill(dst, dst + line, 0.0f);
    for (size_t k = 0; k < w.size(); ++k) {
      const float wk = w[k];
      const float* s = src + k * line;
      for (size_t i = 0; i < line; ++i) dst[i] += wk * s[i];
    }
  }
}

}  // namespace gpufeed::server
