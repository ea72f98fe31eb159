#include "server/sampler/sampler.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/sampler/splitmix.h"

namespace gpufeed::server {
namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;

// SplitMix64's output function (Steele, Lea, Flood 2014; the constants of Vigna's version).
uint64_t Fmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t SplitMix64(uint64_t& state) { return Fmix64(state += kGamma); }

namespace {

// The steps of an epoch of `n` places. Called once Create has checked batch_size >= 1,
// world_size >= 1 and that their product fits: global >= 1. (Without drop_last, even or not:
// ceil(ceil(n / W) / B) = ceil(n / (W·B)).)
int64_t StepsFor(const SamplerConfig& c, uint64_t n) {
  const uint64_t global = static_cast<uint64_t>(c.batch_size) * static_cast<uint64_t>(c.world_size);
  // Without drop_last: ceil(n / global), written so that n + global - 1 cannot wrap.
  return static_cast<int64_t>(c.drop_last ? n / global : n / global + (n % global != 0 ? 1 : 0));
}

}  // namespace

EpochOrder::EpochOrder(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle)
    : n_(n), identity_(!shuffle || n < 2) {
  if (identity_) return;
  // The smallest even bit count b >= 2 with 2^b >= n: 2^b < 4n, so cycle walking takes fewer
  // than 4 steps on average.
  int bits = 64 - std::countl_zero(n - 1);  // 2^bits >= n, bits >= 1 since n >= 2
  bits += bits & 1;
  half_bits_ = bits / 2;  // 1..32
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  uint64_t state = seed;
  state = SplitMix64(state) ^ static_cast<uint64_t>(epoch);
  for (uint64_t& key : keys_) key = SplitMix64(state);
}

uint64_t EpochOrder::Encrypt(uint64_t x) const {
  uint64_t left = x >> half_bits_;
  uint64_t right = x & half_mask_;
  for (const uint64_t key : keys_) {
    const uint64_t next = left ^ (Fmix64(right + key) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

uint64_t EpochOrder::At(uint64_t i) const {
  if (identity_) return i;
  // A permutation of [0, 2^b) restricted to [0, n) by walking the cycle of i until it lands
  // inside: still a bijection of [0, n), since every cycle through [0, n) is walked the same.
  uint64_t x = Encrypt(i);
  while (x >= n_) x = Encrypt(x);
  return x;
}

std::vector<uint64_t> EpochPermutation(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle) {
  const EpochOrder order(n, seed, epoch, shuffle);
  std::vector<uint64_t> perm(n);
  for (uint64_t i = 0; i < n; ++i) perm[i] = order.At(i);
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
  if (c.even && c.drop_last) {
    return absl::InvalidArgumentError(
        "even: pads each rank's share to ceil(N / world_size) samples, as DistributedSampler "
        "does; set drop_last=false with it");
  }
  if (StepsFor(c, c.num_samples) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_size: a global batch of ", c.batch_size, " x ", c.world_size, " ranks = ",
        static_cast<uint64_t>(global), " samples is larger than the dataset's ", c.num_samples,
        " samples with drop_last; lower batch_size or set drop_last=false"));
  }
  if (c.resume_epoch >= 0) {
    if (c.resume_epoch > kMaxEpoch || c.resume_base >= c.num_samples) {
      return absl::InvalidArgumentError(
          absl::StrCat("start.samples: a resume of epoch ", c.resume_epoch, " at place ",
                       c.resume_base, " of ", c.num_samples, " samples"));
    }
  }
  return std::unique_ptr<Sampler>(new Sampler(c));
}

Sampler::Sampler(const SamplerConfig& config)
    : config_(config),
      steps_per_epoch_(StepsFor(config, config.num_samples)),
      resume_steps_(config.resume_epoch >= 0
                        ? StepsFor(config, config.num_samples - config.resume_base)
                        : 0) {}

int64_t Sampler::StepsIn(int64_t epoch) const {
  return epoch == config_.resume_epoch ? resume_steps_ : steps_per_epoch_;
}

Position Sampler::Next(Position p) const {
  ++p.step;
  // A resume epoch may have no step (its base past the last full batch): skipped.
  while (p.step >= StepsIn(p.epoch)) {
    p.step = 0;
    ++p.epoch;
  }
  return p;
}

uint64_t Sampler::global_batch() const {
  return static_cast<uint64_t>(config_.batch_size) * static_cast<uint64_t>(config_.world_size);
}

uint64_t Sampler::Cursor(Position p) const {
  return GlobalBatchSpan(p).first;
}

std::pair<uint64_t, uint64_t> Sampler::GlobalBatchSpan(Position p) const {
  const uint64_t global = global_batch();
  // step < StepsIn(epoch), so base + step·global < n + global < 2^64 (Create bounds global).
  const uint64_t first = Base(p.epoch) + std::min<uint64_t>(p.step, steps_per_epoch_) * global;
  return {std::min(first, config_.num_samples), std::min(first + global, config_.num_samples)};
}

int64_t Sampler::RankSlice(Position p, int32_t rank, std::span<int64_t> ids,
                           std::span<uint64_t> positions) const {
  const EpochOrder order(config_.num_samples, config_.seed, p.epoch, config_.shuffle);
  const uint64_t n = config_.num_samples;
  // The epoch's places from its base on: [base, n), m of them; padding wraps to the base.
  const uint64_t base = Base(p.epoch);
  const uint64_t m = n - base;
  const uint64_t b = static_cast<uint64_t>(config_.batch_size);
  const auto place = [&](uint64_t rel) { return base + (rel < m ? rel : rel % m); };
  // step < StepsIn(epoch), so every relative index below is < m + W·B < 2^64: no wrap.
  if (config_.even) {
    // Row i is the rank's position k = step·B + i of ceil(m/W); relative place k·W + rank.
    const uint64_t w = static_cast<uint64_t>(config_.world_size);
    const uint64_t per_rank = m / w + (m % w != 0 ? 1 : 0);
    int64_t valid = 0;
    for (uint64_t i = 0; i < b && i < ids.size(); ++i) {
      const uint64_t k = static_cast<uint64_t>(p.step) * b + i;
      const uint64_t at = place(k * w + static_cast<uint64_t>(rank));
      ids[i] = static_cast<int64_t>(order.At(at));
      if (i < positions.size()) positions[i] = at;
      if (k < per_rank) ++valid;
    }
    return valid;
  }
  const uint64_t first = (static_cast<uint64_t>(p.step) * config_.world_size + rank) * b;
  int64_t valid = 0;
  for (uint64_t i = 0; i < b && i < ids.size(); ++i) {
    const uint64_t at = place(first + i);
    ids[i] = static_cast<int64_t>(order.At(at));
    if (i < positions.size()) positions[i] = at;
    if (first + i < m) ++valid;
  }
  return valid;
}

}  // namespace gpufeed::server
