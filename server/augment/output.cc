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

void WriteImage(const float* hwc, int height, int width, const OutputSpec& spec, std::byte* dst) {
  const size_t plane = static_cast<size_t>(height) * width;
  const uint32_t size = DTypeSize(spec.dtype);
  for (size_t p = 0; p < plane; ++p) {
    for (int c = 0; c < 3; ++c) {
      float v = hwc[3 * p + c];
      const size_t index = spec.layout == Layout::kNCHW ? c * plane + p : 3 * p + c;
      std::byte* out = dst + index * size;
      if (spec.dtype == DType::kUInt8) {
        const float r = std::floor(v + 0.5f);
        *reinterpret_cast<uint8_t*>(out) = static_cast<uint8_t>(std::clamp(r, 0.0f, 255.0f));
        continue;
      }
      v /= 255.0f;
      if (spec.normalize) v = (v - spec.mean[c]) / spec.std[c];
      if (spec.dtype == DType::kFloat32) {
        std::memcpy(out, &v, 4);
      } else {
        const uint16_t h = spec.dtype == DType::kFloat16 ? FloatToHalf(v) : FloatToBFloat16(v);
        std::memcpy(out, &h, 2);
      }
    }
  }
}

}  // namespace gpufeed::server
