// The sampling contract (DESIGN.md §5):
// - epoch e visits a permutation of all N samples computed from (seed, e) only;
// - global batch g of epoch e is perm[g·W·B, (g+1)·W·B); rank r gets rows [r·B, (r+1)·B);
// - drop_last drops the incomplete last global batch; otherwise it is padded by wrapping to
//   the epoch's start (as torch's DistributedSampler does) and padded rows are not valid.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gpufeed::server {

// (epoch, step): the next global batch to produce or consume. Ordered.
struct Position {
  int64_t epoch = 0;
  int64_t step = 0;
  auto operator<=>(const Position&) const = default;
};

struct SamplerConfig {
  uint64_t num_samples = 0;
  int64_t batch_size = 0;  // per rank
  int32_t world_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
};

// The permutation of [0, n) for (seed, epoch): SplitMix64 keyed by (seed, epoch) driving a
// Fisher–Yates shuffle with Lemire's unbiased bounded draw. Pure 64-bit integer arithmetic,
// so it is identical on every machine and for every thread count. Identity when !shuffle.
std::vector<uint64_t> EpochPermutation(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle);

class Sampler {
 public:
  // INVALID_ARGUMENT naming the field when the config has no full step per epoch.
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(const SamplerConfig& config);

  const SamplerConfig& config() const { return config_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // The position after `p`.
  Position Next(Position p) const;

  // Writes the sample ids of `rank`'s slice of global batch `p` into `ids` (batch_size of
  // them) and returns how many leading rows are real samples (the rest are padding).
  int64_t RankSlice(Position p, int32_t rank, std::span<int64_t> ids) const;

 private:
  explicit Sampler(const SamplerConfig& config);
  std::shared_ptr<const std::vector<uint64_t>> Permutation(int64_t epoch) const;

  const SamplerConfig config_;
  const int64_t steps_per_epoch_;
  mutable absl::Mutex mu_;
  // The two most recently used epochs: ranks straddle an epoch boundary for a few steps.
  mutable int64_t cached_epoch_[2] ABSL_GUARDED_BY(mu_) = {-1, -1};
  mutable std::shared_ptr<const std::vector<uint64_t>> cached_[2] ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed::server
