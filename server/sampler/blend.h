// A weighted blend of K sources: which source, and which of its samples, blended sample T is
// (docs/howto/blends-and-packing.md). The order arithmetic only: no reading, no wire types.
//
// The rule (Megatron-Core's build_blending_indices, BlendedDataset's dataset_index):
// - a blend is a list of segments, each from sample T_s on with weights w (normalised, each
//   > 0) and the ledger L_s (the per-source counts before T_s); the first starts at 0 with a
//   zero ledger; a later one is a resume at which the weights changed;
// - within a segment, with t = T - T_s and c_k = count_k(T) - L_s[k] (the samples source k
//   gave since the segment began), sample T comes from the source k with the largest error
//   w_k · max(t, 1) - c_k, computed in double as written; ties go to the lowest k. For a
//   single segment this is build_blending_indices exactly (max(t, 1), not t + 1: samples 0
//   and 1 see the same t);
// - the source's own sample index is j = count_k(T) (Megatron's dataset_sample_index), over
//   all segments: a segment continues each source where the ledger left it, so a change of
//   weights repeats and skips nothing within a source's epoch;
// - source k (N_k samples) cycles its own epochs: its j-th sample is EpochOrder(N_k, seed_k,
//   j / N_k, shuffle).At(j % N_k), seed_k = the (k+1)-th SplitMix64 output from state `seed`;
// - the reported id is a union id: offset_k + sample, offset_k = N_0 + ... + N_{k-1}.
//
// Random access: LedgerAt(T) replays the rule from the nearest known ledger at or before T.
// Known ledgers are each segment's start, anchors (a ledger a checkpoint stored) and
// snapshots every kSnapshotInterval samples of a segment, memoised the first time a replay
// passes them, so that after the first pass any T replays at most one interval. Memory:
// K counts per snapshot, at most kMaxSnapshots of them: past that the oldest memoised goes
// (a run past 2^32 picks keeps its recent ones, so its next chunk replays one interval, not
// all the way from the last one kept; a position before the kept ones replays from the
// nearest known: slower once, never different).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace gpufeed::server {

// The name of the blend rule, for a feed's fingerprint: a position saved under another rule
// is refused rather than resumed onto other samples.
inline constexpr char kBlendRuleName[] = "megatron-blend1";

// The most sources a blend may have (Megatron's dataset_index is int16).
inline constexpr int32_t kMaxBlendSources = 32767;

// Where the weights are in force: from sample `start` on, with the per-source counts
// `ledger` before it.
struct BlendSegment {
  uint64_t start = 0;
  std::vector<double> weights;  // K, each finite and > 0; the rule uses them normalised
  std::vector<uint64_t> ledger;  // K; all zero for the first segment
};

struct BlendSpec {
  std::vector<uint64_t> sizes;  // N_k, each >= 1
  uint64_t seed = 0;
  bool shuffle = true;
  std::vector<BlendSegment> segments;  // at least one; starts strictly increasing from 0
};

// One blended sample.
struct BlendPick {
  int32_t source = 0;  // k (dataset_index)
  uint64_t index = 0;  // j: the source's own sample index, over its epochs (dataset_sample_index)
  uint64_t sample = 0;  // the source's sample id, in [0, N_k)
  uint64_t id = 0;  // the union id: offset_k + sample
  bool operator==(const BlendPick&) const = default;
};

// Thread-safe: every method may be called from any number of threads.
class Blend {
 public:
  static constexpr uint64_t kSnapshotInterval = uint64_t{1} << 16;
  static constexpr size_t kMaxSnapshots = size_t{1} << 16;

  // INVALID_ARGUMENT naming the field: no source, a size of 0, a weight not finite or <= 0,
  // a weights or ledger list of another length than sizes, a first segment not at 0 with a
  // zero ledger, starts not increasing, a ledger that does not add up (its counts must grow
  // from the segment before by exactly start - previous start in all).
  static absl::StatusOr<std::unique_ptr<Blend>> Create(BlendSpec spec);
  // As Create, memoising at most `max_snapshots` (tests: the bound's rule without 2^32 picks).
  static absl::StatusOr<std::unique_ptr<Blend>> Create(BlendSpec spec, size_t max_snapshots);

  // The known ledger nearest at or before `t` (its position): what a replay to t starts from.
  uint64_t NearestKnown(uint64_t t) const;
  // The snapshots memoised now.
  size_t snapshots() const;

  // The spec as given (weights as given).
  const BlendSpec& spec() const { return spec_; }
  // Segment `segment`'s weights normalised as Megatron's normalize() does (w / numpy.sum(w)):
  // the doubles the rule uses.
  const std::vector<double>& weights(size_t segment) const { return weights_[segment]; }
  int32_t num_sources() const { return static_cast<int32_t>(spec_.sizes.size()); }
  // offset_k: the first union id of source k.
  uint64_t offset(int32_t source) const { return offsets_[source]; }

  // The per-source counts before sample `t` (what a checkpoint at t stores).
  std::vector<uint64_t> LedgerAt(uint64_t t) const;
  // Blended sample `t`.
  BlendPick At(uint64_t t) const;
  // Blended samples first, first + 1, ...: out.size() of them, one replay.
  void Fill(uint64_t first, std::span<BlendPick> out) const;

  // Records a ledger known to be the one before sample `t` (a checkpoint's), so that
  // positions after t need not replay from the segment's start. INVALID_ARGUMENT when it
  // cannot be one: another length, counts below the segment's ledger, or not adding up to t.
  // A ledger that adds up but that this blend would not have reached gives another (still
  // repeat-free) source sequence from t on: it is the caller's to store it faithfully.
  absl::Status AddAnchor(uint64_t t, std::span<const uint64_t> ledger);

  // The spec of this blend resumed at `t` with new `weights`: a segment from t on with
  // LedgerAt(t) (segments from t on are dropped). The caller creates the new Blend from it.
  absl::StatusOr<BlendSpec> WithWeightsAt(uint64_t t, std::vector<double> weights) const;

 private:
  Blend(BlendSpec spec, size_t max_snapshots);
  // The segment sample `t` is in.
  size_t SegmentOf(uint64_t t) const;
  // The source the rule picks in `segment` at local sample `local` with `counts` (global).
  int32_t Choose(size_t segment, uint64_t local, std::span<const uint64_t> counts) const;
  BlendPick PickOf(int32_t source, uint64_t index) const;
  // The ledger before `t`; walks forward from the nearest known one, memoising the snapshots
  // it passes.
  std::vector<uint64_t> Replay(uint64_t t) const;

  const BlendSpec spec_;
  std::vector<uint64_t> offsets_;
  std::vector<uint64_t> seeds_;
  std::vector<std::vector<double>> weights_;  // per segment, normalised

  mutable absl::Mutex mu_;
  // Known ledgers by position: segment starts, anchors and snapshots.
  mutable std::map<uint64_t, std::vector<uint64_t>> known_ ABSL_GUARDED_BY(mu_);
  const size_t max_snapshots_;
  // The memoised snapshots' positions, oldest first (segment starts never go, nor anchors
  // but one added where a snapshot was: the same ledger, only the replay's start moves).
  mutable std::deque<uint64_t> snapshots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed::server
