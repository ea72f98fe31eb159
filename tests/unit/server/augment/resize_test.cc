#include "server/augment/resize.h"

#include <cmath>

#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

Image Noise(int h, int w, unsigned seed) {
  Image image{h, w, std::vector<uint8_t>(static_cast<size_t>(h) * w * 3)};
  for (uint8_t& v : image.rgb) {
    seed = seed * 1103515245u + 12345u;
    v = static_cast<uint8_t>(seed >> 16);
  }
  return image;
}

// An independent, straightforward reference: for each output pixel, the 2-D sum over the
// input of the product of the two 1-D triangle weights (computed on the spot, in double).
double Weight(int out_i, int in_j, int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double support = std::max(scale, 1.0);
  const double center = scale * (out_i + 0.5);
  if (in_j < std::max(static_cast<int>(center - support + 0.5), 0) ||
      in_j >= std::min(static_cast<int>(center + support + 0.5), in_size)) {
    return 0;
  }
  return std::max(0.0, 1.0 - std::abs((in_j - center + 0.5) / std::max(scale, 1.0)));
}

double Reference(const Image& image, const CropBox& box, int oh, int ow, int y, int x, int c) {
  double num = 0, den_y = 0, den_x = 0;
  for (int j = 0; j < box.height; ++j) den_y += Weight(y, j, box.height, oh);
  for (int k = 0; k < box.width; ++k) den_x += Weight(x, k, box.width, ow);
  for (int j = 0; j < box.height; ++j) {
    const double wy = Weight(y, j, box.height, oh);
    if (wy == 0) continue;
    for (int k = 0; k < box.width; ++k) {
      const double wx = Weight(x, k, box.width, ow);
      if (wx == 0) continue;
      num += wy * wx *
             image.rgb[(static_cast<size_t>(box.top + j) * image.width + box.left + k) * 3 + c];
    }
  }
  return num / (den_y * den_x);
}

void ExpectMatchesReference(const Image& image, const CropBox& box, int oh, int ow, bool flip) {
  std::vector<float> out(static_cast<size_t>(oh) * ow * 3);
  ResizedCrop(image, box, oh, ow, flip, out.data());
  double worst = 0;
  for (int y = 0; y < oh; ++y) {
    for (int x = 0; x < ow; ++x) {
      for (int c = 0; c < 3; ++c) {
        const int sx = flip ? ow - 1 - x : x;
        const double ref = Reference(image, box, oh, ow, y, sx, c);
        worst = std::max(worst, std::abs(ref - out[(static_cast<size_t>(y) * ow + x) * 3 + c]));
      }
    }
  }
  EXPECT_LE(worst, 1.0) << "box " << box.top << "," << box.left << " " << box.height << "x"
                        << box.width << " -> " << oh << "x" << ow << (flip ? " flipped" : "");
}

TEST(ResizedCropTest, DownscaleUpscaleAndFlipEqualTheReferenceWithinOneLevel) {
  const Image image = Noise(60, 80, 7);
  ExpectMatchesReference(image, {5, 7, 50, 61}, 17, 23, false);  // shrink ~3x: widened filter
  ExpectMatchesReference(image, {0, 0, 60, 80}, 24, 24, true);   // whole image, flipped
  ExpectMatchesReference(image, {10, 20, 9, 11}, 31, 29, false);  // enlarge ~3x: plain bilinear
  ExpectMatchesReference(image, {3, 3, 40, 40}, 40, 40, false);  // same size: identity
}

TEST(ResizedCropTest, SameSizeIsTheIdentityAndAConstantStaysConstant) {
  const Image image = Noise(12, 10, 3);
  std::vector<float> out(12 * 10 * 3);
  ResizedCrop(image, {0, 0, 12, 10}, 12, 10, false, out.data());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], image.rgb[i], 1e-4);
  Image flat{30, 30, std::vector<uint8_t>(30 * 30 * 3, 77)};
  std::vector<float> small(7 * 5 * 3);
  ResizedCrop(flat, {2, 3, 25, 20}, 7, 5, true, small.data());
  for (float v : small) ASSERT_NEAR(v, 77.0f, 1e-3);
}

TEST(ResampleWeightsTest, WeightsAreNormalisedAndInRange) {
  for (auto [in, out] : std::vector<std::pair<int, int>>{{500, 224}, {224, 500}, {375, 224}, {7, 3}}) {
    const ResampleWeights w = ComputeResampleWeights(in, out);
    for (int i = 0; i < out; ++i) {
      double total = 0;
      for (float v : w.weights[i]) total += v;
      EXPECT_NEAR(total, 1.0, 1e-5) << in << "->" << out << " at " << i;
      EXPECT_GE(w.first[i], 0);
      EXPECT_LE(w.first[i] + static_cast<int>(w.weights[i].size()), in);
    }
  }
}

}  // namespace
}  // namespace gpufeed::server
