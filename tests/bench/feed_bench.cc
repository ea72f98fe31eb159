// gpufeed throughput benchmark on this machine (CPU, host delivery).
//
//   feed_bench [--quick]
//
// Prints a table and one JSON line:
//  (a) memcpy bandwidth for one batch-sized copy from a 256 MiB source (the limit: one copy
//      from the page cache into the staging slot is all the work there is), and the same
//      bytes gathered as the batch's B rows from random samples of the mapped dataset file
//      (the very copy gpufeedd makes: a row is seq_len+1 tokens at a random offset);
//  (b) bytes/s and batches/s delivered to 1 and to 2 consumer processes (gpufeedctl consume,
//      ranks of one job) for tokens B=64, seq_len=2048 and B=256, seq_len=128, uint16, with
//      each read mode of the daemon (mmap, pread);
//  (c) time from Attach to the first batch on a warm file (median of 9);
//  (d) the same tokens as 64 raw shards in a directory (sharded datasets within
//      10 % of one file): one consumer's rate per case and Attach -> first batch, mmap reads.
// Not a timed test: CI does not gate on it.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "tests/integration/harness.h"

namespace gt = gpufeed::testing;

namespace {

struct Case {
  std::string name;
  int64_t batch;
  int64_t seq_len;
};

double MemcpyBandwidth(size_t batch_bytes, double seconds) {
  const size_t source_bytes = size_t{256} << 20;
  std::vector<char> source(source_bytes, 1);
  std::vector<char> ring(batch_bytes * 4, 0);
  for (size_t i = 0; i < source_bytes; i += 4096) source[i] = static_cast<char>(i);
  size_t offset = 0, copies = 0, slot = 0;
  const absl::Time start = absl::Now();
  absl::Duration elapsed;
  do {
    for (int i = 0; i < 64; ++i) {
      if (offset + batch_bytes > source_bytes) offset = 0;
      std::memcpy(ring.data() + slot * batch_bytes, source.data() + offset, batch_bytes);
      offset += batch_bytes;
      slot = (slot + 1) % 4;
      ++copies;
    }
    elapsed = absl::Now() - start;
  } while (elapsed < absl::Seconds(seconds));
  volatile char sink = ring[batch_bytes / 2];
  (void)sink;
  return static_cast<double>(copies * batch_bytes) / absl::ToDoubleSeconds(elapsed);
}

// Copies B random rows of (seq_len + 1) tokens from a mapping of the dataset into a ring of
// batch buffers, as the readers do.
double GatherBandwidth(const std::string& dataset, size_t file_bytes, const Case& c,
                       double seconds) {
  const int fd = ::open(dataset.c_str(), O_RDONLY);
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  const auto* src = static_cast<const char*>(map);
  const size_t row = static_cast<size_t>(c.seq_len + 1) * 2;
  const size_t samples = (file_bytes / 2 - 1) / static_cast<size_t>(c.seq_len);
  const size_t batch_bytes = row * static_cast<size_t>(c.batch);
  std::vector<char> ring(batch_bytes * 4);
  uint64_t state = 12345, copies = 0;
  size_t slot = 0;
  const absl::Time start = absl::Now();
  absl::Duration elapsed;
  do {
    for (int b = 0; b < 16; ++b) {
      char* dst = ring.data() + slot * batch_bytes;
      for (int64_t r = 0; r < c.batch; ++r) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        const size_t id = (state >> 33) % samples;
        std::memcpy(dst + static_cast<size_t>(r) * row, src + id * static_cast<size_t>(c.seq_len) * 2, row);
      }
      slot = (slot + 1) % 4;
      ++copies;
    }
    elapsed = absl::Now() - start;
  } while (elapsed < absl::Seconds(seconds));
  ::munmap(map, file_bytes);
  return static_cast<double>(copies * batch_bytes) / absl::ToDoubleSeconds(elapsed);
}

struct Run {
  double bytes_per_s = 0;
  double batches_per_s = 0;
  bool ok = true;
  std::string error;
};

Run Consume(const std::string& socket, const std::string& dataset, const Case& c, int consumers,
            int64_t max_batches, const gt::TempDir& dir) {
  std::vector<std::unique_ptr<gt::Subprocess>> procs;
  static int job = 0;
  const std::string name = absl::StrCat("bench", job++);
  for (int r = 0; r < consumers; ++r) {
    procs.push_back(std::make_unique<gt::Subprocess>(
        gt::CtlArgv(socket, {"consume", "--job", name, "--rank", absl::StrCat(r), "--world-size",
                             absl::StrCat(consumers), "--dataset", dataset, "--seq-len",
                             absl::StrCat(c.seq_len), "--batch-size", absl::StrCat(c.batch),
                             "--epochs", "0", "--max-batches", absl::StrCat(max_batches), "-o",
                             "json"}),
        dir.Join(absl::StrCat(name, "-", r))));
  }
  Run run;
  for (auto& p : procs) {
    if (p->Wait(absl::Seconds(300)) != 0) {
      run.ok = false;
      run.error = p->Stderr();
      continue;
    }
    const std::string out = p->Stdout();
    // Rates of concurrent consumers add up.
    const size_t b = out.find("\"bytes_per_s\":");
    const size_t n = out.find("\"batches_per_s\":");
    run.bytes_per_s += std::stod(out.substr(b + 14));
    run.batches_per_s += std::stod(out.substr(n + 16));
  }
  return run;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  gt::TempDir dir;
  const std::string dataset = dir.Join("tokens.bin");
  const size_t tokens = quick ? (size_t{8} << 20) : (size_t{64} << 20);  // 16 or 128 MiB
  std::fprintf(stderr, "writing %zu MiB of tokens...\n", tokens * 2 >> 20);
  gt::WriteTokens(dataset, tokens);
  std::vector<std::unique_ptr<gt::Daemon>> daemons;
  for (const char* mode : {"mmap", "pread"}) {
    gt::TempDir* sub = new gt::TempDir();  // one socket directory per daemon; lives to exit
    daemons.push_back(std::make_unique<gt::Daemon>(
        *sub, std::vector<std::string>{"--staging_bytes=268435456", absl::StrCat("--read_mode=", mode)}));
    if (!daemons.back()->ready()) {
      std::fprintf(stderr, "gpufeedd did not start: %s\n", daemons.back()->process().Stderr().c_str());
      return 1;
    }
  }
  const gt::Daemon& daemon = *daemons[0];
  // Warm the page cache: one full pass over the file.
  gt::RunCtl(daemon.socket(), {"consume", "--job", "warm", "--dataset", dataset, "--seq-len",
                               "2048", "--batch-size", "64", "--no-shuffle"},
             dir.Join("warm"));

  const std::vector<Case> cases = {{"B=64 seq_len=2048", 64, 2048}, {"B=256 seq_len=128", 256, 128}};
  std::vector<std::string> rows;
  std::string json = "{\"bench\":\"feed_bench\",\"cases\":[";
  bool all_ok = true;
  bool first_row = true;
  for (const Case& c : cases) {
    const size_t batch_bytes = static_cast<size_t>(c.batch * (c.seq_len + 1) * 2);
    std::fprintf(stderr, "%s: memcpy...\n", c.name.c_str());
    const double limit = MemcpyBandwidth(batch_bytes, quick ? 0.3 : 1.5);
    const double gather = GatherBandwidth(dataset, tokens * 2, c, quick ? 0.3 : 1.5);
    const int64_t n = quick ? 2000 : (batch_bytes > (1 << 20 >> 2) ? 30000 : 40000);
    for (size_t m = 0; m < daemons.size(); ++m) {
      const char* mode = m == 0 ? "mmap" : "pread";
      std::fprintf(stderr, "%s, %s reads: 1 consumer...\n", c.name.c_str(), mode);
      Run one = Consume(daemons[m]->socket(), dataset, c, 1, n, dir);
      std::fprintf(stderr, "%s, %s reads: 2 consumers...\n", c.name.c_str(), mode);
      Run two = Consume(daemons[m]->socket(), dataset, c, 2, n / 2, dir);
      if (!one.ok || !two.ok) {
        std::fprintf(stderr, "consumer failed: %s%s\n", one.error.c_str(), two.error.c_str());
        all_ok = false;
      }
      const double best = std::max(one.bytes_per_s, two.bytes_per_s);
      rows.push_back(absl::StrFormat(
          "| %-18s | %-5s | %8zu | %6.2f | %6.2f | %6.2f | %7.0f | %6.2f | %7.0f | %4.0f%% | %4.0f%% |",
          c.name, mode, batch_bytes, limit / 1e9, gather / 1e9, one.bytes_per_s / 1e9,
          one.batches_per_s, two.bytes_per_s / 1e9, two.batches_per_s, 100.0 * best / limit,
          100.0 * best / gather));
      absl::StrAppend(&json, first_row ? "" : ",",
                      absl::StrFormat("{\"case\":\"%s\",\"read_mode\":\"%s\",\"batch_bytes\":%zu,"
                                      "\"memcpy_bytes_per_s\":%.0f,\"gather_bytes_per_s\":%.0f,"
                                      "\"one_bytes_per_s\":%.0f,\"one_batches_per_s\":%.1f,"
                                      "\"two_bytes_per_s\":%.0f,\"two_batches_per_s\":%.1f}",
                                      c.name, mode, batch_bytes, limit, gather, one.bytes_per_s,
                                      one.batches_per_s, two.bytes_per_s, two.batches_per_s));
      first_row = false;
    }
  }

  // (c) Attach -> first batch, warm file: median of 9 fresh consumers.
  std::vector<double> first_ms;
  for (int i = 0; i < 9; ++i) {
    gt::CtlResult r = gt::RunCtl(daemon.socket(),
                                 {"consume", "--job", absl::StrCat("first", i), "--dataset", dataset,
                                  "--seq-len", "2048", "--batch-size", "64", "--max-batches", "1",
                                  "-o", "json"},
                                 dir.Join("first"));
    const size_t at = r.out.find("\"first_batch_ms\":");
    if (r.exit_code == 0 && at != std::string::npos) first_ms.push_back(std::stod(r.out.substr(at + 17)));
  }
  std::sort(first_ms.begin(), first_ms.end());
  const double median = first_ms.empty() ? -1 : first_ms[first_ms.size() / 2];

  // (d) 64 shards of the same bytes (a shard boundary costs at most one window each).
  const std::string shards = dir.Join("shards");
  std::filesystem::create_directories(shards);
  {
    std::ifstream in(dataset, std::ios::binary);
    std::vector<char> part(tokens * 2 / 64);
    for (int k = 0; k < 64; ++k) {
      in.read(part.data(), static_cast<std::streamsize>(part.size()));
      std::ofstream(absl::StrFormat("%s/train_%03d.bin", shards, k), std::ios::binary)
          .write(part.data(), static_cast<std::streamsize>(part.size()));
    }
  }
  std::vector<std::string> shard_rows;
  std::string shards_json = ",\"shards\":[";
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const int64_t n = quick ? 2000 : 20000;
    std::fprintf(stderr, "%s: one file vs 64 shards...\n", c.name.c_str());
    const Run file = Consume(daemon.socket(), dataset, c, 1, n, dir);
    const Run sharded = Consume(daemon.socket(), shards, c, 1, n, dir);
    all_ok = all_ok && file.ok && sharded.ok;
    shard_rows.push_back(absl::StrFormat("| %-18s | %7.2f | %7.0f | %7.2f | %7.0f | %5.1f%% |",
                                         c.name, file.bytes_per_s / 1e9, file.batches_per_s,
                                         sharded.bytes_per_s / 1e9, sharded.batches_per_s,
                                         100.0 * sharded.bytes_per_s / file.bytes_per_s));
    absl::StrAppend(&shards_json, i == 0 ? "" : ",",
                    absl::StrFormat("{\"case\":\"%s\",\"file_bytes_per_s\":%.0f,"
                                    "\"shards_bytes_per_s\":%.0f}",
                                    c.name, file.bytes_per_s, sharded.bytes_per_s));
  }
  std::vector<double> shard_first_ms;
  for (int i = 0; i < 9; ++i) {
    gt::CtlResult r =
        gt::RunCtl(daemon.socket(),
                   {"consume", "--job", absl::StrCat("sfirst", i), "--dataset", shards, "--seq-len",
                    "2048", "--batch-size", "64", "--max-batches", "1", "-o", "json"},
                   dir.Join("sfirst"));
    const size_t at = r.out.find("\"first_batch_ms\":");
    if (r.exit_code == 0 && at != std::string::npos) {
      shard_first_ms.push_back(std::stod(r.out.substr(at + 17)));
    }
  }
  std::sort(shard_first_ms.begin(), shard_first_ms.end());
  const double shard_median =
      shard_first_ms.empty() ? -1 : shard_first_ms[shard_first_ms.size() / 2];
  absl::StrAppend(&shards_json,
                  "],\"shards_first_batch_ms_median\":", absl::StrFormat("%.3f", shard_median));

  std::printf("\ngpufeed feed_bench (host delivery, tokens uint16, %d cores)\n\n",
              static_cast<int>(std::thread::hardware_concurrency()));
  std::printf("(a) memcpy: one batch-sized contiguous copy; gather: the batch's rows copied from\n"
              "random samples of the mapped file. (b) GB/s and batches/s summed over consumers.\n\n");
  std::printf("| case               | reads | batch B  | memcpy | gather | 1 cons  | batch/s | 2 cons | batch/s | best/memcpy | best/gather |\n");
  std::printf("|--------------------|-------|----------|--------|--------|---------|---------|--------|---------|------|------|\n");
  for (const auto& row : rows) std::printf("%s\n", row.c_str());
  std::printf("\nAttach -> first batch (B=64 seq_len=2048, warm file, median of %zu): %.2f ms\n\n",
              first_ms.size(), median);
  std::printf(
      "(d) the same tokens in one file and as 64 raw shards (a directory), 1 consumer, mmap\n\n");
  std::printf(
      "| case               | file GB/s | batch/s | shards GB/s | batch/s | shards/file |\n");
  std::printf("|--------------------|---------|---------|---------|---------|--------|\n");
  for (const auto& row : shard_rows) std::printf("%s\n", row.c_str());
  std::printf("\nAttach -> first batch, 64 shards (median of %zu): %.2f ms\n\n",
              shard_first_ms.size(), shard_median);
  absl::StrAppend(&json, "],\"first_batch_ms_median\":", absl::StrFormat("%.3f", median),
                  shards_json, "}");
  std::printf("%s\n", json.c_str());
  return all_ok ? 0 : 1;
}
