#include "server/sampler/sampler.h"

#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, bound), bound >= 1 (Lemire, "Fast Random Integer Generation in an Interval").
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

int64_t StepsPerEpoch(const SamplerConfig& c) {
  const uint64_t global = static_cast<uint64_t>(c.batch_size) * static_cast<uint64_t>(c.world_size);
  if (global == 0) return 0;
  return static_cast<int64_t>(c.drop_last ? c.num_samples / global
                                          : (c.num_samples + global - 1) / global);
}

}  // namespace

std::vector<uint64_t> EpochPermutation(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  std::vector<uint64_t> perm(n);
  std::iota(perm.begin(), perm.end(), uint64_t{0});
  if (!shuffle || n < 2) return perm;
  // Key the stream by (seed, epoch): two SplitMix rounds decorrelate neighbouring seeds.
  uint64_t state = seed;
  state = SplitMix64(state) ^ static_cast<uint64_t>(epoch);
  SplitMix64(state);
  for (uint64_t i = n - 1; i > 0; --i) {
    const uint64_t j = Bounded(state, i + 1);
    std::swap(perm[i], perm[j]);
  }
  return perm;
}

absl::StatusOr<std::unique_ptr<Sampler>> Sampler::Create(const SamplerConfig& c) {
  if (c.batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", c.batch_size));
  }
  if (c.world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", c.world_size));
  }
  if (c.num_samples == 0) return absl::InvalidArgumentError("dataset has no samples");
  const __uint128_t global = static_cast<__uint128_t>(c.batch_size) * c.world_size;
  if (global > std::numeric_limits<int64_t>::max()) {
    return absl::InvalidArgumentError("batch_size * world_size overflows");
  }
  if (StepsPerEpoch(c) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_size: a global batch of ", c.batch_size, " x ", c.world_size, " ranks = ",
        static_cast<uint64_t>(global), " samples is larger than the dataset's ", c.num_samples,
        " samples with drop_last; lower batch_size or set drop_last=false"));
  }
  return std::unique_ptr<Sampler>(new Sampler(c));
}

Sampler::Sampler(const SamplerConfig& config)
    : config_(config), steps_per_epoch_(StepsPerEpoch(config)) {}

Position Sampler::Next(Position p) const {
  if (++p.step >= steps_per_epoch_) {
    p.step = 0;
    ++p.epoch;
  }
  return p;
}

std::shared_ptr<const std::vector<uint64_t>> Sampler::Permutation(int64_t epoch) const {
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < 2; ++i) {
      if (cached_epoch_[i] == epoch) return cached_[i];
    }
  }
  // Computed outside the lock: another thread may compute the same epoch concurrently,
  // which wastes a little work but never blocks readers of the other epoch.
  auto perm = std::make_shared<const std::vector<uint64_t>>(
      EpochPermutation(config_.num_samples, config_.seed, epoch, config_.shuffle));
  absl::MutexLock lock(&mu_);
  const int victim = cached_epoch_[0] < cached_epoch_[1] ? 0 : 1;
  cached_epoch_[victim] = epoch;
  cached_[victim] = perm;
  return perm;
}

int64_t Sampler::RankSlice(Position p, int32_t rank, std::span<int64_t> ids) const {
  const std::shared_ptr<const std::vector<uint64_t>> perm = Permutation(p.epoch);
  const uint64_t n = config_.num_samples;
  const uint64_t b = static_cast<uint64_t>(config_.batch_size);
  const uint64_t first = (static_cast<uint64_t>(p.step) * config_.world_size + rank) * b;
  int64_t valid = 0;
  for (uint64_t i = 0; i < b && i < ids.size(); ++i) {
    const uint64_t index = first + i;
    ids[i] = static_cast<int64_t>((*perm)[index % n]);
    if (index < n) ++valid;
  }
  return valid;
}

}  // namespace gpufeed::server
