// The SIMD augment path against the scalar reference (ResizedCrop, the window, WriteImage:
// what Augment() did before), byte for byte, and against the double reference within float
// rounding; its float16/bfloat16 conversions against FloatToHalf/FloatToBFloat16 bit for bit.
// Every test runs once per Highway target compiled in and supported by this CPU.
#include "server/augment/fast_augment.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "gtest/gtest.h"
#include "hwy/targets.h"
#include "server/augment/crop.h"
#include "server/augment/resize.h"
#include "tests/testing/resample_reference.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Noise;
using ::gpufeed::testing::ResampleReference;

// Runs `body` with dispatch forced to each target this build has and this CPU supports, and
// returns their names.
std::vector<std::string> ForEachTarget(const std::function<void()>& body) {
  std::vector<std::string> names;
  for (const int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    body();
    names.push_back(hwy::TargetName(target));
  }
  hwy::SetSupportedTargetsForTest(0);
  return names;
}

std::string Joined(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : " ") + n;
  return s;
}

// The scalar reference of the CPU path: the crop resized with ResizedCrop, the window (zeros
// outside the resized image) and the flip, then WriteImage.
std::vector<std::byte> ReferenceAugment(const Image& image, const StagedGeometry& g, int oh, int ow,
                                        const OutputSpec& spec) {
  std::vector<float> resized(static_cast<size_t>(g.resize_height) * g.resize_width * 3);
  ResizedCrop(image, {g.crop_top, g.crop_left, g.crop_height, g.crop_width}, g.resize_height,
              g.resize_width, false, resized.data());
  std::vector<float> window(static_cast<size_t>(oh) * ow * 3, 0.0f);
  for (int y = 0; y < oh; ++y) {
    for (int x_out = 0; x_out < ow; ++x_out) {
      const int ry = y + g.window_top;
      const int rx = (g.flip ? ow - 1 - x_out : x_out) + g.window_left;
      if (ry < 0 || ry >= g.resize_height || rx < 0 || rx >= g.resize_width) continue;
      std::memcpy(&window[(static_cast<size_t>(y) * ow + x_out) * 3],
                  &resized[(static_cast<size_t>(ry) * g.resize_width + rx) * 3], 3 * sizeof(float));
    }
  }
  std::vector<std::byte> out(OutputBytes(spec, oh, ow));
  WriteImage(window.data(), oh, ow, spec, out.data());
  return out;
}

struct Case {
  Image image;
  StagedGeometry g;
  int oh = 0, ow = 0;
  std::string Describe() const {
    std::ostringstream s;
    s << image.height << "x" << image.width << " crop " << g.crop_top << "," << g.crop_left << " "
      << g.crop_height << "x" << g.crop_width << " resize " << g.resize_height << "x"
      << g.resize_width << " window " << g.window_top << "," << g.window_left << " out " << oh
      << "x" << ow << (g.flip ? " flipped" : "");
    return s.str();
  }
};

// A random resized crop's geometry: the box resized to the output, no window.
Case Crop(const Image& image, CropBox box, int oh, int ow, bool flip) {
  Case c{image, {}, oh, ow};
  c.g = {image.height, image.width, box.top, box.left, box.height, box.width, oh, ow, 0, 0, flip};
  return c;
}

// Resize (the whole image to rh x rw), then the centre window of oh x ow, padded with zeros
// where it is larger.
Case Window(const Image& image, int rh, int rw, int oh, int ow, bool flip) {
  const CropBox w = CenterCropBox(rh, rw, oh, ow);
  Case c{image, {}, oh, ow};
  c.g = {image.height, image.width, 0, 0, image.height, image.width, rh, rw, w.top, w.left, flip};
  return c;
}

std::vector<Case> Cases() {
  const Image a = Noise(60, 80, 7), b = Noise(37, 23, 9), tiny = Noise(1, 1, 5);
  std::vector<Case> cases = {
      Crop(a, {5, 7, 50, 61}, 17, 23, false),   // shrink ~3x
      Crop(a, {0, 0, 60, 80}, 13, 9, true),     // shrink > 4x, flipped
      Crop(a, {0, 0, 60, 80}, 2, 1, false),     // shrink 30x to a single column
      Crop(a, {10, 20, 9, 11}, 31, 29, true),   // enlarge ~3x
      Crop(a, {3, 3, 40, 40}, 40, 40, false),   // identity
      Crop(a, {3, 3, 40, 1}, 40, 17, true),     // a 1-pixel-wide crop
      Crop(a, {12, 30, 1, 1}, 5, 33, false),    // a single pixel
      Crop(a, {23, 41, 37, 39}, 19, 35, true),  // the image's last pixel (padded last row)
      Crop(a, {0, 0, 60, 80}, 60, 80, true),    // identity of the whole image, flipped
      Crop(b, {0, 0, 37, 23}, 50, 70, false),   // odd sizes, enlarged
      Crop(tiny, {0, 0, 1, 1}, 3, 18, true),    // a 1x1 image
      Window(a, 48, 64, 40, 40, false),         // resize, then a window inside it
      Window(a, 48, 64, 56, 72, true),          // a window larger than the resize: padding
      Window(b, 37, 23, 30, 30, true),          // no resize: padded on the sides
      Window(b, 37, 23, 41, 19, false),         // no resize: padded top and bottom
      Window(tiny, 1, 1, 4, 3, false),          // padding all round a single pixel
      Window(a, 90, 120, 33, 17, true),         // resize larger, then a window
  };
  std::mt19937 rng(12345);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int i = 0; i < 60; ++i) {
    const Image image = Noise(uniform(1, 70), uniform(1, 70), 100 + i);
    const int h = uniform(1, image.height), w = uniform(1, image.width);
    const CropBox box{uniform(0, image.height - h), uniform(0, image.width - w), h, w};
    const int oh = uniform(1, 45), ow = uniform(1, 45);
    if (i % 3 == 2) {
      cases.push_back(Window(image, uniform(1, 80), uniform(1, 80), oh, ow, i % 2 == 0));
    } else {
      cases.push_back(Crop(image, box, oh, ow, i % 2 == 0));
    }
  }
  return cases;
}

std::vector<OutputSpec> Specs() {
  std::vector<OutputSpec> specs;
  for (const DType dtype : {DType::kUInt8, DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (const Layout layout : {Layout::kNCHW, Layout::kNHWC}) {
      OutputSpec spec;
      spec.dtype = dtype;
      spec.layout = layout;
      spec.normalize = dtype != DType::kUInt8;
      const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
      std::memcpy(spec.mean, mean, sizeof(mean));
      std::memcpy(spec.std, std, sizeof(std));
      specs.push_back(spec);
    }
  }
  OutputSpec plain;  // float32 without normalisation: v / 255
  plain.dtype = DType::kFloat32;
  specs.push_back(plain);
  return specs;
}

std::string Name(const OutputSpec& spec) {
  const char* dtype = spec.dtype == DType::kUInt8      ? "uint8"
                      : spec.dtype == DType::kFloat16  ? "float16"
                      : spec.dtype == DType::kBFloat16 ? "bfloat16"
                                                       : "float32";
  return std::string(dtype) + (spec.layout == Layout::kNCHW ? " NCHW" : " NHWC") +
         (spec.normalize ? " normalised" : "");
}

std::vector<std::byte> Fast(const Case& c, const OutputSpec& spec) {
  // Poisoned, so a value the fast path leaves unwritten shows.
  std::vector<std::byte> out(OutputBytes(spec, c.oh, c.ow), std::byte{0xA5});
  FastAugment(c.image, c.g, c.oh, c.ow, spec, out.data());
  return out;
}

TEST(FastAugmentTest, EqualsTheScalarReferenceByteForByteOnEveryTarget) {
  const std::vector<Case> cases = Cases();
  const std::vector<OutputSpec> specs = Specs();
  const std::vector<std::string> targets = ForEachTarget([&] {
    for (const Case& c : cases) {
      for (const OutputSpec& spec : specs) {
        const std::vector<std::byte> fast = Fast(c, spec),
                                     ref = ReferenceAugment(c.image, c.g, c.oh, c.ow, spec);
        const size_t size = DTypeSize(spec.dtype);
        for (size_t i = 0; i < fast.size(); i += size) {
          if (std::memcmp(&fast[i], &ref[i], size) != 0) {
            ADD_FAILURE() << c.Describe() << ", " << Name(spec) << ": value " << i / size
                          << " differs";
            break;
          }
        }
      }
    }
  });
  // x86-64 has at least the baseline and SSSE3: more than one target must have run.
  std::cout << "targets: " << Joined(targets) << "\n";
  RecordProperty("targets", Joined(targets));
#if defined(__x86_64__)
  EXPECT_GE(targets.size(), 2u) << Joined(targets);
#endif
}

TEST(FastAugmentTest, MatchesTheDoubleReferenceWithinFloatRounding) {
  const std::vector<Case> cases = Cases();
  OutputSpec u8;
  OutputSpec f32;
  f32.dtype = DType::kFloat32;
  ForEachTarget([&] {
    for (const Case& c : cases) {
      const std::vector<std::byte> bytes = Fast(c, u8), floats = Fast(c, f32);
      const size_t plane = static_cast<size_t>(c.oh) * c.ow;
      double worst = 0;
      int worst_level = 0;
      for (int y = 0; y < c.oh; ++y) {
        for (int x_out = 0; x_out < c.ow; ++x_out) {
          const int ry = y + c.g.window_top;
          const int rx = (c.g.flip ? c.ow - 1 - x_out : x_out) + c.g.window_left;
          const bool inside = ry >= 0 && ry < c.g.resize_height && rx >= 0 && rx < c.g.resize_width;
          for (int ch = 0; ch < 3; ++ch) {
            const double ref =
                inside
                    ? ResampleReference(
                          c.image, {c.g.crop_top, c.g.crop_left, c.g.crop_height, c.g.crop_width},
                          c.g.resize_height, c.g.resize_width, ry, rx, ch)
                    : 0.0;
            const size_t at = ch * plane + static_cast<size_t>(y) * c.ow + x_out;  // NCHW
            float v;
            std::memcpy(&v, &floats[at * 4], 4);
            worst = std::max(worst, std::abs(v * 255.0 - ref));
            worst_level = std::max(worst_level, std::abs(static_cast<int>(bytes[at]) -
                                                         static_cast<int>(std::lround(ref))));
          }
        }
      }
      // Float sums of at most a few dozen taps, weights rounded to float: well within 0.01 of
      // 255; uint8 rounds that, so within one level.
      EXPECT_LE(worst, 0.01) << c.Describe();
      EXPECT_LE(worst_level, 1) << c.Describe();
    }
  });
}

// Floats whose conversions a converter gets wrong first: specials, NaNs with payloads, the
// exact midpoints between neighbouring halves (normal and subnormal) and bfloat16s with the
// floats either side, overflow thresholds, and a sweep over all bit patterns.
std::vector<float> HardFloats() {
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000,
                                0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                                0x7F802000, 0x7FA00000, 0x00000001, 0x807FFFFF, 0x477FE000,
                                0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001,
                                0x32FFFFFF, 0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000};
  auto half_value = [](uint32_t h) {  // a finite half's value
    const uint32_t e = (h >> 10) & 31, m = h & 1023;
    return e == 0 ? std::ldexp(static_cast<double>(m), -24)
                  : std::ldexp(static_cast<double>(1024 + m), static_cast<int>(e) - 25);
  };
  std::vector<float> floats;
  for (uint32_t h = 0; h < 0x7C00; ++h) {
    const float mid = static_cast<float>((half_value(h) + half_value(h + 1)) / 2);  // exact
    for (const float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY),
                          static_cast<float>(half_value(h))}) {
      floats.push_back(f);
      floats.push_back(-f);
    }
  }
  for (uint32_t high = 0; high <= 0xFFFF; ++high) {
    for (const uint32_t low : {0x0000u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      bits.push_back(high << 16 | low);
    }
  }
  for (uint64_t b = 0; b <= 0xFFFFFFFFu; b += 65521) bits.push_back(static_cast<uint32_t>(b));
  for (const uint32_t b : bits) {
    float f;
    std::memcpy(&f, &b, 4);
    floats.push_back(f);
  }
  floats.push_back(1.0f);  // an odd count: the converters' tail
  return floats;
}

std::string Hex(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  std::ostringstream s;
  s << std::hex << "0x" << b;
  return s.str();
}

TEST(FastAugmentTest, HalfAndBFloat16ConversionsAreBitEqualToTheScalarOnes) {
  const std::vector<float> floats = HardFloats();
  ForEachTarget([&] {
    std::vector<uint16_t> half(floats.size()), bf16(floats.size());
    FloatsToHalf(floats.data(), floats.size(), half.data());
    FloatsToBFloat16(floats.data(), floats.size(), bf16.data());
    int bad_half = 0, bad_bf16 = 0;
    for (size_t i = 0; i < floats.size(); ++i) {
      if (half[i] != FloatToHalf(floats[i]) && ++bad_half <= 3) {
        ADD_FAILURE() << "float16 of " << Hex(floats[i]) << ": " << half[i] << ", want "
                      << FloatToHalf(floats[i]);
      }
      if (bf16[i] != FloatToBFloat16(floats[i]) && ++bad_bf16 <= 3) {
        ADD_FAILURE() << "bfloat16 of " << Hex(floats[i]) << ": " << bf16[i] << ", want "
                      << FloatToBFloat16(floats[i]);
      }
    }
    EXPECT_EQ(bad_half, 0);
    EXPECT_EQ(bad_bf16, 0);
  });
}

#if defined(__x86_64__)
// Whether XGETBV with ECX = 1 reads XINUSE, the register state components not in their
// initial state: bit 2, the upper halves of ymm0-15; bit 6, the upper halves of zmm0-15.
bool HaveXinuse() {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_OSXSAVE) &&
         __get_cpuid_count(0xD, 1, &a, &b, &c, &d) && (a & 4);
}

uint64_t Xinuse() {
  uint32_t lo, hi;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

constexpr uint64_t kUpperHalves = 4 | 64;

// Legacy-SSE code (the rest of the daemon is built for plain x86-64) runs several times slower
// while those upper halves are dirty: the scalar WriteImage took 5x as long after an AVX-512
// FastAugment that returned without vzeroupper.
TEST(FastAugmentTest, LeavesTheUpperHalvesOfTheVectorRegistersClean) {
  if (!HaveXinuse() || (hwy::SupportedTargets() & HWY_AVX2) == 0) {
    GTEST_SKIP() << "no AVX2 or no XGETBV(1) here";
  }
  // The probe works: a 256-bit write dirties them, vzeroupper cleans them.
  asm volatile("vpcmpeqd %%ymm1, %%ymm1, %%ymm1" ::: "xmm1");
  const uint64_t dirty = Xinuse();
  asm volatile("vzeroupper");
  const uint64_t clean = Xinuse();
  ASSERT_NE(dirty & kUpperHalves, 0u);
  ASSERT_EQ(clean & kUpperHalves, 0u);
  const Case c = Crop(Noise(60, 80, 7), {5, 7, 50, 61}, 17, 23, true);
  std::vector<std::byte> out(OutputBytes(OutputSpec{.dtype = DType::kFloat32}, c.oh, c.ow));
  ForEachTarget([&] {
    for (const OutputSpec& spec : Specs()) {
      FastAugment(c.image, c.g, c.oh, c.ow, spec, out.data());
      const uint64_t in_use = Xinuse();
      EXPECT_EQ(in_use & kUpperHalves, 0u) << Name(spec);
    }
  });
}
#endif

}  // namespace
}  // namespace gpufeed::server
