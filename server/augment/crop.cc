#include "server/augment/crop.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace gpufeed::server {
namespace {

uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Python's int(round(x)): round half to even (the default floating-point rounding mode).
int RoundHalfEven(double x) { return static_cast<int>(std::nearbyint(x)); }

}  // namespace

SampleRandom::SampleRandom(uint64_t seed, int64_t epoch, uint64_t sample_id) {
  // Distinct from the epoch permutation's stream (sampler.cc) by the extra constant.
  state_ = Mix(Mix(Mix(seed ^ 0x5EED5EED5EED5EEDULL) ^ static_cast<uint64_t>(epoch)) ^ sample_id);
}

uint64_t SampleRandom::Next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
  return Mix(z);
}

double SampleRandom::Uniform(double lo, double hi) {
  const double unit = static_cast<double>(Next() >> 11) * 0x1.0p-53;  // [0, 1)
  return lo + (hi - lo) * unit;
}

int64_t SampleRandom::RandInt(int64_t lo, int64_t hi_exclusive) {
  const uint64_t range = static_cast<uint64_t>(hi_exclusive - lo);
  const __uint128_t m = static_cast<__uint128_t>(Next()) * range;  // Lemire, bias < 2^-64·range
  return lo + static_cast<int64_t>(m >> 64);
}

CropBox RandomResizedCropBox(int image_height, int image_width,
                             const RandomResizedCropOptions& o, SampleRandom& random) {
  const double area = static_cast<double>(image_height) * image_width;
  const double log_lo = std::log(o.ratio_min);
  const double log_hi = std::log(o.ratio_max);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * random.Uniform(o.scale_min, o.scale_max);
    const double aspect = std::exp(random.Uniform(log_lo, log_hi));
    // Compared before the conversion to int: an extreme ratio gives sides far past any int
    // (or NaN), which simply do not fit.
    const double wd = std::nearbyint(std::sqrt(target_area * aspect));
    const double hd = std::nearbyint(std::sqrt(target_area / aspect));
    if (0 < wd && wd <= image_width && 0 < hd && hd <= image_height) {
      const int w = static_cast<int>(wd), h = static_cast<int>(hd);
      const int top = static_cast<int>(random.RandInt(0, image_height - h + 1));
      const int left = static_cast<int>(random.RandInt(0, image_width - w + 1));
      return {top, left, h, w};
    }
  }
  // Fallback: the central crop with the ratio clamped to the allowed range.
  const double in_ratio = static_cast<double>(image_width) / image_height;
  int w, h;
  if (in_ratio < std::min(o.ratio_min, o.ratio_max)) {
    w = image_width;
    h = RoundHalfEven(w / std::min(o.ratio_min, o.ratio_max));
  } else if (in_ratio > std::max(o.ratio_min, o.ratio_max)) {
    h = image_height;
    w = RoundHalfEven(h * std::max(o.ratio_min, o.ratio_max));
  } else {
    w = image_width;
    h = image_height;
  }
  // A ratio range far from the image's can round a side to 0, which torchvision would
  // then fail on: keep at least one pixel. (The clamped side never exceeds the image's.)
  h = std::max(h, 1);
  w = std::max(w, 1);
  return {(image_height - h) / 2, (image_width - w) / 2, h, w};
}

CropBox CenterCropBox(int image_height, int image_width, int crop_height, int crop_width) {
  return {CenterCropOffset(image_height, crop_height), CenterCropOffset(image_width, crop_width),
          crop_height, crop_width};
}

int CenterCropOffset(int image, int crop) {
  // torchvision.transforms.functional.center_crop: a crop larger than the image pads it with
  // (crop - image) // 2 zeros before and (crop - image + 1) // 2 after, then takes it whole
  // (offset 0 in the padded image); a smaller one starts at int(round((image - crop) / 2.0)).
  // (Rounding -(crop - image) / 2 instead put an odd padding of 3, 7, 11, ... 1 px off.)
  if (crop > image) return -static_cast<int>((static_cast<int64_t>(crop) - image) / 2);
  return RoundHalfEven((image - crop) / 2.0);
}

void ResizeShorterSide(int height, int width, int shorter, int* out_height, int* out_width) {
  // In 64 bits, then saturated: 8192 x (64M / 1) does not fit an int.
  auto longer = [&](int side, int short_side) {
    const int64_t l = static_cast<int64_t>(shorter) * side / short_side;
    return static_cast<int>(std::min<int64_t>(l, std::numeric_limits<int>::max()));
  };
  if (height <= width) {
    *out_height = shorter;
    *out_width = longer(width, height);
  } else {
    *out_width = shorter;
    *out_height = longer(height, width);
  }
}

}  // namespace gpufeed::server
