// The last pipeline steps, torchvision-equal: optional normalisation (ToDtype(scale=True)
// then Normalize(mean, std)), the cast to the output dtype and the layout (NCHW or NHWC).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"

namespace gpufeed::server {

enum class Layout { kNCHW, kNHWC };

struct OutputSpec {
  bool normalize = false;
  float mean[3] = {0, 0, 0};
  float std[3] = {1, 1, 1};
  DType dtype = DType::kUInt8;  // uint8, float16, bfloat16 or float32
  Layout layout = Layout::kNCHW;
};

// The float outputs' per-channel map from [0, 255]: v * scale + bias, that is v / 255, then
// (v - mean) / std when normalising (as ToDtype(scale=True) then Normalize). One expression
// on the CPU and in the GPU kernel, so both paths round alike.
struct ChannelAffine {
  float scale[3] = {1, 1, 1};
  float bias[3] = {0, 0, 0};
};
ChannelAffine OutputAffine(const OutputSpec& spec);

// Bytes one image takes in `spec` for height x width.
uint64_t OutputBytes(const OutputSpec& spec, int height, int width);

// Writes an RGB float image (HWC, values in [0, 255]) to `dst` as `spec` says. uint8 output
// rounds half up and clamps, as torch's uint8 resize does; float outputs are v / 255,
// normalised when asked.
void WriteImage(const float* hwc, int height, int width, const OutputSpec& spec, std::byte* dst);

// IEEE binary16 and bfloat16 from float, rounding to nearest even.
uint16_t FloatToHalf(float f);
uint16_t FloatToBFloat16(float f);

}  // namespace gpufeed::server
