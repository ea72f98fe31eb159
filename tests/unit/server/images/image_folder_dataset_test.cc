#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/images/dataset.h"
#include "tests/testing/image_files.h"
#include "tests/testing/resample_reference.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wrapping_file_system.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::EncodePng;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::WriteFileBytes;
using ::testing::HasSubstr;


class ImageFolderDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.path();
    png_ = Picture(10, 12, 3, 1);
    WriteFileBytes(root_ + "/a/1.png", EncodePng(png_, 10, 12));
    WriteFileBytes(root_ + "/a/2.jpg", EncodeJpeg(Picture(40, 30, 3, 2), 40, 30));
    WriteFileBytes(root_ + "/b/3.png", EncodePng(Picture(9, 9, 3, 3), 9, 9));
  }

  absl::StatusOr<std::unique_ptr<Dataset>> Open(std::vector<PipelineStep> pipeline,
                                                BadSamplePolicy policy = BadSamplePolicy::kSkip,
                                                uint64_t max_pixels = 0,
                                                bool region_decode = true) {
    DatasetSpec spec;
    spec.region_decode = region_decode;
    if (max_pixels != 0) spec.max_pixels = max_pixels;
    spec.kind = DatasetKind::kImageFolder;
    spec.path = root_;
    spec.pipeline = std::move(pipeline);
    spec.bad_sample = policy;
    return OpenDataset(spec, PosixFileSystem());
  }

  // Reads sample `id` into fresh rows; returns the id used.
  // `fill`: the bytes the image row holds before the read (0xff: float NaNs, so that a value
  // the read never wrote shows).
  absl::StatusOr<uint64_t> Read(const Dataset& ds, uint64_t id, SampleContext ctx,
                                std::vector<uint8_t>* image, int64_t* label, uint8_t fill = 0) {
    image->assign(ds.tensors()[0].byte_size, fill);
    std::vector<std::span<std::byte>> rows = {
        std::as_writable_bytes(std::span<uint8_t>(*image)),
        std::span<std::byte>(reinterpret_cast<std::byte*>(label), 8)};
    return ds.ReadSampleAt(id, ctx, rows);
  }

  testing::TempDir dir_;
  std::string root_;
  std::vector<uint8_t> png_;
};

TEST_F(ImageFolderDatasetTest, CentreCropOfALosslessPngIsByteExactWithItsLabel) {
  auto ds = Open({CenterCropStep{8}, LayoutStep{Layout::kNHWC}});
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 3u);
  EXPECT_EQ((*ds)->tensors()[0].name, "image");
  EXPECT_EQ((*ds)->tensors()[0].shape, (std::vector<int64_t>{8, 8, 3}));
  EXPECT_EQ((*ds)->tensors()[1].name, "label");
  EXPECT_EQ((*ds)->tensors()[1].dtype, DType::kInt64);
  std::vector<uint8_t> image;
  int64_t label = -1;
  ASSERT_EQ(*Read(**ds, 0, {}, &image, &label), 0u);
  EXPECT_EQ(label, 0);
  // torchvision's CenterCrop(8) of 10x12: top round(1) = 1, left round(2) = 2.
  for (int y = 0; y < 8; ++y) {
    ASSERT_EQ(std::memcmp(&image[y * 8 * 3], &png_[((1 + y) * 12 + 2) * 3], 8 * 3), 0) << "row " << y;
  }
  ASSERT_EQ(*Read(**ds, 2, {}, &image, &label), 2u);
  EXPECT_EQ(label, 1);
}

// What the walk left out reaches the attaching client as the dataset's notices,
// one line each naming how many, the first and what to do; nothing when nothing was.
TEST_F(ImageFolderDatasetTest, FilesLeftOutAtOpenAreNotices) {
  auto clean = Open({CenterCropStep{8}});
  ASSERT_TRUE(clean.ok()) << clean.status();
  EXPECT_TRUE((*clean)->notices().empty());
  WriteFileBytes(root_ + "/a/4.webp", {1, 2, 3});
  WriteFileBytes(root_ + "/b/5.bmp", {1, 2, 3});
  std::filesystem::create_directory_symlink(root_ + "/b", root_ + "/linked");
  auto ds = Open({CenterCropStep{8}});
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 3u);
  const std::vector<DatasetNotice> notices = (*ds)->notices();
  ASSERT_EQ(notices.size(), 2u);
  EXPECT_EQ(notices[0].reason, "other_image_type");
  EXPECT_EQ(notices[0].count, 2);
  EXPECT_EQ(notices[0].example, root_ + "/a/4.webp");
  EXPECT_EQ(notices[0].message,
            "2 files of an image type gpufeed does not decode (.bmp .ppm .pgm .tif .tiff .webp) "
            "are left out (first: " +
                root_ +
                "/a/4.webp): torchvision's ImageFolder loads them, so its sample ids would "
                "differ from gpufeed's; convert them to .png or .jpg");
  EXPECT_EQ(notices[1].reason, "warning");
  EXPECT_EQ(notices[1].count, 0);
  EXPECT_EQ(notices[1].example, root_ + "/linked");
  EXPECT_EQ(notices[1].message,
            "1 symbolic link is not followed (first: " + root_ +
                "/linked): a linked folder's images (in the root: a linked class) are not part "
                "of the dataset, unlike torchvision's ImageFolder (docs/SECURITY.md section 4); "
                "put the folders themselves in the tree");
}

TEST_F(ImageFolderDatasetTest, RandomCropsDependOnSeedEpochAndSampleOnly) {
  auto ds = Open({RandomResizedCropStep{16, {}}, FlipStep{0.5}});
  ASSERT_TRUE(ds.ok()) << ds.status();
  std::vector<uint8_t> a, b, c;
  int64_t label;
  ASSERT_TRUE(Read(**ds, 1, {7, 0}, &a, &label).ok());
  ASSERT_TRUE(Read(**ds, 1, {7, 0}, &b, &label).ok());
  EXPECT_EQ(a, b);
  bool differs = false;
  for (int64_t epoch = 1; epoch < 6 && !differs; ++epoch) {
    ASSERT_TRUE(Read(**ds, 1, {7, epoch}, &c, &label).ok());
    differs = c != a;
  }
  EXPECT_TRUE(differs) << "five other epochs all drew the same crop";
  EXPECT_EQ((*ds)->tensors()[0].shape, (std::vector<int64_t>{3, 16, 16}));  // NCHW by default
}

TEST_F(ImageFolderDatasetTest, BadImagesAreReplacedAndCountedOrFailNamingTheFile) {
  WriteFileBytes(root_ + "/a/0-empty.jpg", {});
  {
    std::ofstream(root_ + "/a/1-text.png") << "not a png";
  }
  auto ds = Open({CenterCropStep{8}});
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->num_samples(), 5u);  // 0-empty, 1-text, 1.png, 2.jpg, 3.png
  std::vector<uint8_t> image;
  int64_t label;
  // Sample 0 is empty and 1 is not an image: the next good sample, 2 (a/1.png), stands in.
  absl::StatusOr<uint64_t> used = Read(**ds, 0, {}, &image, &label);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, 2u);
  EXPECT_EQ(label, 0);
  auto count = [&](const std::string& reason) {
    for (const auto& [r, n] : (*ds)->bad_samples()) {
      if (r == reason) return n;
    }
    return int64_t{-1};
  };
  // Counted for the sample that asked (0 is empty); the bad file met while looking for a
  // replacement (1) is not counted until it is asked for itself.
  EXPECT_EQ(count("empty"), 1);
  EXPECT_EQ(count("not_an_image"), 0);
  ASSERT_EQ(*Read(**ds, 1, {}, &image, &label), 2u);
  EXPECT_EQ(count("not_an_image"), 1);
  EXPECT_EQ(count("truncated"), 0);

  auto strict = Open({CenterCropStep{8}}, BadSamplePolicy::kFail);
  ASSERT_TRUE(strict.ok());
  absl::StatusOr<uint64_t> failed = Read(**strict, 1, {}, &image, &label);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(failed.status().message(), HasSubstr(root_ + "/a/1-text.png"));
  EXPECT_THAT(failed.status().message(), HasSubstr("not_an_image"));

  // A file removed after the index was built is "unreadable": replaced, or failing by name.
  ASSERT_TRUE(std::filesystem::remove(root_ + "/a/1.png"));
  ASSERT_EQ(*Read(**ds, 2, {}, &image, &label), 3u);  // a/2.jpg stands in
  EXPECT_EQ(count("unreadable"), 1);
  failed = Read(**strict, 2, {}, &image, &label);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(failed.status().message(), HasSubstr(root_ + "/a/1.png (unreadable)"));
}

// A file system that counts the bytes read through it (PosixFileSystem underneath).
class CountingFileSystem final : public ::gpufeed::testing::WrappingFileSystem {
 public:
  CountingFileSystem() : WrappingFileSystem(PosixFileSystem()) {}
  std::atomic<uint64_t> bytes_read{0};

 private:
  void OnRead(const RandomAccessFile&, uint64_t, std::span<std::byte> dst) override {
    bytes_read += dst.size();
  }
};

// docs/SECURITY.md §4: an image file larger than max_image_bytes is a bad sample, too_large,
// and not one byte of it is read (a sparse 16 GiB .jpg was read whole and aborted the daemon).
TEST_F(ImageFolderDatasetTest, AFileLargerThanMaxImageBytesIsTooLargeAndNeverRead) {
  const uint64_t png_bytes = std::filesystem::file_size(root_ + "/a/1.png");
  {  // 0-big.png sorts first: sample 0, one byte over the cap
    std::ofstream big(root_ + "/a/0-big.png", std::ios::binary);
    big << std::string(png_bytes + 1, 'x');
  }
  // A sparse 16 GiB .jpg: without the cap, reading it whole would need 16 GiB.
  std::filesystem::create_directories(root_ + "/c");
  {
    std::ofstream sparse(root_ + "/c/huge.jpg", std::ios::binary);
  }
  std::filesystem::resize_file(root_ + "/c/huge.jpg", uint64_t{16} << 30);
  CountingFileSystem fs;
  DatasetSpec spec;
  spec.kind = DatasetKind::kImageFolder;
  spec.path = root_;
  spec.pipeline = {CenterCropStep{8}};
  spec.max_image_bytes = png_bytes;  // a/1.png is exactly at the cap: served
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(spec, &fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->num_samples(), 5u);  // a/0-big, a/1, a/2, b/3, c/huge
  auto count = [&](const std::string& reason) {
    for (const auto& [r, n] : (*ds)->bad_samples()) {
      if (r == reason) return n;
    }
    return int64_t{-1};
  };
  std::vector<uint8_t> image;
  int64_t label;
  absl::StatusOr<uint64_t> used = Read(**ds, 0, {}, &image, &label);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, 1u);  // replaced by a/1.png
  EXPECT_EQ(count("too_large"), 1);
  EXPECT_EQ(fs.bytes_read.load(), png_bytes);  // a/1.png's bytes only
  // The sparse file: too_large too, then wraps to sample 0 (too large) and 1.
  fs.bytes_read = 0;
  used = Read(**ds, 4, {}, &image, &label);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, 1u);
  EXPECT_EQ(count("too_large"), 2);
  EXPECT_EQ(fs.bytes_read.load(), png_bytes);
  // With the policy fail, the error names the file, the reason and both sizes.
  spec.bad_sample = BadSamplePolicy::kFail;
  ds = OpenDataset(spec, &fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  used = Read(**ds, 4, {}, &image, &label);
  EXPECT_EQ(used.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(used.status().message(),
            absl::StrCat("image ", root_, "/c/huge.jpg (too_large): the file holds 17179869184 "
                         "bytes, more than max_image_bytes (", png_bytes, ")"));
}

// Found by fuzzing (tests/fuzz, attach_request): the resize of an extreme panorama is far
// larger than the image, and the CPU path allocates it whole (a 1 x 65536 PNG resized to 256
// is 256 x 16M floats x 3, 51 GB). Past the pixel cap it is a bad image, too_large, in the
// CPU and the DCT-scaled JPEG paths alike.
TEST_F(ImageFolderDatasetTest, AResizePastThePixelCapIsTooLarge) {
  std::filesystem::remove_all(root_);
  WriteFileBytes(root_ + "/a/wide.png", EncodePng(Picture(1, 512, 3, 4), 1, 512));
  WriteFileBytes(root_ + "/a/wide.jpg", EncodeJpeg(Picture(8, 512, 3, 5), 8, 512));
  WriteFileBytes(root_ + "/a/wide_tall.png", EncodePng(Picture(512, 2, 3, 6), 512, 2));
  // 4096 pixels: every image fits (512, 4096, 1024) but not its resize to a shorter side of
  // 16 (16 x 8192, 16 x 1024, 4096 x 16 = 65536 > 4096).
  for (bool dct : {false, true}) {
    std::vector<PipelineStep> pipeline = {ResizeStep{16}, CenterCropStep{16}};
    if (dct) pipeline.insert(pipeline.begin(), DecodeStep{true});
    auto ds = Open(pipeline, BadSamplePolicy::kFail, /*max_pixels=*/4096);
    ASSERT_TRUE(ds.ok()) << ds.status();
    ASSERT_EQ((*ds)->num_samples(), 3u);
    std::vector<uint8_t> image;
    int64_t label;
    const std::pair<const char*, const char*> kFiles[] = {
        {"/a/wide.jpg", "image of 512x8 resized to 1024x16 exceeds the cap of 4096 pixels"},
        {"/a/wide.png", "image of 512x1 resized to 8192x16 exceeds the cap of 4096 pixels"},
        {"/a/wide_tall.png", "image of 2x512 resized to 16x4096 exceeds the cap of 4096 pixels"}};
    for (uint64_t id = 0; id < 3; ++id) {
      absl::StatusOr<uint64_t> read = Read(**ds, id, {}, &image, &label);
      EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss) << id;
      EXPECT_THAT(read.status().message(), HasSubstr(root_ + kFiles[id].first + " (too_large)"));
      EXPECT_THAT(read.status().message(), HasSubstr(kFiles[id].second));
    }
  }
  // Under a cap that holds the resize, the same images are served.
  auto ds = Open({ResizeStep{16}, CenterCropStep{16}}, BadSamplePolicy::kFail, 1 << 20);
  ASSERT_TRUE(ds.ok()) << ds.status();
  std::vector<uint8_t> image;
  int64_t label;
  for (uint64_t id = 0; id < 3; ++id) EXPECT_TRUE(Read(**ds, id, {}, &image, &label).ok()) << id;
}

TEST_F(ImageFolderDatasetTest, ResizeThenCentreCropAndNormalisedFloatOutput) {
  auto ds = Open({ResizeStep{12}, CenterCropStep{10},
                  NormalizeStep{{0.5f, 0.5f, 0.5f}, {0.25f, 0.25f, 0.25f}}});
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kFloat32);
  std::vector<uint8_t> image;
  int64_t label;
  ASSERT_EQ((*ds)->tensors()[0].shape, (std::vector<int64_t>{3, 10, 10}));
  // Rows prefilled with NaNs: the 40x30 JPEG -> 16x12 -> 10x10, every value written.
  ASSERT_TRUE(Read(**ds, 1, {}, &image, &label, 0xff).ok());
  EXPECT_EQ(label, 0);
  std::vector<float> f(image.size() / 4);
  ASSERT_EQ(f.size(), 3u * 10 * 10);
  std::memcpy(f.data(), image.data(), image.size());
  // The reference: the test's own decode of the file, the resize's double reference at the
  // centre crop's pixels (top round(3) = 3, left round(1) = 1 of 16x12), then (v/255 - mean)/std,
  // NCHW, channels in RGB order. Tolerance 1 level of 255 (room for the decoder's IDCT and the
  // resize's fast path; both match to 1e-6 today) = 1/255/0.25 = 0.0157 after normalisation.
  int h = 0, w = 0;
  const std::vector<uint8_t> rgb =
      testing::DecodeJpegRgb(EncodeJpeg(Picture(40, 30, 3, 2), 40, 30), &h, &w);
  ASSERT_EQ(h, 40);
  ASSERT_EQ(w, 30);
  const server::Image decoded{h, w, rgb};
  const double tolerance = 1.0 / 255 / 0.25;
  for (int c = 0; c < 3; ++c) {
    for (int y = 0; y < 10; ++y) {
      for (int x = 0; x < 10; ++x) {
        const double ref =
            (testing::ResampleReference(decoded, {0, 0, 40, 30}, 16, 12, y + 3, x + 1, c) / 255 -
             0.5) /
            0.25;
        const float got = f[(c * 10 + y) * 10 + x];
        ASSERT_FALSE(std::isnan(got)) << "c " << c << " y " << y << " x " << x << " not written";
        EXPECT_NEAR(got, ref, tolerance) << "c " << c << " y " << y << " x " << x;
      }
    }
  }
}

TEST_F(ImageFolderDatasetTest, DctScalingDecodesLargeJpegsSmallerWithTheSameCrops) {
  std::filesystem::remove_all(root_);
  WriteFileBytes(root_ + "/a/big.jpg", EncodeJpeg(Picture(384, 512, 3, 7), 384, 512, TJPF_RGB, TJSAMP_420, 95));
  auto pixels = [&](std::vector<PipelineStep> pipeline, uint64_t seed, int64_t epoch) {
    auto ds = Open(std::move(pipeline));
    EXPECT_TRUE(ds.ok()) << ds.status();
    std::vector<uint8_t> image;
    int64_t label;
    EXPECT_TRUE(Read(**ds, 0, {seed, epoch}, &image, &label).ok());
    return image;
  };
  // Resize to 48 then crop 48: a 1/8 scale (48x64) still has the 48 rows the resize needs.
  const std::vector<uint8_t> full = pixels({ResizeStep{48}, CenterCropStep{48}}, 0, 0);
  const std::vector<uint8_t> scaled =
      pixels({DecodeStep{true}, ResizeStep{48}, CenterCropStep{48}}, 0, 0);
  ASSERT_EQ(full.size(), scaled.size());
  double sum = 0;
  for (size_t i = 0; i < full.size(); ++i) sum += std::abs(int{full[i]} - int{scaled[i]});
  EXPECT_GT(sum, 0) << "the scaled decode should differ a little";
  EXPECT_LT(sum / static_cast<double>(full.size()), 2.0);
  // Crops of 300: no scale keeps 300 rows of a 384-row image, so outputs are byte-identical
  // (and the random crops are the same: planned on the full-size image either way).
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    EXPECT_EQ(pixels({RandomResizedCropStep{300, {}}, FlipStep{0.5}}, 5, epoch),
              pixels({DecodeStep{true}, RandomResizedCropStep{300, {}}, FlipStep{0.5}}, 5, epoch))
        << "epoch " << epoch;
  }
  auto misplaced = Open({ResizeStep{48}, DecodeStep{true}, CenterCropStep{48}});
  EXPECT_EQ(misplaced.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(misplaced.status().message(), HasSubstr("pipeline[1] decode: comes first, once"));
}

TEST_F(ImageFolderDatasetTest, RegionDecodesGiveTheRowsOfWholeDecodes) {
  // ImageNet-like photos (noise, so that any wrong pixel shows) in every shape a random
  // resized crop meets: landscape, portrait, 4:2:0 and 4:4:4, a grey one, one smaller than
  // the output; with and without DCT scaling, over several epochs (other crops).
  std::filesystem::remove_all(root_);
  std::mt19937 gen(3);
  auto noise = [&](int h, int w, int channels) {
    std::vector<uint8_t> p(static_cast<size_t>(h) * w * channels);
    for (auto& v : p) v = static_cast<uint8_t>(gen());
    return p;
  };
  WriteFileBytes(root_ + "/a/0.jpg",
                 EncodeJpeg(noise(375, 500, 3), 375, 500, TJPF_RGB, TJSAMP_420, 90));
  WriteFileBytes(root_ + "/a/1.jpg",
                 EncodeJpeg(noise(500, 333, 3), 500, 333, TJPF_RGB, TJSAMP_444, 90));
  WriteFileBytes(root_ + "/b/2.jpg",
                 EncodeJpeg(noise(301, 457, 1), 301, 457, TJPF_GRAY, TJSAMP_GRAY, 90));
  WriteFileBytes(root_ + "/b/3.jpg",
                 EncodeJpeg(noise(60, 90, 3), 60, 90, TJPF_RGB, TJSAMP_420, 90));
  WriteFileBytes(root_ + "/b/4.png", EncodePng(noise(70, 80, 3), 70, 80));
  // Under bad_sample fail the region decode also checks the rest of each file; under skip not.
  for (int k = 0; k < 4; ++k) {
    const bool dct = k % 2 == 1;
    const BadSamplePolicy policy = k < 2 ? BadSamplePolicy::kSkip : BadSamplePolicy::kFail;
    std::vector<PipelineStep> pipeline = {RandomResizedCropStep{112, {}}, FlipStep{0.5}};
    if (dct) pipeline.insert(pipeline.begin(), DecodeStep{true});
    auto region = Open(pipeline, policy);
    auto whole = Open(pipeline, policy, 0, /*region_decode=*/false);
    ASSERT_TRUE(region.ok() && whole.ok());
    for (int64_t epoch = 0; epoch < 6; ++epoch) {
      for (uint64_t id = 0; id < 5; ++id) {
        std::vector<uint8_t> a, b;
        int64_t la = -1, lb = -2;
        ASSERT_TRUE(Read(**region, id, {11, epoch}, &a, &la).ok());
        ASSERT_TRUE(Read(**whole, id, {11, epoch}, &b, &lb).ok());
        EXPECT_EQ(la, lb);
        EXPECT_TRUE(a == b) << "sample " << id << ", epoch " << epoch << (dct ? ", dct" : "");
      }
    }
  }
}

// A sharing group's rows (SharedRow) give the bytes a private read gives: a row that decodes
// whole for the group, and one that takes that decode from the group, equal the region decode
// of a random resized crop (and a PNG's whole decode), sample by sample, epoch by epoch, on
// the CPU path and the staged CPU-decode path; a found row reads no file.
TEST_F(ImageFolderDatasetTest, SharedRowsGiveThePrivateBytes) {
  std::filesystem::remove_all(root_);
  constexpr int kSamples = 12;
  for (int i = 0; i < kSamples; ++i) {
    const int h = 40 + (i * 29) % 70, w = 40 + (i * 41) % 90;
    const std::string name = absl::StrCat(root_, "/c", i % 2, "/", 100 + i);
    if (i % 4 == 3) {
      WriteFileBytes(name + ".png", EncodePng(Picture(h, w, 3, i), h, w));
    } else {
      WriteFileBytes(name + ".jpg", EncodeJpeg(Picture(h, w, 3, i), h, w, TJPF_RGB, TJSAMP_420, 90));
    }
  }
  auto opened = Open({RandomResizedCropStep{16, {}}, FlipStep{0.5}});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const auto& ds = dynamic_cast<const ImageDataset&>(**opened);
  const size_t row_bytes = ds.tensors()[0].byte_size;
  const StagedLayout layout = ds.StagedLayoutFor(1);
  auto read = [&](uint64_t id, SampleContext ctx, SharedRow* share) {
    std::vector<uint8_t> image(row_bytes, 0xff);
    int64_t label = -1;
    std::vector<std::span<std::byte>> rows = {
        std::as_writable_bytes(std::span<uint8_t>(image)),
        std::span<std::byte>(reinterpret_cast<std::byte*>(&label), 8)};
    EXPECT_EQ(*ds.ReadImageAt(id, ctx, rows, share), id);
    image.resize(image.size() + 8);
    std::memcpy(image.data() + row_bytes, &label, 8);
    return image;
  };
  // The staged row's record and label, and the arena's pixels it names.
  auto stage = [&](uint64_t id, SampleContext ctx, SharedRow* share) {
    std::vector<std::byte> slot(layout.stride_bytes);
    StageArena arena(layout);
    const StageTarget target{StageMode::kCpuDecode, &layout, slot.data(), &arena, {}};
    EXPECT_EQ(*ds.StageSampleAt(id, ctx, 0, target, share), id);
    const auto* record = reinterpret_cast<const StagedRecord*>(slot.data() + layout.records_offset);
    std::vector<uint8_t> out(sizeof(StagedGeometry) + 8 + record->host_bytes);
    std::memcpy(out.data(), &record->geometry, sizeof(StagedGeometry));
    std::memcpy(out.data() + sizeof(StagedGeometry), slot.data() + layout.labels_offset, 8);
    std::memcpy(out.data() + sizeof(StagedGeometry) + 8,
                slot.data() + layout.arena_offset + record->host_offset, record->host_bytes);
    return out;
  };
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    for (uint64_t id = 0; id < kSamples; ++id) {
      const SampleContext ctx{static_cast<uint64_t>(7 + epoch), epoch};
      const std::vector<uint8_t> own = read(id, ctx, nullptr);
      SharedRow first{nullptr, /*wanted=*/true, nullptr, nullptr};
      EXPECT_EQ(read(id, ctx, &first), own) << "sample " << id << " epoch " << epoch;
      ASSERT_NE(first.decoded, nullptr);
      EXPECT_EQ(first.decoded->top, 0);
      // Nobody behind: decoded, not handed back.
      SharedRow unwanted{nullptr, false, nullptr, nullptr};
      EXPECT_EQ(read(id, ctx, &unwanted), own) << "sample " << id;
      EXPECT_EQ(unwanted.decoded, nullptr);
      EXPECT_EQ(first.decoded->left, 0);
      // Another job (another seed) takes the decode: the same as its own private read.
      const SampleContext other{ctx.seed + 100, epoch};
      SharedRow found{first.decoded, false, nullptr, nullptr};
      EXPECT_EQ(read(id, other, &found), read(id, other, nullptr)) << "sample " << id;
      EXPECT_EQ(found.decoded, nullptr);
      SharedRow staged_found{first.decoded, false, nullptr, nullptr};
      SharedRow staged_wanted{nullptr, true, nullptr, nullptr};
      const std::vector<uint8_t> staged_own = stage(id, other, nullptr);
      // Two rows of the group share one decode in flight: the first to start decodes it and
      // the other takes its image; both give their private bytes.
      auto pending = std::make_shared<SharePending>(static_cast<int64_t>(id));
      SharedRow starter{nullptr, true, nullptr, pending}, taker{nullptr, true, nullptr, pending};
      EXPECT_EQ(read(id, ctx, &starter), own) << "sample " << id;
      ASSERT_NE(starter.decoded, nullptr);
      EXPECT_EQ(read(id, other, &taker), read(id, other, nullptr)) << "sample " << id;
      EXPECT_EQ(taker.decoded, nullptr);  // it decoded nothing
      EXPECT_EQ(pending->image(), starter.decoded);
      EXPECT_EQ(stage(id, other, &staged_found), staged_own) << "sample " << id;
      EXPECT_EQ(stage(id, other, &staged_wanted), staged_own) << "sample " << id;
      ASSERT_NE(staged_wanted.decoded, nullptr);
      EXPECT_EQ(staged_wanted.decoded->rgb, first.decoded->rgb);
    }
  }
  // A found row reads no file: the group's decode stands in for a file that is gone.
  SharedRow keep{nullptr, true, nullptr, nullptr};
  const std::vector<uint8_t> before = read(0, {7, 0}, &keep);
  std::filesystem::remove_all(root_ + "/c0/100.jpg");
  SharedRow found{keep.decoded, false, nullptr, nullptr};
  EXPECT_EQ(read(0, {7, 0}, &found), before);
}

// decode auto's rows for the CPU (cpu_rows.h): with a known histogram, the CPU takes the
// rows whose crop boxes cost a region decode least, about `share` of them; before it, and
// without a random resized crop, rows spread evenly by index as before.
TEST_F(ImageFolderDatasetTest, DecodeAutoGivesTheCpuTheRowsWhoseBoxesCostItLeast) {
  std::filesystem::remove_all(root_);
  constexpr int kRows = 48;
  for (int i = 0; i < kRows; ++i) {
    const int h = 64 + (i * 29) % 90, w = 64 + (i * 41) % 110;
    WriteFileBytes(absl::StrCat(root_, "/c", i % 2, "/", 100 + i, ".jpg"),
                   EncodeJpeg(Picture(h, w, 3, i), h, w, TJPF_RGB, TJSAMP_420, 90));
  }
  auto opened = Open({RandomResizedCropStep{16, {}}, FlipStep{0.5}});
  ASSERT_TRUE(opened.ok()) << opened.status();
  const auto& ds = dynamic_cast<const ImageDataset&>(**opened);
  const StagedLayout layout = ds.StagedLayoutFor(kRows);
  std::vector<std::byte> slot(layout.stride_bytes);
  // Stages every row under `cpu`; returns which rows the CPU decoded, and each JPEG record.
  auto stage = [&](const CpuRows& cpu, std::vector<StagedRecord>* records) {
    StageArena arena(layout);
    const StageTarget target{StageMode::kNvjpeg, &layout, slot.data(), &arena, cpu};
    std::vector<bool> on_cpu;
    for (int row = 0; row < kRows; ++row) {
      EXPECT_TRUE(ds.StageSampleAt(static_cast<uint64_t>(row), {5, 0}, row, target).ok());
      const auto& r =
          reinterpret_cast<const StagedRecord*>(slot.data() + layout.records_offset)[row];
      on_cpu.push_back(r.kind != StagedKind::kJpeg);
      if (records != nullptr) records->push_back(r);
    }
    return on_cpu;
  };
  // Share 0: nvJPEG takes every row; its records give each row's box, hence its cost.
  std::vector<StagedRecord> all;
  RowCosts costs;
  for (bool c : stage({0.0, &costs, {}}, &all)) ASSERT_FALSE(c);
  EXPECT_FALSE(costs.BoundFor(0.5).known) << "nothing is recorded at share 0";
  std::vector<int> bins;
  for (const StagedRecord& r : all) {
    const StagedGeometry& g = r.geometry;
    bins.push_back(RowCosts::BinOf(
        RegionDecodeCost(g.src_height, g.src_width, g.crop_top, g.crop_height, g.crop_width)));
  }
  // Before kMinRows rows are recorded: by index, the rows CpuDecodesRow names.
  std::vector<bool> even = stage({0.5, &costs, costs.BoundFor(0.5)}, nullptr);
  for (int row = 0; row < kRows; ++row) EXPECT_EQ(even[row], CpuDecodesRow(row, 0.5)) << row;
  ASSERT_FALSE(costs.BoundFor(0.5).known);  // 48 of 64 rows
  stage({0.5, &costs, {}}, nullptr);        // 96: known
  const RowCosts::Bound bound = costs.BoundFor(0.5);
  ASSERT_TRUE(bound.known);
  const std::vector<bool> cheap = stage({0.5, &costs, bound}, nullptr);
  int taken = 0, max_taken = -1, min_left = RowCosts::kBins;
  for (int row = 0; row < kRows; ++row) {
    if (cheap[row]) {
      ++taken;
      max_taken = std::max(max_taken, bins[row]);
    } else {
      min_left = std::min(min_left, bins[row]);
    }
  }
  EXPECT_LE(max_taken, min_left) << "the CPU took a row dearer than one it left to nvJPEG";
  EXPECT_NEAR(taken, kRows / 2, 3);
  EXPECT_NE(cheap, even) << "the cost made no difference: the test shows nothing";
  // Without a random resized crop there is no estimate: by index again.
  auto centre = Open({ResizeStep{20}, CenterCropStep{16}});
  ASSERT_TRUE(centre.ok());
  const auto& cds = dynamic_cast<const ImageDataset&>(**centre);
  const StagedLayout clayout = cds.StagedLayoutFor(kRows);
  std::vector<std::byte> cslot(clayout.stride_bytes);
  StageArena carena(clayout);
  const StageTarget ctarget{
      StageMode::kNvjpeg, &clayout, cslot.data(), &carena, {0.5, &costs, bound}};
  for (int row = 0; row < kRows; ++row) {
    ASSERT_TRUE(cds.StageSampleAt(static_cast<uint64_t>(row), {5, 0}, row, ctarget).ok());
    const auto& r =
        reinterpret_cast<const StagedRecord*>(cslot.data() + clayout.records_offset)[row];
    EXPECT_EQ(r.kind != StagedKind::kJpeg, CpuDecodesRow(row, 0.5)) << row;
  }
}

TEST(RowCostsTest, TheBoundTakesTheCheapestShareOfTheRecordedRows) {
  RowCosts costs;
  for (int i = 0; i < 63; ++i) costs.Record(10);
  EXPECT_FALSE(costs.BoundFor(0.5).known) << "63 rows: too few";
  for (int i = 0; i < 37; ++i) costs.Record(10);  // 100 at bin 10
  for (int i = 0; i < 100; ++i) costs.Record(20);
  for (int i = 0; i < 200; ++i) costs.Record(40);
  RowCosts::Bound b = costs.BoundFor(0.25);
  EXPECT_TRUE(b.known);
  EXPECT_EQ(b.bin, 10);
  EXPECT_DOUBLE_EQ(b.part, 1.0);
  b = costs.BoundFor(0.375);  // 150 of 400: all of bin 10, half of bin 20
  EXPECT_EQ(b.bin, 20);
  EXPECT_DOUBLE_EQ(b.part, 0.5);
  EXPECT_FALSE(costs.BoundFor(0).known);  // 0 and 1 are exact by index
  EXPECT_FALSE(costs.BoundFor(1).known);
  const CpuRows cpu{0.375, &costs, b};
  int in_bin = 0;
  for (int row = 0; row < 100; ++row) {
    EXPECT_TRUE(cpu.Takes(row, 10));
    EXPECT_FALSE(cpu.Takes(row, 40));
    in_bin += cpu.Takes(row, 20);
    EXPECT_EQ(cpu.Takes(row, std::nullopt), CpuDecodesRow(row, 0.375));
  }
  EXPECT_EQ(in_bin, 50);
  // The estimate: a box near the top costs less than the same box at the bottom, and the
  // whole image about a whole decode.
  EXPECT_LT(RegionDecodeCost(400, 400, 0, 100, 100), RegionDecodeCost(400, 400, 300, 100, 100));
  EXPECT_NEAR(RegionDecodeCost(400, 400, 0, 400, 400), 1.0, 0.05);
  EXPECT_EQ(RowCosts::BinOf(1.02), RowCosts::kBins - 1);
  EXPECT_EQ(RowCosts::BinOf(-1), 0);
}

}  // namespace
}  // namespace gpufeed::server
