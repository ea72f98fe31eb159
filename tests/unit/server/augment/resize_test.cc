#include "server/augment/resize.h"

#include <cmath>

#include "gtest/gtest.h"
#include "tests/testing/resample_reference.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Noise;
using ::gpufeed::testing::ResampleReference;

void ExpectMatchesReference(const Image& image, const CropBox& box, int oh, int ow, bool flip) {
  std::vector<float> out(static_cast<size_t>(oh) * ow * 3);
  ResizedCrop(image, box, oh, ow, flip, out.data());
  double worst = 0;
  for (int y = 0; y < oh; ++y) {
    for (int x = 0; x < ow; ++x) {
      for (int c = 0; c < 3; ++c) {
        const int sx = flip ? ow - 1 - x : x;
        const double ref = ResampleReference(image, box, oh, ow, y, sx, c);
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
