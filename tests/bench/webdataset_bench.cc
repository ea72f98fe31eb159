// WebDataset shards against an ImageFolder of the same images, in process, CPU:
//   webdataset_bench [--images N] [--shards S] [--per-shard M]
// Prints a table and one JSON line:
//  (a) the same N JPEGs (160 x 120, 10 classes) as an ImageFolder and as 8 tar shards:
//      Attach-time open (walk / index) and samples/s decoded + augmented on the CPU
//      (RandomResizedCrop 112 + flip, uint8 NCHW) by 2 threads in a random order, 2 passes;
//  (b) indexing at Attach: S shards of M samples each (a .cls and a small .jpg per key).
// The dataset path only (ReadSampleAt, what a fill worker runs per row): no daemon, no ring.
// Not a timed test: CI does not gate on it.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/images/dataset.h"
#include "tests/testing/image_files.h"
#include "tests/testing/tar_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

DatasetSpec Spec(DatasetKind kind, const std::string& path) {
  DatasetSpec spec;
  spec.kind = kind;
  spec.path = path;
  spec.pipeline = {RandomResizedCropStep{112, {}}, FlipStep{0.5}};
  return spec;
}

// Samples/s of ReadSampleAt over `passes` random orders of every sample, on `threads` threads.
double Rate(const Dataset& ds, int threads, int passes) {
  const uint64_t n = ds.num_samples();
  std::vector<uint64_t> order(n);
  for (uint64_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937_64 rng(1);
  const auto start = Clock::now();
  for (int pass = 0; pass < passes; ++pass) {
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::vector<std::byte> image(ds.tensors()[0].byte_size);
        int64_t label;
        std::vector<std::span<std::byte>> rows = {
            std::span<std::byte>(image),
            std::span<std::byte>(reinterpret_cast<std::byte*>(&label), 8)};
        for (uint64_t i = static_cast<uint64_t>(t); i < n; i += static_cast<uint64_t>(threads)) {
          if (!ds.ReadSampleAt(order[i], {7, pass}, rows).ok()) std::abort();
        }
      });
    }
    for (std::thread& t : pool) t.join();
  }
  return static_cast<double>(n) * passes / Seconds(start);
}

int Main(int argc, char** argv) {
  int images = 2000, shards = 1000, per_shard = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (flag == "--images") images = v;
    if (flag == "--shards") shards = v;
    if (flag == "--per-shard") per_shard = v;
  }
  testing::TempDir dir;
  // (a) the same images both ways.
  std::fprintf(stderr, "writing %d images as a folder and as 8 shards...\n", images);
  std::vector<std::string> tars(8);
  for (int i = 0; i < images; ++i) {
    const std::vector<uint8_t> jpeg =
        testing::EncodeJpeg(testing::Picture(120, 160, 3, i), 120, 160, TJPF_RGB, TJSAMP_420, 90);
    const int label = i * 10 / images;  // rising with the id: the folder's order is the tars'
    testing::WriteFileBytes(absl::StrFormat("%s/folder/c%d/%06d.jpg", dir.path(), label, i), jpeg);
    std::string& tar = tars[static_cast<size_t>(i) * 8 / images];
    const std::string key = absl::StrFormat("s%06d", i);
    tar += testing::TarFile(key + ".cls", absl::StrCat(label)) +
           testing::TarFile(key + ".jpg", std::string(jpeg.begin(), jpeg.end()));
  }
  std::filesystem::create_directories(dir.Join("wds"));
  for (int k = 0; k < 8; ++k) {
    dir.WriteFile(absl::StrFormat("wds/train-%02d.tar", k), tars[k] + testing::TarEnd());
  }
  auto t0 = Clock::now();
  auto folder = OpenDataset(Spec(DatasetKind::kImageFolder, dir.Join("folder")), PosixFileSystem());
  const double folder_open = Seconds(t0);
  t0 = Clock::now();
  auto wds = OpenDataset(Spec(DatasetKind::kWebDataset, dir.Join("wds/train-{00..07}.tar")),
                         PosixFileSystem());
  const double wds_open = Seconds(t0);
  if (!folder.ok() || !wds.ok()) {
    std::fprintf(stderr, "open: %s / %s\n", folder.status().ToString().c_str(),
                 wds.status().ToString().c_str());
    return 1;
  }
  std::fprintf(stderr, "decoding...\n");
  Rate(**folder, 2, 1);  // warm the page cache and the decoder
  const double folder_rate = Rate(**folder, 2, 2);
  const double wds_rate = Rate(**wds, 2, 2);

  // (b) indexing many shards.
  std::fprintf(stderr, "writing %d shards of %d samples...\n", shards, per_shard);
  const std::vector<uint8_t> tiny =
      testing::EncodeJpeg(testing::Picture(8, 8, 3, 0), 8, 8, TJPF_RGB, TJSAMP_420, 90);
  std::string shard;
  for (int j = 0; j < per_shard; ++j) {
    const std::string key = absl::StrFormat("sample%06d", j);
    shard += testing::TarFile(key + ".cls", absl::StrCat(j % 1000)) +
             testing::TarFile(key + ".jpg", std::string(tiny.begin(), tiny.end()));
  }
  shard += testing::TarEnd();
  std::filesystem::create_directories(dir.Join("many"));
  for (int k = 0; k < shards; ++k) dir.WriteFile(absl::StrFormat("many/train-%06d.tar", k), shard);
  DatasetSpec many = Spec(DatasetKind::kWebDataset,
                          dir.Join(absl::StrFormat("many/train-{000000..%06d}.tar", shards - 1)));
  std::vector<double> index_s;
  for (int r = 0; r < 3; ++r) {
    t0 = Clock::now();
    auto ds = OpenDataset(many, PosixFileSystem());
    index_s.push_back(Seconds(t0));
    if (!ds.ok()) {
      std::fprintf(stderr, "indexing: %s\n", ds.status().ToString().c_str());
      return 1;
    }
  }
  std::sort(index_s.begin(), index_s.end());
  const double samples = static_cast<double>(shards) * per_shard;
  const double bytes = static_cast<double>(shard.size()) * shards;

  std::printf("\ngpufeed webdataset_bench (CPU, in process, %u cores)\n\n",
              std::thread::hardware_concurrency());
  std::printf("(a) %d JPEGs 160x120, RandomResizedCrop 112 + flip, 2 threads, random order\n\n",
              images);
  std::printf("| form | open (walk / index) ms | samples/s | vs folder |\n|---|---|---|---|\n");
  std::printf("| image_folder | %.1f | %.0f | 1.00 |\n", folder_open * 1e3, folder_rate);
  std::printf("| webdataset, 8 shards | %.1f | %.0f | %.2f |\n\n", wds_open * 1e3, wds_rate,
              wds_rate / folder_rate);
  std::printf("(b) indexing %d shards x %d samples (%.0f MiB, warm page cache), median of 3\n\n",
              shards, per_shard, bytes / (1 << 20));
  std::printf("| shards | samples | index s | us/sample |\n|---|---|---|---|\n");
  std::printf("| %d | %.0f | %.3f | %.2f |\n\n", shards, samples, index_s[1],
              index_s[1] / samples * 1e6);
  std::printf(
      "{\"bench\":\"webdataset_bench\",\"images\":%d,\"folder_open_ms\":%.3f,"
      "\"webdataset_open_ms\":%.3f,\"folder_samples_per_s\":%.0f,"
      "\"webdataset_samples_per_s\":%.0f,\"index_shards\":%d,\"index_samples\":%.0f,"
      "\"index_s_median\":%.4f}\n",
      images, folder_open * 1e3, wds_open * 1e3, folder_rate, wds_rate, shards, samples,
      index_s[1]);
  return 0;
}

}  // namespace
}  // namespace gpufeed::server

int main(int argc, char** argv) { return gpufeed::server::Main(argc, argv); }
