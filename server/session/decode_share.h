// decode auto with --adaptive_decode: how much of each staged batch the CPU pool decodes,
// nvJPEG the rest. Measured on an H200 (.ci/device/interference_on_device.sh): without MPS
// nvJPEG's hardware engines cost a training process on the same GPU about 8.5 ms of its time
// per batch of 256 images (~33 us an image) in every output format (RGBI launches one
// colour-conversion kernel per image, YUV none, and both cost the same) and however the
// images are grouped (2,048 every 472 ms cost what 256 every 59 ms cost), so ~16 % at
// ResNet-50's pace; the CPU decode path with our kernel costs it ~1 %. Under MPS the engines'
// work runs beside training, and still costs it more than the CPU path: ResNet-50 trained at
// 95.0 % of synthetic fed by nvJPEG and 97.6 % by the CPU decoder (tests/bench/
// resnet_goals_on_device.sh, 12 threads, 2026-12-01). So the share adapts under MPS too.
//
// The signal is the batch's own fill time against the consumer's pace. A fill (the CPU side
// of a batch: reads, the CPU's decodes, staging) that takes under a "room" bound of the time
// between the consumer's releases leaves the pool room: the CPU takes 1/32 more of the next
// batches; one over a "full" bound of it: 1/8 less. So the pool decodes what it keeps up with,
// whatever the thread count, the other sessions sharing the pool or the consumer's pace. The bounds
// depend on the ring's depth: with 2 slots a batch's fill and its GPU work (nvJPEG, the kernel, ~11
// ms for 256 images on an H200) must both fit in one period, so the pool takes more only
// under half of it and gives back over 0.8; with 3 slots or more the fills run that far ahead
// of the consumer, the GPU work of one batch overlaps the next fill, and only the fill must
// fit: 0.85 and 0.97. (At 0.75 and 0.9 the share settled where fills took ~0.75-0.8 of the
// pace: 47 % with 4 threads on the H200 at ResNet-50's pace, where the pool's own rate
// predicts ~55 % at 0.9; each nvJPEG row costs the training ~33 us, so the share is worth
// having.) (The ring of 2 held the share to ~66 % with 12 threads on the H200 at
// ResNet-50's pace, where the pool could decode every row: measured, 2026-12-01.) (A first
// version grew the share when the ring filled and shrank it when the consumer waited; at
// ResNet-50's pace on the H200 the ring of 2 large batches was never full and the consumer
// waited a little on every batch for other reasons, so the share stayed 0: measured.)
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
