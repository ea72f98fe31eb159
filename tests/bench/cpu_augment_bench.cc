// The CPU image path on one core: per image, libjpeg-turbo's decode, the scalar reference
// augment (ResizedCrop then WriteImage) and the SIMD one (FastAugment), and the fraction of
// the decode rate each leaves (decode / (decode + augment): the share of cores x the decode
// rate a pool can reach at best with that augment).
//
//   cpu_augment_bench [--data DIR] [--files 200] [--reps 5] [--size 224]
//
// --data: an ImageFolder tree; without it, 100 noisy 500x375 and 375x500 JPEGs (quality 90,
// 4:2:0, ~110 KB) made here. Each augment runs on an image just decoded (untimed), as in the
// daemon, so its pixels are as warm in the cache as there. Prints a markdown table and one
// JSON line. Also times the region decode of each random resized crop (--region_decode).
#include <turbojpeg.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "hwy/targets.h"
#include "server/augment/crop.h"
#include "server/augment/fast_augment.h"
#include "server/augment/output.h"
#include "server/augment/resize.h"
#include "server/decode/image_decoder.h"
#include "server/reader/image_folder.h"

ABSL_FLAG(std::string, data, "", "an ImageFolder tree; empty: generated JPEGs");
ABSL_FLAG(int, files, 200, "files read from --data (spread over the tree)");
ABSL_FLAG(int, reps, 5, "passes over the images per measurement");
ABSL_FLAG(int, size, 224, "output side (RandomResizedCrop(size); Resize(size*8/7), CenterCrop)");

namespace gpufeed {
namespace {

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "cpu_augment_bench: %s\n", message.c_str());
  std::exit(1);
}

std::vector<std::vector<uint8_t>> GeneratedJpegs() {
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> files;
  tjhandle tj = tjInitCompress();
  for (int i = 0; i < 100; ++i) {
    const int w = i % 2 ? 500 : 375, h = i % 2 ? 375 : 500;
    std::vector<uint8_t> rgb(static_cast<size_t>(w) * h * 3);
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        for (int c = 0; c < 3; ++c) {
          const int smooth = (x + 2 * y + 50 * c + i) % 200;
          const int noise = static_cast<int>(rng() % 80) - 40;
          rgb[(static_cast<size_t>(y) * w + x) * 3 + c] =
              static_cast<uint8_t>(std::clamp(smooth + noise, 0, 255));
        }
      }
    }
    unsigned char* jpeg = nullptr;
    unsigned long size = 0;
    if (tjCompress2(tj, rgb.data(), w, 0, h, TJPF_RGB, &jpeg, &size, TJSAMP_420, 90, 0) != 0) {
      Die(tjGetErrorStr2(tj));
    }
    files.emplace_back(jpeg, jpeg + size);
    tjFree(jpeg);
  }
  tjDestroy(tj);
  return files;
}

std::vector<std::vector<uint8_t>> FolderFiles(const std::string& root, size_t limit) {
  absl::StatusOr<server::ImageFolderIndex> index = server::IndexImageFolder(root);
  if (!index.ok()) Die(index.status().ToString());
  if (index->paths.empty()) Die(absl::StrCat(root, ": no images"));
  const size_t n = std::min(limit, index->paths.size());
  std::vector<std::vector<uint8_t>> files;
  for (size_t i = 0; i < n; ++i) {
    std::ifstream in(index->paths[i * index->paths.size() / n], std::ios::binary);
    files.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return files;
}

// Milliseconds per call of `body(i)` over `count` items, `reps` times, after one warm pass;
// `before(i)`, untimed, runs before each.
double MsPerItem(size_t count, int reps, const std::function<void(size_t)>& body,
                 const std::function<void(size_t)>& before) {
  absl::Duration total;
  for (int r = -1; r < reps; ++r) {
    for (size_t i = 0; i < count; ++i) {
      before(i);
      const absl::Time start = absl::Now();
      body(i);
      if (r >= 0) total += absl::Now() - start;
    }
  }
  return absl::ToDoubleMilliseconds(total) / (static_cast<double>(count) * reps);
}

struct Row {
  std::string name;
  double reference_ms = 0, fast_ms = 0;
};

int Main() {
  const std::string data = absl::GetFlag(FLAGS_data);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const int size = absl::GetFlag(FLAGS_size);
  const std::vector<std::vector<uint8_t>> files =
      data.empty()
          ? GeneratedJpegs()
          : FolderFiles(data, static_cast<size_t>(std::max(1, absl::GetFlag(FLAGS_files))));
  size_t bytes = 0;
  for (const auto& f : files) bytes += f.size();

  std::vector<server::Image> images(files.size());
  auto decode = [&](size_t i) {
    absl::StatusOr<server::Image> image = server::DecodeImage(files[i]);
    if (!image.ok()) Die(image.status().ToString());
    images[i] = std::move(*image);
  };
  const double decode_ms = MsPerItem(files.size(), reps, decode, [](size_t) {});

  // Geometries as the daemon plans them: RandomResizedCrop(size) and a flip, or
  // Resize(size * 8 / 7) then CenterCrop(size).
  std::vector<server::StagedGeometry> train(images.size()), eval(images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    const server::Image& im = images[i];
    server::SampleRandom random(1, 0, i);
    const server::CropBox box = server::RandomResizedCropBox(im.height, im.width, {}, random);
    const bool flip = random.Uniform(0, 1) < 0.5;
    train[i] = {im.height, im.width, box.top, box.left, box.height, box.width, size, size};
    train[i].flip = flip;
    int rh = 0, rw = 0;
    server::ResizeShorterSide(im.height, im.width, size * 8 / 7, &rh, &rw);
    const server::CropBox window = server::CenterCropBox(rh, rw, size, size);
    eval[i] = {im.height, im.width, 0, 0, im.height, im.width, rh, rw, window.top, window.left, 0};
  }

  // The decode a random resized crop needs (gpufeedd's default, --region_decode): its crop
  // box only, the same pixels.
  auto region_decode = [&](size_t i) {
    const server::StagedGeometry& g = train[i];
    server::DecodeOptions options;
    options.region = {g.crop_top, g.crop_left, g.crop_height, g.crop_width};
    absl::StatusOr<server::Image> image = server::DecodeImage(files[i], options);
    if (!image.ok()) Die(image.status().ToString());
  };
  const double region_ms = MsPerItem(files.size(), reps, region_decode, [](size_t) {});

  server::OutputSpec f16;
  f16.dtype = DType::kFloat16;
  f16.normalize = true;
  const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
  std::copy(mean, mean + 3, f16.mean);
  std::copy(std, std + 3, f16.std);
  server::OutputSpec u8_nchw, u8_nhwc;
  u8_nhwc.layout = server::Layout::kNHWC;
  struct Config {
    std::string name;
    const std::vector<server::StagedGeometry>* geometry;
    server::OutputSpec spec;
  };
  const std::vector<Config> configs = {
      {absl::StrCat("RRC(", size, ") float16 NCHW normalised"), &train, f16},
      {absl::StrCat("RRC(", size, ") uint8 NCHW"), &train, u8_nchw},
      {absl::StrCat("RRC(", size, ") uint8 NHWC"), &train, u8_nhwc},
      {absl::StrCat("Resize(", size * 8 / 7, ")+CenterCrop(", size, ") float16 NCHW normalised"),
       &eval, f16},
  };

  std::vector<float> resized, window;
  std::vector<std::byte> out(server::OutputBytes(f16, size, size) * 2);
  std::vector<Row> rows;
  for (const Config& config : configs) {
    const auto& geometry = *config.geometry;
    Row row{config.name};
    // The reference: what Augment() did before FastAugment (ResizedCrop, the window, WriteImage).
    auto reference = [&](size_t i) {
      const server::StagedGeometry& g = geometry[i];
      resized.resize(static_cast<size_t>(g.resize_height) * g.resize_width * 3);
      server::ResizedCrop(images[i], {g.crop_top, g.crop_left, g.crop_height, g.crop_width},
                          g.resize_height, g.resize_width, g.flip != 0, resized.data());
      const float* pixels = resized.data();
      if (g.resize_height != size || g.resize_width != size) {
        window.assign(static_cast<size_t>(size) * size * 3, 0.0f);
        for (int y = 0; y < size; ++y) {
          const int ry = y + g.window_top;
          if (ry < 0 || ry >= g.resize_height) continue;
          for (int x = 0; x < size; ++x) {
            const int rx = x + g.window_left;
            if (rx < 0 || rx >= g.resize_width) continue;
            std::copy_n(&resized[(static_cast<size_t>(ry) * g.resize_width + rx) * 3], 3,
                        &window[(static_cast<size_t>(y) * size + x) * 3]);
          }
        }
        pixels = window.data();
      }
      server::WriteImage(pixels, size, size, config.spec, out.data());
    };
    auto fast = [&](size_t i) {
      server::FastAugment(images[i], geometry[i], size, size, config.spec, out.data());
    };
    row.reference_ms = MsPerItem(images.size(), reps, reference, decode);
    row.fast_ms = MsPerItem(images.size(), reps, fast, decode);
    rows.push_back(row);
  }

  const char* target = hwy::TargetName(hwy::SupportedAndGeneratedTargets().front());
  std::printf("%zu images (%s, mean %zu KB), one core, SIMD target %s: decode %.3f ms/image\n\n",
              files.size(), data.empty() ? "generated" : data.c_str(), bytes / files.size() / 1024,
              target, decode_ms);
  std::printf(
      "RandomResizedCrop(%d)'s crop box only (region decode): %.3f ms/image, %.0f %% of "
      "the whole decode; with the fast augment below: %.2f of the whole decode's rate\n\n",
      size, region_ms, 100 * region_ms / decode_ms, decode_ms / (region_ms + rows[0].fast_ms));
  std::printf(
      "| augment | reference ms | fast ms | speed-up | decode share, reference | "
      "decode share, fast |\n|---|---|---|---|---|---|\n");
  std::string json = absl::StrFormat(
      "{\"tool\":\"cpu_augment_bench\",\"images\":%zu,\"target\":\"%s\",\"decode_ms\":%.4f,"
      "\"region_decode_ms\":%.4f,\"rows\":[",
      files.size(), target, decode_ms, region_ms);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double share_ref = decode_ms / (decode_ms + r.reference_ms);
    const double share_fast = decode_ms / (decode_ms + r.fast_ms);
    std::printf("| %s | %.3f | %.3f | %.1fx | %.2f | %.2f |\n", r.name.c_str(), r.reference_ms,
                r.fast_ms, r.reference_ms / r.fast_ms, share_ref, share_fast);
    absl::StrAppendFormat(&json,
                          "%s{\"augment\":\"%s\",\"reference_ms\":%.4f,\"fast_ms\":%.4f,"
                          "\"decode_share_reference\":%.3f,\"decode_share_fast\":%.3f}",
                          i ? "," : "", r.name, r.reference_ms, r.fast_ms, share_ref, share_fast);
  }
  std::printf("\n%s]}\n", json.c_str());
  return 0;
}

}  // namespace
}  // namespace gpufeed

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return gpufeed::Main();
}
