// The CPU path's augment in one pass, with SIMD (Google Highway, dispatched at run time to the
// best target this CPU has: AVX-512, AVX2, SSE4, ... ): crop, antialiased resize, the window
// (zero padding outside the resized image), flip and the output stage, straight into the
// output row. Bit-equal to ResizedCrop (resize.h) then WriteImage (output.h), which stay as
// the scalar reference, and to the GPU kernel's arithmetic as the CPU runs it (AugmentPixel,
// augment/augment_pixel.h): the same weights, the same sums in the same order (horizontal
// taps, then vertical taps), no fused multiply-adds.
#pragma once

#include <cstddef>
#include <cstdint>

#include "server/augment/output.h"
#include "server/augment/staged.h"
#include "server/decode/image_decoder.h"

namespace gpufeed::server {

// Writes the out_height x out_width image of `geometry` (StagedGeometry's meaning: crop, resize
// to resize_height x resize_width, the window at (window_top, window_left), flip) from `image`
// to `out` (OutputBytes(spec, out_height, out_width) bytes), as `spec` says. The geometry is
// the planner's: the crop lies inside the image, every size is at least 1. Scratch is
// thread_local and grows to the largest image seen: no allocation per image after that.
void FastAugment(const Image& image, const StagedGeometry& geometry, int out_height, int out_width,
                 const OutputSpec& spec, std::byte* out);

// The fast path's float16 and bfloat16 conversions over `count` floats (this CPU's target):
// bit-equal to FloatToHalf and FloatToBFloat16.
void FloatsToHalf(const float* in, size_t count, uint16_t* out);
void FloatsToBFloat16(const float* in, size_t count, uint16_t* out);

}  // namespace gpufeed::server
