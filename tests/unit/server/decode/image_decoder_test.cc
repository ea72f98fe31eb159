#include "server/decode/image_decoder.h"

#include <png.h>
#include <turbojpeg.h>

// clang-format off
#include <cstdio>  // jpeglib.h needs FILE first
#include <jpeglib.h>
// clang-format on

#include <cstdlib>
#include <cstring>
#include <random>

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

// Noise: every pixel of a decode depends on its own coefficients, so a region decode that
// used a wrong neighbour or context row shows.
std::vector<uint8_t> Noise(int h, int w, int channels, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> p(static_cast<size_t>(h) * w * channels);
  for (auto& v : p) v = static_cast<uint8_t>(gen());
  return p;
}

// A JPEG through libjpeg's own API, for what TurboJPEG 2.1 cannot write: restart markers
// every `restart_rows` MCU rows.
std::vector<uint8_t> JpegWithRestarts(const std::vector<uint8_t>& rgb, int h, int w,
                                      int restart_rows) {
  jpeg_compress_struct c{};
  jpeg_error_mgr err{};
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* out = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &out, &size);
  c.image_width = static_cast<JDIMENSION>(w);
  c.image_height = static_cast<JDIMENSION>(h);
  c.input_components = 3;
  c.in_color_space = JCS_RGB;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, 90, TRUE);
  c.restart_in_rows = restart_rows;
  jpeg_start_compress(&c, TRUE);
  for (int y = 0; y < h; ++y) {
    JSAMPROW row = const_cast<uint8_t*>(rgb.data()) + static_cast<size_t>(y) * w * 3;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::vector<uint8_t> bytes(out, out + size);
  free(out);
  return bytes;
}

// Whether `window` (a region decode of `region`) holds `region` with the pixels of `whole`.
::testing::AssertionResult RegionMatches(const Image& whole, const Image& window,
                                         const CropBox& region) {
  const CropBox r{region.top, region.left, std::min(region.height, whole.height - region.top),
                  std::min(region.width, whole.width - region.left)};
  if (window.top > r.top || window.left > r.left || window.top + window.height < r.top + r.height ||
      window.left + window.width < r.left + r.width) {
    return ::testing::AssertionFailure()
           << "window " << window.height << "x" << window.width << " at (" << window.top << ", "
           << window.left << ") does not hold the region";
  }
  for (int y = r.top; y < r.top + r.height; ++y) {
    for (int x = r.left; x < r.left + r.width; ++x) {
      const uint8_t* a = &whole.rgb[(static_cast<size_t>(y) * whole.width + x) * 3];
      const uint8_t* b =
          &window.rgb[(static_cast<size_t>(y - window.top) * window.width + (x - window.left)) * 3];
      if (std::memcmp(a, b, 3) != 0) {
        return ::testing::AssertionFailure()
               << "pixel (" << y << ", " << x << "): " << int{a[0]} << "," << int{a[1]} << ","
               << int{a[2]} << " whole, " << int{b[0]} << "," << int{b[1]} << "," << int{b[2]}
               << " in the region decode";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(ImageDecoderTest, ARegionDecodeIsBitEqualToTheWholeDecodeForEveryKindOfJpeg) {
  struct Kind {
    const char* name;
    std::vector<uint8_t> bytes;
  };
  const int h = 333, w = 517;
  const std::vector<uint8_t> rgb = Noise(h, w, 3, 1);
  std::vector<Kind> kinds;
  for (auto [name, subsamp] : {std::pair{"4:4:4", TJSAMP_444},
                               {"4:2:2", TJSAMP_422},
                               {"4:2:0", TJSAMP_420},
                               {"4:4:0", TJSAMP_440},
                               {"4:1:1", TJSAMP_411}}) {
    kinds.push_back({name, ::gpufeed::testing::EncodeJpeg(rgb, h, w, TJPF_RGB, subsamp, 90)});
  }
  kinds.push_back(
      {"progressive 4:2:0",
       ::gpufeed::testing::EncodeJpeg(rgb, h, w, TJPF_RGB, TJSAMP_420, 90, TJFLAG_PROGRESSIVE)});
  kinds.push_back({"grey", ::gpufeed::testing::EncodeJpeg(Noise(h, w, 1, 2), h, w, TJPF_GRAY,
                                                          TJSAMP_GRAY, 90)});
  kinds.push_back(
      {"CMYK", ::gpufeed::testing::EncodeJpeg(Noise(h, w, 4, 3), h, w, TJPF_CMYK, TJSAMP_420, 90)});
  kinds.push_back({"restart markers", JpegWithRestarts(rgb, h, w, 1)});
  // A progressive file of its first scans only (cut before its third SOS, EOI put back):
  // legal, and libjpeg smooths its blocks, reading coefficients two blocks away.
  {
    std::vector<uint8_t> p = kinds[5].bytes;
    size_t cut = 0;
    for (size_t i = 2, sos = 0; i + 1 < p.size() && cut == 0; ++i) {
      if (p[i] == 0xFF && p[i + 1] == 0xDA && ++sos == 3) cut = i;
    }
    ASSERT_GT(cut, 0u);
    p.resize(cut);
    p.insert(p.end(), {0xFF, 0xD9});
    kinds.push_back({"progressive, first scans only", p});
  }
  // Tiny images, where TurboJPEG's scaling factor is not 1/denom (4x4 at 1/8 is decoded at
  // 1/4, the same size).
  for (int side : {1, 3, 4, 5}) {
    kinds.push_back({"tiny", ::gpufeed::testing::EncodeJpeg(Noise(side, side, 3, 6), side, side,
                                                            TJPF_RGB, TJSAMP_420, 90)});
  }
  std::mt19937 gen(7);
  for (const Kind& kind : kinds) {
    for (int denom : {1, 2, 4, 8}) {
      DecodeOptions whole_options;
      whole_options.scale_denom = denom;
      absl::StatusOr<Image> whole = DecodeImage(kind.bytes, whole_options);
      ASSERT_TRUE(whole.ok()) << kind.name << ": " << whole.status();
      std::vector<CropBox> regions = {
          {0, 0, whole->height, whole->width},  // all of it
          {0, 0, 1, 1},
          {whole->height - 1, whole->width - 1, 1, 1},
          {whole->height / 2, 0, 1, whole->width},
          {0, whole->width / 3, whole->height, 7},
          {std::max(0, whole->height - 5), std::max(0, whole->width - 9), 40,
           40},  // past the corner: clipped
      };
      for (int i = 0; i < 40; ++i) {
        const int top = std::uniform_int_distribution<int>(0, whole->height - 1)(gen);
        const int left = std::uniform_int_distribution<int>(0, whole->width - 1)(gen);
        regions.push_back({top, left,
                           std::uniform_int_distribution<int>(1, whole->height - top)(gen),
                           std::uniform_int_distribution<int>(1, whole->width - left)(gen)});
      }
      for (const CropBox& r : regions) {
        DecodeOptions options = whole_options;
        options.region = r;
        absl::StatusOr<Image> window = DecodeImage(kind.bytes, options);
        ASSERT_TRUE(window.ok()) << kind.name << ": " << window.status();
        EXPECT_TRUE(RegionMatches(*whole, *window, r))
            << kind.name << " at 1/" << denom << ", region " << r.height << "x" << r.width
            << " at (" << r.top << ", " << r.left << ")";
      }
    }
  }
}

TEST(ImageDecoderTest, ARegionDecodeDecodesOnlyTheRowsAndColumnsAroundTheRegion) {
  const std::vector<uint8_t> jpeg =
      ::gpufeed::testing::EncodeJpeg(Noise(480, 640, 3, 4), 480, 640, TJPF_RGB, TJSAMP_420, 90);
  DecodeOptions options;
  options.region = {200, 300, 50, 60};
  absl::StatusOr<Image> window = DecodeImage(jpeg, options);
  ASSERT_TRUE(window.ok()) << window.status();
  // 16 rows above (none below); 16 columns each side, the left edge moved back to a whole
  // 16-pixel iMCU.
  EXPECT_EQ(window->top, 184);
  EXPECT_EQ(window->height, 66);
  EXPECT_EQ(window->left, 272);
  EXPECT_EQ(window->width, 376 - 272);
  EXPECT_EQ(window->rgb.size(), static_cast<size_t>(66) * 104 * 3);
  // All of it, and a box wholly outside it (never asked for by the daemon): the whole image.
  for (CropBox r : {CropBox{0, 0, 480, 640}, CropBox{1000, 2000, 5, 5}}) {
    options.region = r;
    absl::StatusOr<Image> all = DecodeImage(jpeg, options);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->top, 0);
    EXPECT_EQ(all->left, 0);
    EXPECT_EQ(all->height, 480);
    EXPECT_EQ(all->width, 640);
  }
}

TEST(ImageDecoderTest, ARegionDecodeClassifiesBadFilesAsTheWholeDecodeDoes) {
  const std::vector<uint8_t> jpeg =
      ::gpufeed::testing::EncodeJpeg(Noise(64, 64, 3, 5), 64, 64, TJPF_RGB, TJSAMP_420, 90);
  std::vector<uint8_t> corrupt = jpeg;
  for (size_t i = corrupt.size() / 2; i < corrupt.size() / 2 + 64; ++i) corrupt[i] = 0xFF;
  const std::vector<uint8_t> truncated(jpeg.begin(), jpeg.begin() + jpeg.size() / 2);
  const std::vector<uint8_t> header_only(jpeg.begin(), jpeg.begin() + 100);
  // Damage below the region (and its margin), a file cut there with an EOI marker put back,
  // junk between the last scan and the EOI marker: with region_checks_whole_file the rows
  // below are entropy-decoded to the file's end all the same, so these fail, or pass, as in
  // a whole decode.
  std::vector<uint8_t> damaged_below = jpeg;
  for (size_t i = jpeg.size() * 7 / 8; i < jpeg.size() - 2; ++i) damaged_below[i] = 0xFF;
  std::vector<uint8_t> cut_below(jpeg.begin(), jpeg.begin() + jpeg.size() * 3 / 4);
  cut_below.insert(cut_below.end(), {0xFF, 0xD9});
  std::vector<uint8_t> junk_before_eoi(jpeg.begin(), jpeg.end() - 2);
  junk_before_eoi.insert(junk_before_eoi.end(), {0x12, 0x34, 0x56, 0xFF, 0xD9});
  DecodeOptions options;
  options.region = {0, 0, 8, 64};  // the top rows: above every damage
  options.region_checks_whole_file = true;
  for (const auto& [name, bytes] : {std::pair{"corrupt", corrupt},
                                    {"truncated", truncated},
                                    {"header only", header_only},
                                    {"damaged below", damaged_below},
                                    {"cut below, EOI put back", cut_below},
                                    {"junk before EOI", junk_before_eoi}}) {
    absl::StatusOr<Image> whole = DecodeImage(bytes);
    absl::StatusOr<Image> region = DecodeImage(bytes, options);
    ASSERT_EQ(region.ok(), whole.ok())
        << name << ": " << region.status() << " against " << whole.status();
    if (whole.ok()) {  // junk before EOI: TurboJPEG lets it pass, and so does the region decode
      EXPECT_TRUE(RegionMatches(*whole, *region, options.region)) << name;
      continue;
    }
    EXPECT_EQ(BadImageOf(region.status()), BadImageOf(whole.status()))
        << name << ": " << region.status() << " against " << whole.status();
    EXPECT_EQ(region.status().code(), whole.status().code()) << name;
  }
  // Without the check, damage below the box goes unseen: its pixels are the file's own. A
  // truncated file is still truncated (no EOI marker at its end: decoded whole).
  options.region_checks_whole_file = false;
  for (const auto& bytes : {damaged_below, cut_below}) {
    absl::StatusOr<Image> top_rows = DecodeImage(bytes, options);
    ASSERT_TRUE(top_rows.ok()) << top_rows.status();
    EXPECT_TRUE(RegionMatches(*DecodeImage(jpeg), *top_rows, options.region));
  }
  EXPECT_EQ(BadImageOf(DecodeImage(truncated, options).status()), BadImage::kTruncated);
  options.region_checks_whole_file = true;
  // Bytes after the EOI marker (a camera's trailer) are no damage, in either decode.
  std::vector<uint8_t> trailer = jpeg;
  trailer.insert(trailer.end(), {0x00, 0x11, 0x22, 0x33});
  absl::StatusOr<Image> with_trailer = DecodeImage(trailer, options);
  ASSERT_TRUE(with_trailer.ok()) << with_trailer.status();
  EXPECT_TRUE(RegionMatches(*DecodeImage(jpeg), *with_trailer, options.region));
  options.max_pixels = 100;
  absl::StatusOr<Image> big = DecodeImage(jpeg, options);
  EXPECT_EQ(BadImageOf(big.status()), BadImage::kTooLarge);
  EXPECT_THAT(big.status().message(), HasSubstr("64x64 exceeds the cap of 100 pixels"));
  // The decoder is reusable after each failure: the same thread decodes a good file next.
  options.max_pixels = 64'000'000;
  absl::StatusOr<Image> good = DecodeImage(jpeg, options);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE(RegionMatches(*DecodeImage(jpeg), *good, options.region));
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

// A grayscale progressive JPEG of `height` x `width`, every coefficient zero, of exactly
// `scans` scans in a valid progression: the DC scan, then for each AC coefficient 1..63 its
// first scan (successive approximation from bit 10) and its ten refinement scans, as far as
// `scans` goes (at most 694). Each scan's data is one one-bit Huffman code a block ("0": DC
// difference 0, or an end of band) padded with ones: the shape of a scan bomb, whose every
// scan costs a pass over the whole image for a bit a block (less with end-of-band runs).
std::vector<uint8_t> ProgressiveJpeg(int scans, int height, int width) {
  std::vector<uint8_t> out = {0xFF, 0xD8};
  auto segment = [&](uint8_t marker, std::initializer_list<uint8_t> body) {
    const size_t length = body.size() + 2;
    out.insert(out.end(), {0xFF, marker, static_cast<uint8_t>(length >> 8),
                           static_cast<uint8_t>(length & 0xFF)});
    out.insert(out.end(), body);
  };
  std::vector<uint8_t> dqt(65, 1);
  dqt[0] = 0;  // 8-bit table 0
  out.insert(out.end(), {0xFF, 0xDB, 0, 67});
  out.insert(out.end(), dqt.begin(), dqt.end());
  segment(0xC2,
          {8, static_cast<uint8_t>(height >> 8), static_cast<uint8_t>(height & 0xFF),
           static_cast<uint8_t>(width >> 8), static_cast<uint8_t>(width & 0xFF), 1, 1, 0x11, 0});
  // One code of length 1 for symbol 0: DC table 0 (difference category 0), AC table 0 (EOB).
  for (uint8_t table : {0x00, 0x10}) {
    segment(0xC4, {table, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0});
  }
  // One "0" a block, then ones to the byte's end.
  const int blocks = ((height + 7) / 8) * ((width + 7) / 8);
  std::vector<uint8_t> data(static_cast<size_t>(blocks / 8), 0);
  if (blocks % 8 != 0) data.push_back(static_cast<uint8_t>(0xFF >> (blocks % 8)));
  auto scan = [&](uint8_t ss, uint8_t se, uint8_t ah, uint8_t al) {
    segment(0xDA, {1, 1, 0x00, ss, se, static_cast<uint8_t>(ah << 4 | al)});
    out.insert(out.end(), data.begin(), data.end());
  };
  int written = 0;
  if (written++ < scans) scan(0, 0, 0, 0);
  for (uint8_t k = 1; k <= 63; ++k) {
    if (written++ < scans) scan(k, k, 0, 10);
    for (uint8_t bit = 10; bit >= 1; --bit) {
      if (written++ < scans) scan(k, k, bit, static_cast<uint8_t>(bit - 1));
    }
  }
  out.insert(out.end(), {0xFF, 0xD9});
  return out;
}

// docs/SECURITY.md section 4: a progressive JPEG of more than 500 scans (kMaxJpegScans) is a
// bad image, too_slow, refused at its 501st scan (TJFLAG_LIMITSCANS); 500 decode.
TEST(ImageDecoderTest, ProgressiveJpegOfMoreThan500ScansIsTooSlow) {
  absl::StatusOr<Image> at_bound = DecodeImage(ProgressiveJpeg(kMaxJpegScans, 16, 16));
  ASSERT_TRUE(at_bound.ok()) << at_bound.status();
  EXPECT_EQ(at_bound->height, 16);
  EXPECT_EQ(at_bound->rgb, std::vector<uint8_t>(16 * 16 * 3, at_bound->rgb[0]));
  for (int scans : {kMaxJpegScans + 1, 694}) {
    absl::StatusOr<Image> bomb = DecodeImage(ProgressiveJpeg(scans, 16, 16));
    EXPECT_EQ(BadImageOf(bomb.status()), BadImage::kTooSlow) << scans << ": " << bomb.status();
    EXPECT_EQ(bomb.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(bomb.status().message(), HasSubstr("more than 500 scans"));
  }
  // The same through a region decode (progressive files take the whole-image path).
  DecodeOptions region;
  region.region = {0, 0, 8, 8};
  EXPECT_EQ(BadImageOf(DecodeImage(ProgressiveJpeg(694, 16, 16), region).status()),
            BadImage::kTooSlow);
  // The thread's decoder is reusable after the refusal.
  EXPECT_TRUE(DecodeImage(ProgressiveJpeg(kMaxJpegScans, 16, 16)).ok());
  EXPECT_STREQ(BadImageName(BadImage::kTooSlow), "too_slow");
}

}  // namespace
}  // namespace gpufeed::server
