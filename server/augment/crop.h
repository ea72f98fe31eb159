// Geometry of the image pipeline, with torchvision's semantics, and the per-sample random
// source: random parameters depend only on (seed, epoch, sample id) (DESIGN.md §5), so a
// sample gets the same crop whatever the rank count, thread count or restart.
#pragma once

#include <cstdint>

#include "server/decode/crop_box.h"

namespace gpufeed::server {

// A counter-based random source for one sample: SplitMix64 keyed by (seed, epoch, id).
class SampleRandom {
 public:
  SampleRandom(uint64_t seed, int64_t epoch, uint64_t sample_id);
  virtual ~SampleRandom() = default;
  // Uniform in [lo, hi).
  virtual double Uniform(double lo, double hi);
  // Uniform integer in [lo, hi_exclusive); hi_exclusive > lo.
  virtual int64_t RandInt(int64_t lo, int64_t hi_exclusive);

 protected:
  SampleRandom() = default;  // for scripted sources in tests

 private:
  uint64_t Next();
  uint64_t state_ = 0;
};

struct RandomResizedCropOptions {
  double scale_min = 0.08, scale_max = 1.0;
  double ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;
};

// torchvision.transforms.RandomResizedCrop.get_params: up to 10 attempts of an area fraction
// in [scale] and a log-uniform aspect ratio in [ratio], sizes rounded half to even as Python's
// round(); then the centre-crop fallback. Draw order per attempt: area, log-ratio, then (when
// the box fits) top, left.
CropBox RandomResizedCropBox(int image_height, int image_width,
                             const RandomResizedCropOptions& options, SampleRandom& random);

// torchvision's center_crop box for an image, exactly (as functional.center_crop of 0.14):
// on an axis where the crop is larger than the image, the image is padded with
// (crop - image) // 2 zeros before it and the rest after, so the box starts at minus that
// padding (the pixels outside the image are the zeros); elsewhere the box starts at
// int(round((image - crop) / 2.0)), half to even.
CropBox CenterCropBox(int image_height, int image_width, int crop_height, int crop_width);
// One axis of CenterCropBox: the box's first row (or column), negative where it pads.
int CenterCropOffset(int image, int crop);

// torchvision's Resize(size) with one int: the shorter side becomes `shorter`, the longer
// keeps the aspect ratio (truncated, as torchvision's int()).
// A longer side past INT_MAX (an extreme panorama) saturates at INT_MAX: callers bound the
// resized size before allocating it.
void ResizeShorterSide(int height, int width, int shorter, int* out_height, int* out_width);

}  // namespace gpufeed::server
