// The sampling contract (docs/ARCHITECTURE.md §6):
// - epoch e visits a permutation of all N samples computed from (seed, e) only: a keyed
//   bijection of [0, N) (EpochOrder), never materialised;
// - global batch g of epoch e is perm[g·W·B, (g+1)·W·B); rank r gets rows [r·B, (r+1)·B);
// - drop_last drops the incomplete last global batch; otherwise it is padded by wrapping to
//   the epoch's start (as torch's DistributedSampler does) and padded rows are not valid;
// - even (without drop_last): torch DistributedSampler's split instead: the epoch is padded
//   to ceil(N/W)·W positions by wrapping, rank r takes positions r, r + W, r + 2W, ... (within
//   global batch g still perm[g·W·B, (g+1)·W·B)), and each rank's first ceil(N/W) rows are
//   valid: every rank the same count of real samples, as DistributedSampler gives.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace gpufeed::server {

// (epoch, step): the next global batch to produce or consume. Ordered.
struct Position {
  int64_t epoch = 0;
  int64_t step = 0;
  auto operator<=>(const Position&) const = default;
};

// The largest start epoch a request may name (docs/SECURITY.md §4): far from INT64_MAX, so
// that epoch arithmetic (epoch + 1, epoch * steps) cannot wrap.
inline constexpr int64_t kMaxEpoch = int64_t{1} << 40;

// The name of the sample-order algorithm, part of every feed's fingerprint ("sampler=..."): a
// position saved under another order is refused rather than resumed onto other samples.
inline constexpr char kSamplerName[] = "feistel1";

// The order of epoch `epoch`: position i -> sample id, a bijection of [0, n) fixed by
// (seed, epoch), with O(1) memory and O(1) expected time per position ("feistel1"):
// - the domain is [0, 2^b), b the smallest even number >= 2 with 2^b >= n, split into two
//   halves of h = b/2 bits: x = (L << h) | R;
// - round keys: s = SplitMix64 output of `seed` (state seed + γ, as SplitMix64 steps) XOR
//   epoch; k0..k3 = the next four SplitMix64 outputs of state s;
// - round i (4 rounds): (L, R) -> (R, L ^ (Fmix64(R + k_i) & (2^h - 1))), Fmix64 SplitMix64's
//   output function; after the last round x' = (L << h) | R;
// - cycle walking: the id of position i is the first of E(i), E(E(i)), ... that is < n
//   (expected fewer than 4 steps: 2^b < 4n).
// The identity when !shuffle or n < 2. Pure 64-bit integer arithmetic: the same on every
// machine. tests/python/reference.py re-implements it independently.
class EpochOrder {
 public:
  EpochOrder(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle);
  // The sample id at position `i` (< n) of the epoch.
  uint64_t At(uint64_t i) const;

 private:
  uint64_t Encrypt(uint64_t x) const;

  uint64_t n_;
  bool identity_;
  int half_bits_ = 0;
  uint64_t half_mask_ = 0;
  uint64_t keys_[4] = {};
};

// EpochOrder materialised: n ids. For tests and tools only; the daemon never calls it.
std::vector<uint64_t> EpochPermutation(uint64_t n, uint64_t seed, int64_t epoch, bool shuffle);

struct SamplerConfig {
  uint64_t num_samples = 0;
  int64_t batch_size = 0;  // per rank
  int32_t world_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
  bool even = false;  // DistributedSampler's equal split (needs drop_last false)
  // An elastic resume at another global batch, mid-epoch (docs/sampling.md, "Elastic
  // resume"): epoch `resume_epoch`'s global batches start at place `resume_base` of its
  // order instead of 0, batch g reading [base + g·W·B, base + (g+1)·W·B), so that the batch
  // the job resumes at begins exactly at its global cursor. That epoch is cut (drop_last),
  // padded and split (even) as an epoch of num_samples - base samples; padding wraps to the
  // base; with drop_last it may have no step at all. Every other epoch is as without it.
  // -1: none.
  int64_t resume_epoch = -1;
  uint64_t resume_base = 0;
};

// Immutable after Create: safe to use from any number of threads.
class Sampler {
 public:
  // INVALID_ARGUMENT naming the field when the config has no full step per epoch.
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(const SamplerConfig& config);

  const SamplerConfig& config() const { return config_; }
  // The steps of an epoch (every epoch but a resume_epoch's).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  // The steps of epoch `epoch`: steps_per_epoch(), or the resume epoch's own count.
  int64_t StepsIn(int64_t epoch) const;
  // The position after `p`.
  Position Next(Position p) const;
  // The global batch: batch_size x world_size.
  uint64_t global_batch() const;
  // The global cursor at `p` (Position.samples on the wire): the places of p's epoch that
  // the batches before it read, all ranks together (its epoch's base + step x global batch),
  // at most num_samples.
  uint64_t Cursor(Position p) const;
  // Whether `p` is its epoch's last step.
  bool EndsEpoch(Position p) const { return p.step + 1 >= StepsIn(p.epoch); }

  // Writes the sample ids of `rank`'s slice of global batch `p` into `ids` (batch_size of
  // them) and returns how many leading rows are real samples (the rest are padding). Computes
  // only those positions of the epoch's order, none before them.
  // With `positions` (as many as `ids`, or none), also each row's place in the epoch's order
  // (< num_samples: a padded row's wrapped place), which is the same sample for every sampler
  // of the same order (seed, shuffle, num_samples), whatever its batch size or world size.
  int64_t RankSlice(Position p, int32_t rank, std::span<int64_t> ids,
                    std::span<uint64_t> positions = {}) const;
  // The places in the epoch's order that global batch `p` reads (all ranks): [first, end),
  // end at most num_samples.
  std::pair<uint64_t, uint64_t> GlobalBatchSpan(Position p) const;

 private:
  explicit Sampler(const SamplerConfig& config);
  // Where epoch `epoch`'s order is read from: resume_base in the resume epoch, else 0.
  uint64_t Base(int64_t epoch) const {
    return epoch == config_.resume_epoch ? config_.resume_base : 0;
  }

  const SamplerConfig config_;
  const int64_t steps_per_epoch_;
  const int64_t resume_steps_;  // StepsIn(resume_epoch); 0 without one
};

}  // namespace gpufeed::server
