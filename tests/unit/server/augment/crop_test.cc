#include "server/augment/crop.h"

#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <set>

#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

// Replays scripted draws: uniform draws return the given values, integer draws the given
// integers (checked against their range), so a test fixes what torch's RNG would have drawn.
class ScriptedRandom : public SampleRandom {
 public:
  ScriptedRandom(std::deque<double> uniforms, std::deque<int64_t> ints)
      : uniforms_(std::move(uniforms)), ints_(std::move(ints)) {}
  double Uniform(double lo, double hi) override {
    EXPECT_FALSE(uniforms_.empty()) << "an unexpected uniform draw";
    const double v = uniforms_.empty() ? lo : uniforms_.front();
    if (!uniforms_.empty()) uniforms_.pop_front();
    EXPECT_GE(v, lo);
    EXPECT_LE(v, hi);
    ranges_.push_back({lo, hi});
    return v;
  }
  int64_t RandInt(int64_t lo, int64_t hi_exclusive) override {
    EXPECT_FALSE(ints_.empty()) << "an unexpected integer draw";
    const int64_t v = ints_.empty() ? lo : ints_.front();
    if (!ints_.empty()) ints_.pop_front();
    EXPECT_GE(v, lo);
    EXPECT_LT(v, hi_exclusive);
    int_ranges_.push_back({lo, hi_exclusive});
    return v;
  }
  std::vector<std::pair<double, double>> ranges_;
  std::vector<std::pair<int64_t, int64_t>> int_ranges_;

 private:
  std::deque<double> uniforms_;
  std::deque<int64_t> ints_;
};

// torchvision, for a 375x500 (h x w) image, scale draw 0.5 and log-ratio draw log(4/3):
// target_area = 93750, aspect = 4/3, w = round(sqrt(125000)) = round(353.55) = 354,
// h = round(sqrt(70312.5)) = round(265.17) = 265; then i in [0, 111), j in [0, 147).
TEST(RandomResizedCropTest, FirstAttemptThatFitsMatchesTorchvision) {
  ScriptedRandom random({0.5, std::log(4.0 / 3.0)}, {17, 99});
  const CropBox box = RandomResizedCropBox(375, 500, {}, random);
  EXPECT_EQ(box, (CropBox{17, 99, 265, 354}));
  ASSERT_EQ(random.ranges_.size(), 2u);
  EXPECT_DOUBLE_EQ(random.ranges_[0].first, 0.08);
  EXPECT_DOUBLE_EQ(random.ranges_[0].second, 1.0);
  EXPECT_DOUBLE_EQ(random.ranges_[1].first, std::log(3.0 / 4.0));
  EXPECT_DOUBLE_EQ(random.ranges_[1].second, std::log(4.0 / 3.0));
  ASSERT_EQ(random.int_ranges_.size(), 2u);
  EXPECT_EQ(random.int_ranges_[0], (std::pair<int64_t, int64_t>{0, 375 - 265 + 1}));
  EXPECT_EQ(random.int_ranges_[1], (std::pair<int64_t, int64_t>{0, 500 - 354 + 1}));
}

// An attempt that does not fit draws no position and moves on to the next attempt.
TEST(RandomResizedCropTest, AttemptsThatDoNotFitAreSkipped) {
  // 100x100 image: scale 1.0 with ratio 4/3 gives w = round(115.47) = 115 > 100: no fit.
  // Second attempt: scale 0.25, ratio 1: w = h = 50.
  ScriptedRandom random({1.0, std::log(4.0 / 3.0), 0.25, 0.0}, {3, 4});
  EXPECT_EQ(RandomResizedCropBox(100, 100, {}, random), (CropBox{3, 4, 50, 50}));
}

// Ten failures fall back to the centre crop with the ratio clamped: a 100 (h) x 1000 (w)
// image has ratio 10 > 4/3, so h = 100, w = round(133.33) = 133, centred.
TEST(RandomResizedCropTest, TenFailuresFallBackToTheClampedCentreCrop) {
  std::deque<double> draws;
  for (int i = 0; i < 10; ++i) {
    draws.push_back(1.0);                  // the whole area
    draws.push_back(std::log(3.0 / 4.0));  // tall: h = round(sqrt(1e5 / 0.75)) = 365 > 100
  }
  ScriptedRandom random(draws, {});
  EXPECT_EQ(RandomResizedCropBox(100, 1000, {}, random), (CropBox{0, 433, 100, 133}));
  // A tall image clamps the other way: 1000 x 100, ratio 0.1 < 3/4: w = 100,
  // h = round(100 / 0.75) = round(133.33) = 133.
  ScriptedRandom tall(draws, {});
  EXPECT_EQ(RandomResizedCropBox(1000, 100, {}, tall), (CropBox{433, 0, 133, 100}));
}

// Python's round() rounds half to even: a side of exactly 2.5 gives 2, of 3.5 gives 4. On a
// 4x4 image with ratio 1, scale 25/64 gives sqrt(6.25) = 2.5 and 49/64 gives sqrt(12.25) = 3.5
// (all exact in binary).
TEST(RandomResizedCropTest, SizesRoundHalfToEvenAsPython) {
  ScriptedRandom half({25.0 / 64.0, 0.0}, {0, 0});
  EXPECT_EQ(RandomResizedCropBox(4, 4, {}, half), (CropBox{0, 0, 2, 2}));
  ScriptedRandom three_half({49.0 / 64.0, 0.0}, {0, 0});
  EXPECT_EQ(RandomResizedCropBox(4, 4, {}, three_half), (CropBox{0, 0, 4, 4}));
}

TEST(SampleRandomTest, DependsOnlyOnSeedEpochAndSample) {
  SampleRandom a(7, 2, 123), b(7, 2, 123), other_epoch(7, 3, 123), other_sample(7, 2, 124);
  const double x = a.Uniform(0, 1);
  EXPECT_EQ(x, b.Uniform(0, 1));
  EXPECT_NE(x, other_epoch.Uniform(0, 1));
  EXPECT_NE(x, other_sample.Uniform(0, 1));
  // Integer draws cover their range and stay inside it.
  SampleRandom r(1, 0, 0);
  std::set<int64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = r.RandInt(-3, 4);
    ASSERT_GE(v, -3);
    ASSERT_LT(v, 4);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 7u);
}

TEST(SampleRandomTest, RealCropsStayInsideTheImage) {
  for (uint64_t id = 0; id < 500; ++id) {
    SampleRandom random(42, 0, id);
    const CropBox box = RandomResizedCropBox(375, 500, {}, random);
    ASSERT_GT(box.height, 0);
    ASSERT_GT(box.width, 0);
    ASSERT_LE(box.top + box.height, 375);
    ASSERT_LE(box.left + box.width, 500);
  }
}

// Found by fuzzing (tests/fuzz, pipeline_json): ratios of 1e-30 and 1e30 are valid, and a
// side of sqrt(area * 1e30) was converted to int (undefined; UBSan: float-cast-overflow).
// Such attempts do not fit, and the fallback crop stays inside the image.
TEST(RandomResizedCropTest, ExtremeRatiosStayInsideTheImage) {
  for (const auto& [h, w] : {std::pair{1, 64000000}, {64000000, 1}, {1, 1}, {375, 500}}) {
    for (uint64_t id = 0; id < 50; ++id) {
      SampleRandom random(1, 0, id);
      const CropBox box = RandomResizedCropBox(h, w, {0.08, 1.0, 1e-30, 1e30}, random);
      ASSERT_GE(box.height, 1);
      ASSERT_GE(box.width, 1);
      ASSERT_GE(box.top, 0);
      ASSERT_GE(box.left, 0);
      ASSERT_LE(int64_t{box.top} + box.height, h);
      ASSERT_LE(int64_t{box.left} + box.width, w);
    }
  }
}

// A ratio range far from a small image's rounded the fallback's clamped side to 0 (a 1 x 1
// image, ratios in [1000, 1000]: h = round(1 / 1000) = 0), an empty crop to resize from.
TEST(RandomResizedCropTest, TheFallbackCropIsNeverEmpty) {
  SampleRandom random(0, 0, 0);
  EXPECT_EQ(RandomResizedCropBox(1, 1, {0.08, 1.0, 1000, 1000}, random), (CropBox{0, 0, 1, 1}));
  SampleRandom tall(0, 0, 0);
  EXPECT_EQ(RandomResizedCropBox(3, 1, {0.08, 1.0, 0.001, 0.001}, tall), (CropBox{0, 0, 3, 1}));
}

TEST(CenterCropTest, MatchesTorchvisionRounding) {
  // torchvision: top = int(round((256 - 224) / 2)) = 16; (257 - 224) / 2 = 16.5 -> 16 (even).
  EXPECT_EQ(CenterCropBox(256, 256, 224, 224), (CropBox{16, 16, 224, 224}));
  EXPECT_EQ(CenterCropBox(257, 259, 224, 224), (CropBox{16, 18, 224, 224}));
}

// torchvision's center_crop pads a crop larger than the image with (crop - image) // 2 zeros
// before it (left, top) and (crop - image + 1) // 2 after: the box starts at minus the
// first. Rounding (image - crop) / 2 half to even put paddings of 3, 7, 11, ... 1 px off.
TEST(CenterCropTest, ALargerCropPadsAsTorchvisionSplitsThePadding) {
  for (int image = 1; image <= 40; ++image) {
    for (int crop = image + 1; crop <= image + 41; ++crop) {
      EXPECT_EQ(CenterCropOffset(image, crop), -((crop - image) / 2)) << image << " " << crop;
    }
  }
  EXPECT_EQ(CenterCropBox(10, 10, 13, 13), (CropBox{-1, -1, 13, 13}));  // was -2: 1 px off
  EXPECT_EQ(CenterCropBox(10, 10, 15, 15), (CropBox{-2, -2, 15, 15}));
  EXPECT_EQ(CenterCropBox(10, 10, 17, 17), (CropBox{-3, -3, 17, 17}));  // was -4
  EXPECT_EQ(CenterCropBox(10, 10, 11, 11), (CropBox{0, 0, 11, 11}));    // all after
  // One axis padded (odd), the other cropped (half to even: 1.5 -> 2, 2.5 -> 2).
  EXPECT_EQ(CenterCropBox(10, 20, 13, 17), (CropBox{-1, 2, 13, 17}));
  EXPECT_EQ(CenterCropBox(25, 6, 20, 9), (CropBox{2, -1, 20, 9}));
  // Equal: the image itself.
  EXPECT_EQ(CenterCropBox(7, 9, 7, 9), (CropBox{0, 0, 7, 9}));
}

TEST(ResizeTest, ShorterSideKeepsTheAspectRatioTruncated) {
  int h, w;
  ResizeShorterSide(375, 500, 256, &h, &w);  // int(256 * 500 / 375) = int(341.33) = 341
  EXPECT_EQ(h, 256);
  EXPECT_EQ(w, 341);
  ResizeShorterSide(500, 375, 256, &h, &w);
  EXPECT_EQ(h, 341);
  EXPECT_EQ(w, 256);
  ResizeShorterSide(300, 300, 224, &h, &w);
  EXPECT_EQ(h, 224);
  EXPECT_EQ(w, 224);
}

// Found by fuzzing (tests/fuzz, attach_request): 256 x 64M / 1 wrapped an int (to
// -795869184); the longer side now saturates at INT_MAX, for the caller's pixel cap.
TEST(ResizeTest, AnExtremePanoramaSaturatesInsteadOfWrapping) {
  int h, w;
  ResizeShorterSide(1, 64000000, 256, &h, &w);
  EXPECT_EQ(h, 256);
  EXPECT_EQ(w, std::numeric_limits<int>::max());
  ResizeShorterSide(64000000, 1, 8192, &h, &w);
  EXPECT_EQ(h, std::numeric_limits<int>::max());
  EXPECT_EQ(w, 8192);
  ResizeShorterSide(1, 65536, 256, &h, &w);  // fits: 16M
  EXPECT_EQ(w, 16777216);
}

}  // namespace
}  // namespace gpufeed::server
