// Test images: JPEG files from TurboJPEG, PNG files from libpng's simplified API.
#pragma once

#include <png.h>
#include <turbojpeg.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace gpufeed::testing {

// Writes `bytes` to `path`, making its directories (an ImageFolder tree in a test).
inline void WriteFileBytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                              static_cast<std::streamsize>(bytes.size()));
}

// A smooth, asymmetric picture of h x w x channels.
inline std::vector<uint8_t> Picture(int h, int w, int channels, int seed = 0) {
  std::vector<uint8_t> p(static_cast<size_t>(h) * w * channels);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      for (int c = 0; c < channels; ++c) {
        p[(static_cast<size_t>(y) * w + x) * channels + c] =
            static_cast<uint8_t>((x * 3 + y * 2 + c * 60 + seed * 17) % 256 / 2 + 40);
      }
    }
  }
  return p;
}

inline std::vector<uint8_t> EncodeJpeg(const std::vector<uint8_t>& pixels, int h, int w,
                                       int format = TJPF_RGB, int subsamp = TJSAMP_444,
                                       int quality = 100, int flags = 0) {
  tjhandle t = tjInitCompress();
  unsigned char* out = nullptr;
  unsigned long size = 0;
  EXPECT_EQ(tjCompress2(t, pixels.data(), w, 0, h, format, &out, &size, subsamp, quality,
                        TJFLAG_ACCURATEDCT | flags),
            0)
      << tjGetErrorStr2(t);
  std::vector<uint8_t> bytes(out, out + size);
  tjFree(out);
  tjDestroy(t);
  return bytes;
}

// The test's own decode of a JPEG to h x w x 3 RGB (TurboJPEG, accurate DCT): a reference
// independent of the daemon's decoder.
inline std::vector<uint8_t> DecodeJpegRgb(const std::vector<uint8_t>& jpeg, int* h, int* w) {
  tjhandle t = tjInitDecompress();
  int subsamp = 0, colorspace = 0;
  EXPECT_EQ(tjDecompressHeader3(t, jpeg.data(), jpeg.size(), w, h, &subsamp, &colorspace), 0)
      << tjGetErrorStr2(t);
  std::vector<uint8_t> rgb(static_cast<size_t>(*h) * *w * 3);
  EXPECT_EQ(tjDecompress2(t, jpeg.data(), jpeg.size(), rgb.data(), *w, 0, *h, TJPF_RGB,
                          TJFLAG_ACCURATEDCT),
            0)
      << tjGetErrorStr2(t);
  tjDestroy(t);
  return rgb;
}

inline std::vector<uint8_t> EncodePng(const std::vector<uint8_t>& pixels, int h, int w,
                                      png_uint_32 format = PNG_FORMAT_RGB,
                                      const std::vector<uint8_t>& colormap = {}) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.width = static_cast<png_uint_32>(w);
  image.height = static_cast<png_uint_32>(h);
  image.format = format;
  if (!colormap.empty()) image.colormap_entries = static_cast<png_uint_32>(colormap.size() / 3);
  png_alloc_size_t size = 0;
  EXPECT_TRUE(png_image_write_get_memory_size(image, size, 0, pixels.data(), 0,
                                              colormap.empty() ? nullptr : colormap.data()));
  std::vector<uint8_t> bytes(size);
  EXPECT_TRUE(png_image_write_to_memory(&image, bytes.data(), &size, 0, pixels.data(), 0,
                                        colormap.empty() ? nullptr : colormap.data()));
  bytes.resize(size);
  return bytes;
}

}  // namespace gpufeed::testing
