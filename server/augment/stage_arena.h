// The per-batch allocator of a staged slot's arena and device scratch (augment/staged.h).
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/augment/staged.h"

namespace gpufeed::server {

// Room for a sample's staged form in the arena and the device scratch, bump-allocated per
// batch. A claim never takes the room that the samples still to come need for their
// finished rows, so every sample fits at least as kFinal.
class StageArena {
 public:
  StageArena(const StagedLayout& layout) : layout_(layout) {}  // NOLINT: a view
  struct Claim {
    uint64_t host_offset = 0;
    uint64_t device_offset = 0;
  };
  // Host and device room for one staged sample, or false when there is none (then ClaimFinal).
  bool TryClaim(uint64_t host_bytes, uint64_t device_bytes, Claim* out);
  // Host room for one finished row: always succeeds for at most `batch` claims in all.
  Claim ClaimFinal();

 private:
  static constexpr uint64_t kAlign = 256;
  const StagedLayout& layout_;
  absl::Mutex mu_;
  uint64_t host_used_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t device_used_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t placed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed::server
