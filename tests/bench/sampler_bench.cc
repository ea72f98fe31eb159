// Sampler throughput: sample ids per second for one epoch of N = 1,000,000 samples.
//
//   sampler_bench [N]
//
// Prints a table and one JSON line comparing
//  (a) the former order: SplitMix64 + Fisher-Yates materialised per epoch (8 bytes
//      of memory per sample), then read back position by position, copied here as it was;
//  (b) EpochOrder ("feistel1"): each position on its own, O(1) memory, through
//      Sampler::RankSlice in batches of 256 as the fill workers ask for them.
// Not a timed test: CI does not gate on it.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <span>
#include <vector>

#include "absl/strings/str_format.h"
#include "server/sampler/sampler.h"

namespace {

using gpufeed::server::EpochOrder;
using gpufeed::server::Position;
using gpufeed::server::Sampler;
using gpufeed::server::SamplerConfig;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t Bounded(uint64_t& state, uint64_t bound) {
  __uint128_t m = static_cast<__uint128_t>(SplitMix64(state)) * bound;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = static_cast<__uint128_t>(SplitMix64(state)) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

std::vector<uint64_t> FisherYates(uint64_t n, uint64_t seed, int64_t epoch) {
  std::vector<uint64_t> perm(n);
  std::iota(perm.begin(), perm.end(), uint64_t{0});
  uint64_t state = seed;
  state = SplitMix64(state) ^ static_cast<uint64_t>(epoch);
  SplitMix64(state);
  for (uint64_t i = n - 1; i > 0; --i) std::swap(perm[i], perm[Bounded(state, i + 1)]);
  return perm;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'000;
  const int kEpochs = 5;
  const int64_t kBatch = 256;
  uint64_t sink = 0;

  auto t0 = std::chrono::steady_clock::now();
  for (int64_t e = 0; e < kEpochs; ++e) {
    const std::vector<uint64_t> perm = FisherYates(n, 42, e);
    for (uint64_t i = 0; i < n; ++i) sink += perm[i];
  }
  const double old_rate = static_cast<double>(n) * kEpochs / Seconds(t0);

  t0 = std::chrono::steady_clock::now();
  for (int64_t e = 0; e < kEpochs; ++e) {
    const EpochOrder order(n, 42, e, true);
    for (uint64_t i = 0; i < n; ++i) sink += order.At(i);
  }
  const double order_rate = static_cast<double>(n) * kEpochs / Seconds(t0);

  SamplerConfig config{n, kBatch, 1, 42, true, true};
  std::unique_ptr<Sampler> sampler = std::move(*Sampler::Create(config));
  std::vector<int64_t> ids(static_cast<size_t>(kBatch));
  t0 = std::chrono::steady_clock::now();
  for (int64_t e = 0; e < kEpochs; ++e) {
    for (int64_t s = 0; s < sampler->steps_per_epoch(); ++s) {
      sampler->RankSlice(Position{e, s}, 0, std::span<int64_t>(ids));
      sink += static_cast<uint64_t>(ids[0]);
    }
  }
  const double slice_rate = static_cast<double>(sampler->steps_per_epoch()) * kBatch * kEpochs /
                            Seconds(t0);

  absl::PrintF("sampler_bench: N=%d, %d epochs (checksum %d)\n", n, kEpochs, sink % 1000);
  absl::PrintF("%-44s %14s %14s\n", "order", "M ids/s", "bytes/sample");
  absl::PrintF("%-44s %14.1f %14d\n", "fisher-yates (before), materialised", old_rate / 1e6, 8);
  absl::PrintF("%-44s %14.1f %14d\n", "feistel1 EpochOrder::At", order_rate / 1e6, 0);
  absl::PrintF("%-44s %14.1f %14d\n", "feistel1 Sampler::RankSlice (B=256)", slice_rate / 1e6, 0);
  absl::PrintF(
      "{\"bench\":\"sampler\",\"n\":%d,\"fisher_yates_ids_per_s\":%.0f,"
      "\"feistel1_ids_per_s\":%.0f,\"feistel1_rank_slice_ids_per_s\":%.0f}\n",
      n, old_rate, order_rate, slice_rate);
  return 0;
}
