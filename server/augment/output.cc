#include "server/augment/output.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace gpufeed::server {

uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // keep NaN a (quiet) NaN
  }
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0));
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504: inf
  if (x < 0x38800000u) {  // subnormal half (or zero)
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest: 0
    const uint32_t mantissa = (x & 0x007FFFFFu) | 0x00800000u;
    const int shift = 126 - static_cast<int>(x >> 23);  // 14..24
    const uint32_t value = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t rounded = value + ((rest > half || (rest == half && (value & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | rounded);
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa from 23 to 10 bits.
  const uint32_t rebias = x - 0x38000000u;
  const uint32_t rounded = rebias + 0x0FFFu + ((rebias >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

uint64_t OutputBytes(const OutputSpec& spec, int height, int width) {
  return static_cast<uint64_t>(height) * width * 3 * DTypeSize(spec.dtype);
}

ChannelAffine OutputAffine(const OutputSpec& spec) {
  ChannelAffine a;
  for (int c = 0; c < 3; ++c) {
    const double std = spec.normalize ? spec.std[c] : 1.0;
    const double mean = spec.normalize ? spec.mean[c] : 0.0;
    a.scale[c] = static_cast<float>(1.0 / (255.0 * std));
    a.bias[c] = static_cast<float>(-mean / std);
  }
  return a;
}

namespace {

// One channel-major or pixel-major pass per output type: the inner loops carry no branches,
// so the compiler vectorises the float ones.
template <typename T, typename Convert>
void WriteAs(const float* hwc, size_t plane, Layout layout, const ChannelAffine& a, Convert convert,
             std::byte* dst) {
  T* out = reinterpret_cast<T*>(dst);
  for (int c = 0; c < 3; ++c) {
    const float scale = a.scale[c], bias = a.bias[c];
    if (layout == Layout::kNCHW) {
      T* plane_out = out + c * plane;
      for (size_t p = 0; p < plane; ++p) plane_out[p] = convert(hwc[3 * p + c] * scale + bias);
    } else {
      for (size_t p = 0; p < plane; ++p) out[3 * p + c] = convert(hwc[3 * p + c] * scale + bias);
    }
  }
}

}  // namespace

void WriteImage(const float* hwc, int height, int width, const OutputSpec& spec, std::byte* dst) {
  const size_t plane = static_cast<size_t>(height) * width;
  const ChannelAffine a = OutputAffine(spec);
  switch (spec.dtype) {
    case DType::kUInt8: {
      // Round half up and clamp, as torch's uint8 resize does.
      auto* out = reinterpret_cast<uint8_t*>(dst);
      for (int c = 0; c < 3; ++c) {
        for (size_t p = 0; p < plane; ++p) {
          const float r = std::floor(hwc[3 * p + c] + 0.5f);
          out[spec.layout == Layout::kNCHW ? c * plane + p : 3 * p + c] =
              static_cast<uint8_t>(std::clamp(r, 0.0f, 255.0f));
        }
      }
      return;
    }
    case DType::kFloat32:
      WriteAs<float>(hwc, plane, spec.layout, a, [](float v) { return v; }, dst);
      return;
    case DType::kFloat16:
      WriteAs<uint16_t>(hwc, plane, spec.layout, a, FloatToHalf, dst);
      return;
    default:
      WriteAs<uint16_t>(hwc, plane, spec.layout, a, FloatToBFloat16, dst);
      return;
  }
}

}  // namespace gpufeed::server
