#include "server/decode/image_decoder.h"

#include <png.h>
#include <turbojpeg.h>

#include <cstdlib>
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/image_files.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

using ::gpufeed::testing::Picture;

std::vector<uint8_t> Jpeg(const std::vector<uint8_t>& pixels, int h, int w, int format,
                          int subsamp) {
  return ::gpufeed::testing::EncodeJpeg(pixels, h, w, format, subsamp);
}

std::vector<uint8_t> Png(const std::vector<uint8_t>& pixels, int h, int w, png_uint_32 format,
                         const std::vector<uint8_t>& colormap = {}) {
  return ::gpufeed::testing::EncodePng(pixels, h, w, format, colormap);
}

int MaxDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  int m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(ImageDecoderTest, RgbJpegDecodesToItsPixels) {
  const std::vector<uint8_t> rgb = Picture(30, 40, 3);
  absl::StatusOr<Image> image = DecodeImage(Jpeg(rgb, 30, 40, TJPF_RGB, TJSAMP_444));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->height, 30);
  EXPECT_EQ(image->width, 40);
  ASSERT_EQ(image->rgb.size(), rgb.size());
  EXPECT_LE(MaxDiff(image->rgb, rgb), 4);
}

TEST(ImageDecoderTest, GrayJpegBecomesRgbWithEqualChannels) {
  const std::vector<uint8_t> gray = Picture(16, 24, 1);
  absl::StatusOr<Image> image = DecodeImage(Jpeg(gray, 16, 24, TJPF_GRAY, TJSAMP_GRAY));
  ASSERT_TRUE(image.ok()) << image.status();
  for (size_t p = 0; p < gray.size(); ++p) {
    ASSERT_EQ(image->rgb[3 * p], image->rgb[3 * p + 1]);
    ASSERT_EQ(image->rgb[3 * p], image->rgb[3 * p + 2]);
    ASSERT_LE(std::abs(image->rgb[3 * p] - gray[p]), 3);
  }
}

// CMYK as PIL converts it: r = clip(raw_c + raw_k - 255) for Adobe's inverted storage.
TEST(ImageDecoderTest, CmykJpegConvertsAsPil) {
  std::vector<uint8_t> cmyk(8 * 8 * 4);
  for (size_t p = 0; p < 64; ++p) {
    cmyk[4 * p + 0] = 200;
    cmyk[4 * p + 1] = 120;
    cmyk[4 * p + 2] = 40;
    cmyk[4 * p + 3] = 230;
  }
  absl::StatusOr<Image> image = DecodeImage(Jpeg(cmyk, 8, 8, TJPF_CMYK, TJSAMP_444));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_LE(std::abs(image->rgb[0] - (200 + 230 - 255)), 3);
  EXPECT_LE(std::abs(image->rgb[1] - (120 + 230 - 255)), 3);
  EXPECT_LE(std::abs(image->rgb[2] - (40 + 230 - 255)), 3);
  // And the clip: c + k < 255 gives 0.
  std::vector<uint8_t> light(8 * 8 * 4, 0);
  for (size_t p = 0; p < 64; ++p) light[4 * p + 3] = 100;
  absl::StatusOr<Image> clipped = DecodeImage(Jpeg(light, 8, 8, TJPF_CMYK, TJSAMP_444));
  ASSERT_TRUE(clipped.ok()) << clipped.status();
  EXPECT_EQ(clipped->rgb[0], 0);
}

TEST(ImageDecoderTest, PngIsLosslessAndAlphaIsDroppedNotComposited) {
  const std::vector<uint8_t> rgb = Picture(9, 11, 3);
  absl::StatusOr<Image> image = DecodeImage(Png(rgb, 9, 11, PNG_FORMAT_RGB));
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, rgb);
  std::vector<uint8_t> rgba = Picture(9, 11, 4);
  for (size_t p = 0; p < 99; ++p) rgba[4 * p + 3] = 0;  // fully transparent
  absl::StatusOr<Image> transparent = DecodeImage(Png(rgba, 9, 11, PNG_FORMAT_RGBA));
  ASSERT_TRUE(transparent.ok()) << transparent.status();
  for (size_t p = 0; p < 99; ++p) {
    ASSERT_EQ(transparent->rgb[3 * p], rgba[4 * p]) << "alpha was composited at pixel " << p;
  }
}

TEST(ImageDecoderTest, GrayAndPalettePngBecomeRgb) {
  const std::vector<uint8_t> gray = Picture(5, 7, 1);
  absl::StatusOr<Image> g = DecodeImage(Png(gray, 5, 7, PNG_FORMAT_GRAY));
  ASSERT_TRUE(g.ok()) << g.status();
  for (size_t p = 0; p < gray.size(); ++p) ASSERT_EQ(g->rgb[3 * p + 1], gray[p]);
  const std::vector<uint8_t> colormap = {255, 0, 0, 0, 128, 255};
  const std::vector<uint8_t> indices = {0, 1, 1, 0};
  absl::StatusOr<Image> pal = DecodeImage(Png(indices, 2, 2, PNG_FORMAT_RGB_COLORMAP, colormap));
  ASSERT_TRUE(pal.ok()) << pal.status();
  EXPECT_EQ(pal->rgb, (std::vector<uint8_t>{255, 0, 0, 0, 128, 255, 0, 128, 255, 255, 0, 0}));
}

struct BadCase {
  const char* name;
  std::vector<uint8_t> bytes;
  BadImage reason;
  absl::StatusCode code;
};

TEST(ImageDecoderTest, EveryBadImageClassHasItsReasonAndCode) {
  const std::vector<uint8_t> jpeg = Jpeg(Picture(64, 64, 3), 64, 64, TJPF_RGB, TJSAMP_420);
  const std::vector<uint8_t> png = Png(Picture(64, 64, 3), 64, 64, PNG_FORMAT_RGB);
  std::vector<uint8_t> corrupt = jpeg;
  for (size_t i = corrupt.size() / 2; i < corrupt.size() / 2 + 64; ++i) corrupt[i] = 0xFF;
  std::vector<uint8_t> corrupt_png = png;
  for (size_t i = 60; i < corrupt_png.size() - 12; ++i) corrupt_png[i] ^= 0x5A;
  const std::vector<BadCase> cases = {
      {"empty", {}, BadImage::kEmpty, absl::StatusCode::kInvalidArgument},
      {"text", {'h', 'e', 'l', 'l', 'o'}, BadImage::kNotAnImage, absl::StatusCode::kInvalidArgument},
      {"gif", {'G', 'I', 'F', '8', '9', 'a', 0, 0}, BadImage::kUnsupported,
       absl::StatusCode::kInvalidArgument},
      {"truncated jpeg", std::vector<uint8_t>(jpeg.begin(), jpeg.begin() + jpeg.size() / 2),
       BadImage::kTruncated, absl::StatusCode::kDataLoss},
      {"corrupt jpeg", corrupt, BadImage::kCorrupt, absl::StatusCode::kDataLoss},
      {"truncated png", std::vector<uint8_t>(png.begin(), png.begin() + png.size() / 2),
       BadImage::kTruncated, absl::StatusCode::kDataLoss},
      {"corrupt png", corrupt_png, BadImage::kCorrupt, absl::StatusCode::kDataLoss},
  };
  for (const BadCase& c : cases) {
    absl::StatusOr<Image> image = DecodeImage(c.bytes);
    ASSERT_FALSE(image.ok()) << c.name;
    EXPECT_EQ(BadImageOf(image.status()), c.reason)
        << c.name << ": " << image.status() << " read as " << BadImageName(BadImageOf(image.status()));
    EXPECT_EQ(image.status().code(), c.code) << c.name;
  }
}

TEST(ImageDecoderTest, PixelCapIsCheckedFromTheHeader) {
  DecodeOptions small;
  small.max_pixels = 100;
  for (const auto& bytes : {Jpeg(Picture(20, 20, 3), 20, 20, TJPF_RGB, TJSAMP_444),
                            Png(Picture(20, 20, 3), 20, 20, PNG_FORMAT_RGB)}) {
    absl::StatusOr<Image> image = DecodeImage(bytes, small);
    EXPECT_EQ(BadImageOf(image.status()), BadImage::kTooLarge);
    EXPECT_THAT(image.status().message(), HasSubstr("20x20 exceeds the cap of 100 pixels"));
  }
}

}  // namespace
}  // namespace gpufeed::server
