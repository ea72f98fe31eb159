// decode auto with --adaptive_decode: how much of each staged batch the CPU pool decodes,
// nvJPEG the rest. Without MPS nvJPEG's hardware engines take their time from a training
// process on the same GPU, per image decoded, in every output format and however the images
// are grouped; the CPU decode path with our kernel costs it little. Under MPS the engines'
// work runs beside training, and still costs it more than the CPU path, so the share adapts
// under MPS too (measured: docs/benchmarks.md, sections nvJPEG beside training and Adaptive
// decode).
//
// The signal is the batch's own fill time against the consumer's pace. A fill (the CPU side
// of a batch: reads, the CPU's decodes, staging) that takes under a "room" bound of the time
// between the consumer's releases leaves the pool room: the CPU takes 1/32 more of the next
// batches; one over a "full" bound of it: 1/8 less. So the pool decodes what it keeps up with,
// whatever the thread count, the other sessions sharing the pool or the consumer's pace. The bounds
// depend on the ring's depth: with 2 slots a batch's fill and its GPU work (nvJPEG, the kernel)
// must both fit in one period, so the pool takes more only
// under half of it and gives back over 0.8; with 3 slots or more the fills run that far ahead
// of the consumer, the GPU work of one batch overlaps the next fill, and only the fill must
// fit: 0.85 and 0.97. Lower bounds left the share below what the pool could decode, and every
// nvJPEG row costs the training, so the share is worth having. Growing the share on a full
// ring and shrinking it on a waiting consumer does not work: a ring of 2 large batches is
// never full at a training's pace, so that share stayed 0 (measured: docs/benchmarks.md,
// section Adaptive decode, The share's bounds).
// StageTarget::cpu carries the share to the rows; images/cpu_rows.h picks which rows.
#pragma once

#include <algorithm>

#include "absl/time/time.h"

namespace gpufeed::server {

class DecodeShare {
 public:
  static constexpr double kUp = 1.0 / 32;
  static constexpr double kDown = 1.0 / 8;

  // The bounds for a ring of `ring_slots` slots (above).
  explicit DecodeShare(int ring_slots)
      : room_(ring_slots >= 3 ? 0.85 : 0.5), full_(ring_slots >= 3 ? 0.97 : 0.8) {}

  // The fraction of rows the CPU decodes, in [0, 1]; starts at 0 (nvJPEG for all).
  double share() const { return share_; }

  // A batch's fill took `fill` while the consumer takes a batch every `period` (zero: not
  // known yet, no change).
  void Filled(absl::Duration fill, absl::Duration period) {
    if (period <= absl::ZeroDuration()) return;
    const double ratio = absl::FDivDuration(fill, period);
    if (ratio < room_) {
      share_ = std::min(1.0, share_ + kUp);
    } else if (ratio > full_) {
      share_ = std::max(0.0, share_ - kDown);
    }
  }

 private:
  double room_, full_;  // fill / period under room_: the pool has room; over full_: near waiting
  double share_ = 0;
};

// The consumer's pace: a moving average (weight 1/5 for the newest) of the time between its
// releases.
class ReleasePace {
 public:
  void Released(absl::Time now) {
    if (last_ != absl::InfinitePast()) {
      const absl::Duration gap = now - last_;
      period_ = period_ == absl::ZeroDuration() ? gap : (period_ * 4 + gap) / 5;
    }
    last_ = now;
  }
  // Zero until two releases.
  absl::Duration period() const { return period_; }

 private:
  absl::Time last_ = absl::InfinitePast();
  absl::Duration period_;
};

}  // namespace gpufeed::server
