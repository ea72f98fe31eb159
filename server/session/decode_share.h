// decode auto, without MPS: how much of each staged batch the CPU pool decodes, nvJPEG the
// rest. Measured on an H200 (tests/gpu/interference_on_device.sh): nvJPEG's hardware engines
// cost a training process on the same GPU about 8.5 ms of its time per batch of 256 images,
// in every output format (RGBI launches one colour-conversion kernel per image, YUV none, and
// both cost the same), so ~16 % at ResNet-50's pace; the CPU decode path with our kernel costs
// it ~1 %. Under MPS the engines' work runs beside training, not time-sliced against it, so
// there the daemon keeps nvJPEG for every row.
//
// The controller is additive-increase, larger-decrease, like a congestion window: each time
// the ring fills up (the producer is ahead of the consumer) the CPU takes 1/64 more of the
// batch; each time the consumer reports a wait of more than 1 ms for a batch, 1/8 less.
// StageTarget::cpu_share carries the share to the rows (CpuDecodesRow, pipeline/dataset.h).
// So the CPU pool decodes as much as it keeps up with, whatever the thread count, the other
// sessions sharing the pool or the consumer's pace, and nvJPEG takes the rest.
#pragma once

#include <algorithm>

#include "absl/time/time.h"

namespace gpufeed::server {

class DecodeShare {
 public:
  static constexpr double kUp = 1.0 / 64;
  static constexpr double kDown = 1.0 / 8;
  static constexpr absl::Duration kBehind = absl::Milliseconds(1);

  // The fraction of rows the CPU decodes, in [0, 1]; starts at 0 (nvJPEG for all).
  double share() const { return share_; }
  // The ring just filled: the producer is ahead.
  void Ahead() { share_ = std::min(1.0, share_ + kUp); }
  // The consumer waited `waited` for a batch (as its release reports).
  void Waited(absl::Duration waited) {
    if (waited > kBehind) share_ = std::max(0.0, share_ - kDown);
  }

 private:
  double share_ = 0;
};

}  // namespace gpufeed::server
