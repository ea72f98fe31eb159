#include "server/sampler/blend.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/sampler/sampler.h"
#include "server/sampler/splitmix.h"

namespace gpufeed::server {
namespace {

// numpy.sum's pairwise summation of a contiguous float64 array (up to its 8192-element
// buffer), so that weights normalise to the same doubles as Megatron's normalize() gives.
double PairwiseSum(const double* a, size_t n) {
  if (n < 8) {
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += a[i];
    return sum;
  }
  if (n <= 128) {
    double r[8];
    std::copy(a, a + 8, r);
    size_t i = 8;
    for (; i < n - n % 8; i += 8) {
      for (size_t j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) sum += a[i];
    return sum;
  }
  size_t half = n / 2;
  half -= half % 8;
  return PairwiseSum(a, half) + PairwiseSum(a + half, n - half);
}

absl::Status CheckSegment(const BlendSegment& segment, size_t k, size_t index) {
  const std::string where = absl::StrCat("segments[", index, "]");
  if (segment.weights.size() != k) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".weights has ", segment.weights.size(),
                                                   " entries; the blend has ", k, " sources"));
  }
  if (segment.ledger.size() != k) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".ledger has ", segment.ledger.size(),
                                                   " entries; the blend has ", k, " sources"));
  }
  for (size_t i = 0; i < k; ++i) {
    const double w = segment.weights[i];
    if (!std::isfinite(w) || w <= 0.0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".weights[", i, "] is ", w,
                       "; each weight must be finite and > 0 (leave a source out instead)"));
    }
  }
  return absl::OkStatus();
}

// Whether `ledger` can follow `before` after `samples` more samples: no count goes down and
// they grow by exactly `samples` in all.
absl::Status CheckGrowth(std::span<const uint64_t> before, std::span<const uint64_t> ledger,
                         uint64_t samples, const std::string& where) {
  // Summed wide: counts near 2^64 (a hostile history) must not wrap into a sum that adds up.
  __uint128_t grown = 0;
  for (size_t i = 0; i < ledger.size(); ++i) {
    if (ledger[i] < before[i]) {
      return absl::InvalidArgumentError(absl::StrCat(where, "[", i, "] is ", ledger[i],
                                                     ", below the ", before[i],
                                                     " samples source ", i, " had given before"));
    }
    grown += ledger[i] - before[i];
  }
  if (grown != samples) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " grows by ",
                     (grown >> 64) != 0 ? std::string("more than 2^64")
                                        : absl::StrCat(static_cast<uint64_t>(grown)),
                     " samples in all; ", samples,
                     " samples lie between it and the ledger before (its counts must add up)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Blend>> Blend::Create(BlendSpec spec) {
  return Create(std::move(spec), kMaxSnapshots);
}

absl::StatusOr<std::unique_ptr<Blend>> Blend::Create(BlendSpec spec, size_t max_snapshots) {
  const size_t k = spec.sizes.size();
  if (k == 0) return absl::InvalidArgumentError("sizes is empty; a blend needs a source");
  if (k > static_cast<size_t>(kMaxBlendSources)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sizes has ", k, " sources; at most ", kMaxBlendSources));
  }
  uint64_t total = 0;
  for (size_t i = 0; i < k; ++i) {
    if (spec.sizes[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("sizes[", i, "] is 0; every source needs a sample"));
    }
    if (spec.sizes[i] > (uint64_t{1} << 62) - total) {
      return absl::InvalidArgumentError("sizes add up past 2^62 union ids");
    }
    total += spec.sizes[i];
  }
  if (spec.segments.empty()) {
    return absl::InvalidArgumentError("segments is empty; the first gives the weights from 0");
  }
  for (size_t s = 0; s < spec.segments.size(); ++s) {
    BlendSegment& segment = spec.segments[s];
    if (absl::Status status = CheckSegment(segment, k, s); !status.ok()) return status;
    if (s == 0) {
      if (segment.start != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("segments[0].start is ", segment.start, "; the first segment starts at 0"));
      }
      if (std::any_of(segment.ledger.begin(), segment.ledger.end(),
                      [](uint64_t c) { return c != 0; })) {
        return absl::InvalidArgumentError("segments[0].ledger is not all zero");
      }
      continue;
    }
    const BlendSegment& before = spec.segments[s - 1];
    if (segment.start <= before.start) {
      return absl::InvalidArgumentError(absl::StrCat("segments[", s, "].start is ", segment.start,
                                                     "; starts must increase (segments[", s - 1,
                                                     "] starts at ", before.start, ")"));
    }
    if (absl::Status status = CheckGrowth(before.ledger, segment.ledger,
                                          segment.start - before.start,
                                          absl::StrCat("segments[", s, "].ledger"));
        !status.ok()) {
      return status;
    }
  }
  return std::unique_ptr<Blend>(new Blend(std::move(spec), max_snapshots));
}

Blend::Blend(BlendSpec spec, size_t max_snapshots)
    : spec_(std::move(spec)), max_snapshots_(max_snapshots) {
  uint64_t offset = 0;
  uint64_t state = spec_.seed;
  for (uint64_t size : spec_.sizes) {
    offsets_.push_back(offset);
    offset += size;
    seeds_.push_back(SplitMix64(state));
  }
  for (const BlendSegment& segment : spec_.segments) {
    const double sum = PairwiseSum(segment.weights.data(), segment.weights.size());
    std::vector<double>& weights = weights_.emplace_back(segment.weights);
    for (double& w : weights) w /= sum;
  }
  absl::MutexLock lock(&mu_);
  for (const BlendSegment& segment : spec_.segments) known_[segment.start] = segment.ledger;
}

size_t Blend::SegmentOf(uint64_t t) const {
  const auto after = std::upper_bound(
      spec_.segments.begin(), spec_.segments.end(), t,
      [](uint64_t value, const BlendSegment& segment) { return value < segment.start; });
  return static_cast<size_t>(std::distance(spec_.segments.begin(), after)) - 1;
}

int32_t Blend::Choose(size_t segment, uint64_t local, std::span<const uint64_t> counts) const {
  const BlendSegment& seg = spec_.segments[segment];
  const std::vector<double>& weights = weights_[segment];
  // As build_blending_indices computes it: the first source is the initial maximum and only
  // a strictly larger error displaces it, so ties go to the lowest index.
  const double t = std::max(static_cast<double>(local), 1.0);
  int32_t best = 0;
  double best_error = weights[0] * t - static_cast<double>(counts[0] - seg.ledger[0]);
  for (size_t k = 1; k < counts.size(); ++k) {
    const double error = weights[k] * t - static_cast<double>(counts[k] - seg.ledger[k]);
    if (error > best_error) {
      best_error = error;
      best = static_cast<int32_t>(k);
    }
  }
  return best;
}

BlendPick Blend::PickOf(int32_t source, uint64_t index) const {
  const uint64_t n = spec_.sizes[source];
  const EpochOrder order(n, seeds_[source], static_cast<int64_t>(index / n), spec_.shuffle);
  BlendPick pick;
  pick.source = source;
  pick.index = index;
  pick.sample = order.At(index % n);
  pick.id = offsets_[source] + pick.sample;
  return pick;
}

std::vector<uint64_t> Blend::Replay(uint64_t t) const {
  const size_t segment = SegmentOf(t);
  const uint64_t start = spec_.segments[segment].start;
  uint64_t at;
  std::vector<uint64_t> counts;
  {
    absl::MutexLock lock(&mu_);
    // The segment's start is always known, so this finds one at or after it.
    auto known = std::prev(known_.upper_bound(t));
    at = known->first;
    counts = known->second;
  }
  if (at == t) return counts;
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> passed;
  for (; at < t; ++at) {
    const uint64_t local = at - start;
    if (local % kSnapshotInterval == 0 && local != 0) passed.emplace_back(at, counts);
    ++counts[Choose(segment, local, counts)];
  }
  if ((t - start) % kSnapshotInterval == 0) passed.emplace_back(t, counts);
  if (!passed.empty()) {
    absl::MutexLock lock(&mu_);
    for (auto& [position, ledger] : passed) {
      if (!known_.emplace(position, std::move(ledger)).second) continue;
      snapshots_.push_back(position);
      if (snapshots_.size() > max_snapshots_) {
        known_.erase(snapshots_.front());
        snapshots_.pop_front();
      }
    }
  }
  return counts;
}

std::vector<uint64_t> Blend::LedgerAt(uint64_t t) const { return Replay(t); }

uint64_t Blend::NearestKnown(uint64_t t) const {
  absl::MutexLock lock(&mu_);
  return std::prev(known_.upper_bound(t))->first;
}

size_t Blend::snapshots() const {
  absl::MutexLock lock(&mu_);
  return snapshots_.size();
}

BlendPick Blend::At(uint64_t t) const {
  const std::vector<uint64_t> counts = Replay(t);
  const size_t segment = SegmentOf(t);
  const int32_t source = Choose(segment, t - spec_.segments[segment].start, counts);
  return PickOf(source, counts[source]);
}

void Blend::Fill(uint64_t first, std::span<BlendPick> out) const {
  if (out.empty()) return;
  std::vector<uint64_t> counts = Replay(first);
  size_t segment = SegmentOf(first);
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t t = first + i;
    if (segment + 1 < spec_.segments.size() && t >= spec_.segments[segment + 1].start) {
      ++segment;  // its ledger is the counts reached here: Create checked they add up
      counts = spec_.segments[segment].ledger;
    }
    const int32_t source = Choose(segment, t - spec_.segments[segment].start, counts);
    out[i] = PickOf(source, counts[source]++);
  }
}

absl::Status Blend::AddAnchor(uint64_t t, std::span<const uint64_t> ledger) {
  if (ledger.size() != spec_.sizes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the ledger has ", ledger.size(),
                                                   " counts; the blend has ",
                                                   spec_.sizes.size(), " sources"));
  }
  const BlendSegment& segment = spec_.segments[SegmentOf(t)];
  if (absl::Status status = CheckGrowth(segment.ledger, ledger, t - segment.start, "the ledger");
      !status.ok()) {
    return status;
  }
  absl::MutexLock lock(&mu_);
  known_.emplace(t, std::vector<uint64_t>(ledger.begin(), ledger.end()));
  return absl::OkStatus();
}

absl::StatusOr<BlendSpec> Blend::WithWeightsAt(uint64_t t, std::vector<double> weights) const {
  BlendSpec spec = spec_;
  const size_t kept = SegmentOf(t) + (spec_.segments[SegmentOf(t)].start < t ? 1 : 0);
  spec.segments.resize(kept);
  if (spec.segments.empty()) {  // new weights from sample 0: a blend of its own
    spec.segments.push_back(BlendSegment{0, std::move(weights), std::vector<uint64_t>(spec.sizes.size())});
  } else {
    spec.segments.push_back(BlendSegment{t, std::move(weights), LedgerAt(t)});
  }
  if (absl::Status status = CheckSegment(spec.segments.back(), spec.sizes.size(),
                                         spec.segments.size() - 1);
      !status.ok()) {
    return status;
  }
  return spec;
}

}  // namespace gpufeed::server
