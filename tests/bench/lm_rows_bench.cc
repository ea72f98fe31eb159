// The token dataset's own rows/s by fill threads: the plain windows, a blend of windows, and
// a blend packed best_fit and concat, read as the feed reads them (each thread takes the next
// batch of B consecutive stream rows and reads its rows into a slot of its own), with no
// daemon, socket or consumer in the way. What it shows is whether a dataset's row path scales
// with the daemon's --threads: a lock held while groups are packed would flatten the packed
// rows where the plain ones grow.
//
//   lm_rows_bench [--threads 1,2,4] [--seconds 2] [--batch 16] [--seq-len 2048] [--case NAME]
//
// The data: three uint16 sources (0.5/0.3/0.2) of documents with log-normal lengths (median
// 400 tokens, sigma 1.3, as pack_bench and blend_bench), each ending in an eos token, 32 Mi
// tokens in all, in a temporary directory (the page cache after the first pass). Prints a
// table (rows/s by threads, and each feed against the plain one at the same threads) and one
// JSON line. Not a timed test: CI does not gate on it.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/feed/feed.h"
#include "server/feed/lm_dataset.h"

namespace {

namespace fs = std::filesystem;
using gpufeed::DType;
using gpufeed::server::Dataset;
using gpufeed::server::DatasetKind;
using gpufeed::server::DatasetSpec;
using gpufeed::server::LmDataset;
using gpufeed::server::LmSpec;
using gpufeed::server::PackMode;
using gpufeed::server::SampleContext;

constexpr uint16_t kEos = 50256;

void WriteSource(const fs::path& path, uint64_t tokens, std::mt19937_64& random) {
  std::lognormal_distribution<double> length(std::log(400.0), 1.3);
  std::uniform_int_distribution<uint16_t> token(0, kEos - 1);
  std::vector<uint16_t> out;
  out.reserve(tokens);
  while (out.size() < tokens) {
    const uint64_t n = std::clamp<uint64_t>(static_cast<uint64_t>(length(random)), 2, 200000);
    for (uint64_t i = 0; i + 1 < n && out.size() < tokens; ++i) out.push_back(token(random));
    if (out.size() < tokens) out.push_back(kEos);
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()),
             static_cast<std::streamsize>(out.size() * 2));
}

// Rows/s of `threads` threads each reading whole batches of consecutive rows, for `seconds`.
double Measure(const Dataset& d, int threads, double seconds, uint64_t batch) {
  std::vector<size_t> row_bytes;
  size_t slot_bytes = 0;
  for (const auto& t : d.tensors()) {
    row_bytes.push_back(t.byte_size);
    slot_bytes += t.byte_size * batch;
  }
  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  const uint64_t rows = d.num_samples();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      std::vector<std::byte> slot(slot_bytes);
      std::vector<std::span<std::byte>> spans(row_bytes.size());
      while (!stop.load(std::memory_order_relaxed)) {
        const uint64_t b = next.fetch_add(1);
        for (uint64_t i = 0; i < batch; ++i) {
          const uint64_t row = b * batch + i;
          std::byte* at = slot.data();
          for (size_t k = 0; k < spans.size(); ++k) {
            spans[k] = std::span<std::byte>(at + i * row_bytes[k], row_bytes[k]);
            at += row_bytes[k] * batch;
          }
          const SampleContext context{7, static_cast<int64_t>(row / rows)};
          if (!d.ReadSampleAt(row % rows, context, spans).ok()) failed = true;
        }
      }
    });
  }
  // Warm: the first batches pack the first groups and fill the first picks.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const uint64_t start_batches = next.load();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const uint64_t done = next.load() - start_batches;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop = true;
  for (auto& t : pool) t.join();
  if (failed) {
    std::fprintf(stderr, "lm_rows_bench: a read failed\n");
    std::exit(1);
  }
  return static_cast<double>(done * batch) / elapsed;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2, 4};
  double seconds = 2;
  uint64_t batch = 16;
  int64_t seq_len = 2048;
  std::string only;    // --case best_fit: that case (and the plain one, the reference) only
  bool alone = false;  // --alone 1: no plain case (to profile one case)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--threads") {
      threads.clear();
      for (absl::string_view s : absl::StrSplit(value, ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(s, &n) || n < 1) {
          std::fprintf(stderr, "--threads: %s is no count\n", std::string(s).c_str());
          return 2;
        }
        threads.push_back(n);
      }
    } else if (flag == "--case") {
      only = value;
    } else if (flag == "--alone") {
      alone = value == "1";
    } else if (flag == "--seconds") {
      seconds = std::atof(value.c_str());
    } else if (flag == "--batch") {
      batch = std::strtoull(value.c_str(), nullptr, 10);
    } else if (flag == "--seq-len") {
      seq_len = std::strtoll(value.c_str(), nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: lm_rows_bench [--threads 1,2,4] [--seconds 2] [--batch 16] "
                   "[--seq-len 2048] [--case NAME]\n");
      return 2;
    }
  }
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("lm_rows_bench.", getpid());
  fs::create_directories(dir);
  std::mt19937_64 random(1);
  const uint64_t total = uint64_t{32} << 20;
  const double weights[] = {0.5, 0.3, 0.2};
  LmSpec blend;
  for (int k = 0; k < 3; ++k) {
    const fs::path p = dir / absl::StrCat("s", k, ".bin");
    WriteSource(p, static_cast<uint64_t>(total * weights[k]), random);
    blend.sources.push_back({{p.string()}, weights[k], absl::StrCat("s", k)});
  }
  DatasetSpec spec;
  spec.kind = DatasetKind::kTokens;
  spec.path = dir.string();
  spec.token_dtype = DType::kUInt16;
  spec.seq_len = seq_len;

  // Each (case, threads) measure opens its dataset anew: a packed one's groups, picks and
  // ahead workers start from the stream's start, as a new feed's do.
  using Opener = std::function<absl::StatusOr<std::unique_ptr<Dataset>>()>;
  struct Case {
    std::string name;
    Opener open;
  };
  std::vector<Case> cases;
  auto add = [&](const std::string& name, Opener open) {
    // The plain feed first, always: every other is shown against it (unless --case X --alone).
    if ((cases.empty() && !alone) || only.empty() || name.find(only) != std::string::npos) {
      cases.push_back({name, std::move(open)});
    }
  };
  add("plain token feed (windows)",
      [&] { return gpufeed::server::OpenDataset(spec, gpufeed::MappedFileSystem()); });
  auto lm = [&](PackMode pack) -> Opener {
    return [&, pack]() -> absl::StatusOr<std::unique_ptr<Dataset>> {
      LmSpec l = blend;
      l.pack = pack;
      if (pack != PackMode::kNone) l.eos_id = kEos;
      auto d = LmDataset::Open(spec, l, 7, true, gpufeed::MappedFileSystem());
      if (!d.ok()) return d.status();
      return std::unique_ptr<Dataset>(std::move(*d));
    };
  };
  add("blend, windows", lm(PackMode::kNone));
  add("blend, best_fit packed", lm(PackMode::kBestFit));
  add("blend, concat packed", lm(PackMode::kConcat));

  std::printf("lm_rows_bench: %d hardware threads, B=%lu, seq_len %ld, %.1f s a case\n",
              static_cast<int>(std::thread::hardware_concurrency()), batch, seq_len, seconds);
  std::printf("%-28s", "rows/s by threads");
  for (int t : threads) std::printf(" %12d %6s", t, "vs");
  std::printf("\n");
  std::vector<std::vector<double>> rates(cases.size());
  std::string json =
      absl::StrFormat("{\"bench\":\"lm_rows\",\"batch\":%d,\"seq_len\":%d", batch, seq_len);
  for (size_t c = 0; c < cases.size(); ++c) {
    std::printf("%-28s", cases[c].name.c_str());
    for (size_t i = 0; i < threads.size(); ++i) {
      absl::StatusOr<std::unique_ptr<Dataset>> d = cases[c].open();
      if (!d.ok()) {
        std::fprintf(stderr, "%s: %s\n", cases[c].name.c_str(),
                     std::string(d.status().message()).c_str());
        return 1;
      }
      rates[c].push_back(Measure(**d, threads[i], seconds, batch));
      std::printf(" %12.0f %5.0f%%", rates[c][i],
                  100 * rates[c][i] / rates[0][i] /* the first case's */);
      std::fflush(stdout);
    }
    std::printf("\n");
    absl::StrAppend(&json, ",\"case", c, "\":{\"name\":\"", cases[c].name, "\"");
    for (size_t i = 0; i < threads.size(); ++i) {
      absl::StrAppend(&json, absl::StrFormat(",\"threads_%d\":%.0f", threads[i], rates[c][i]));
    }
    absl::StrAppend(&json, "}");
  }
  std::printf("%s}\n", json.c_str());
  fs::remove_all(dir);
  return 0;
}
