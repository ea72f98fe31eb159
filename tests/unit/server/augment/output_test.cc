#include "server/augment/output.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

// A 1x2 image: pixel 0 = (0, 127.6, 255), pixel 1 = (10.5, 300, -4).
const float kPixels[] = {0, 127.6f, 255, 10.5f, 300, -4};

TEST(WriteImageTest, Uint8NchwRoundsHalfUpAndClamps) {
  OutputSpec spec;
  uint8_t out[6];
  WriteImage(kPixels, 1, 2, spec, reinterpret_cast<std::byte*>(out));
  // NCHW: R plane, G plane, B plane.
  const uint8_t expected[] = {0, 11, 128, 255, 255, 0};
  EXPECT_EQ(std::memcmp(out, expected, 6), 0);
  spec.layout = Layout::kNHWC;
  WriteImage(kPixels, 1, 2, spec, reinterpret_cast<std::byte*>(out));
  const uint8_t nhwc[] = {0, 128, 255, 11, 255, 0};
  EXPECT_EQ(std::memcmp(out, nhwc, 6), 0);
}

TEST(WriteImageTest, Float32NormalisesAsToDtypeThenNormalize) {
  OutputSpec spec;
  spec.dtype = DType::kFloat32;
  spec.normalize = true;
  const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
  std::memcpy(spec.mean, mean, sizeof(mean));
  std::memcpy(spec.std, std, sizeof(std));
  float out[6];
  WriteImage(kPixels, 1, 2, spec, reinterpret_cast<std::byte*>(out));
  // NCHW: R of pixels 0 and 1, then G, then B. Floats are not clamped, as torchvision's.
  EXPECT_FLOAT_EQ(out[0], (0 / 255.0f - 0.485f) / 0.229f);        // R, pixel 0
  EXPECT_FLOAT_EQ(out[2], (127.6f / 255.0f - 0.456f) / 0.224f);   // G, pixel 0
  EXPECT_FLOAT_EQ(out[3], (300 / 255.0f - 0.456f) / 0.224f);      // G, pixel 1
  EXPECT_FLOAT_EQ(out[5], (-4 / 255.0f - 0.406f) / 0.225f);       // B, pixel 1
}

TEST(HalfTest, ExactValuesRoundingAndSpecials) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(70000.0f), 0x7C00);                 // overflow: inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);    // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);    // smallest normal
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties to even (1 + 2^-9).
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(FloatToHalf(INFINITY), 0x7C00);
  EXPECT_EQ(FloatToHalf(NAN) & 0x7C00, 0x7C00);
  EXPECT_NE(FloatToHalf(NAN) & 0x03FF, 0);
}

TEST(BFloat16Test, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.5f), 0xC020);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  // 1 + 3 * 2^-8: ties to even (1 + 2^-6).
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_EQ(FloatToBFloat16(NAN) & 0x7F80, 0x7F80);
  EXPECT_NE(FloatToBFloat16(NAN) & 0x007F, 0);
}

TEST(WriteImageTest, HalfAndBFloat16Outputs) {
  OutputSpec spec;
  spec.dtype = DType::kFloat16;
  spec.layout = Layout::kNHWC;
  uint16_t out[6];
  WriteImage(kPixels, 1, 2, spec, reinterpret_cast<std::byte*>(out));
  EXPECT_EQ(out[2], 0x3C00);  // 255 / 255 = 1
  EXPECT_EQ(out[0], 0x0000);
  spec.dtype = DType::kBFloat16;
  WriteImage(kPixels, 1, 2, spec, reinterpret_cast<std::byte*>(out));
  EXPECT_EQ(out[2], 0x3F80);
  EXPECT_EQ(OutputBytes(spec, 224, 224), 224u * 224 * 3 * 2);
}

}  // namespace
}  // namespace gpufeed::server
