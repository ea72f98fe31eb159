// Antialiased bilinear resize of a crop, as torchvision's resized_crop(..., antialias=True)
// (torch's _upsample_bilinear2d_aa, the same filter as PIL's BILINEAR): separable, a triangle
// filter widened by the scale factor when shrinking, weights normalised per output pixel.
#pragma once

#include <vector>

#include "server/augment/crop.h"
#include "server/decode/image_decoder.h"

namespace gpufeed::server {

// Per output index: the first input index, and the weights of the inputs from there.
struct ResampleWeights {
  std::vector<int> first;
  std::vector<std::vector<float>> weights;
};
ResampleWeights ComputeResampleWeights(int in_size, int out_size);

// Crops `box` out of `image`, resizes it to out_height x out_width (flipped left-right when
// `hflip`) and writes float RGB in [0, 255], HWC, to `out` (out_height*out_width*3 floats).
void ResizedCrop(const Image& image, const CropBox& box, int out_height, int out_width, bool hflip,
                 float* out);

}  // namespace gpufeed::server
