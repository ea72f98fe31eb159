// How deep a session's ring is: the depth Attach asked for, or the default for its slot size,
// and for a deep default that does not fit now the shallower depths to try instead. Pure
// functions of the sizes, so the policy is tested without a pool, a GPU or a daemon.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace gpufeed::server {

// The depth of a ring when Attach gives none (SessionManagerOptions' fields of these names).
struct RingDepthRule {
  int32_t default_ring_slots = 0;  // 0 = auto: as many slots as fit in auto_ring_bytes
  uint64_t auto_ring_bytes = uint64_t{64} << 20;
};

// What a device ring of staged image batches (nvJPEG, or the CPU's decode, then the kernel)
// may take of the staging: the GPUs of the node (one rank each, as DDP runs) and the bytes
// the caller's rings may hold (its uid's cap, or the pool's size).
struct StagedRingRoom {
  int gpus = 1;
  uint64_t budget_bytes = 0;
};

// The ring depth for a session with slots of `stride_bytes` when Attach gives none: as many
// slots as fit in auto_ring_bytes, 2 to 16. A device ring of staged batches (`staged`) gets
// 4 slots, else 3, where that many for every GPU fit in half its budget (the other half left
// for other sessions). Its slots are large (~168 MB for 256 images), so auto_ring_bytes gives
// it 2, and 2 are too few: each fill must then finish within one consumer step, behind the
// batch's GPU work. A training runs closer to its synthetic rate, with less data wait, on 4
// slots than on 2 (measured: docs/benchmarks.md, section Adaptive decode).
int32_t DefaultRingSlots(const RingDepthRule& rule, uint64_t stride_bytes,
                         const StagedRingRoom* staged = nullptr);

// The depths to try, deepest first: `asked` alone when Attach named one (nonzero); else the
// default, then, when that is a deep staged ring, 3 and the byte rule's depth (each only if
// shallower than the one before and not below the byte rule's).
std::vector<int32_t> RingDepths(const RingDepthRule& rule, int32_t asked, uint64_t stride_bytes,
                                const StagedRingRoom* staged);

// Calls `allocate(depth)` for each of `depths` in turn while the answer is RESOURCE_EXHAUSTED
// (the slabs' free blocks, what is left of the quota, the GPU): the first other answer, a
// ring or a refusal, else the last refusal. `allocate` returns an absl::StatusOr and frees
// whatever it took before refusing, so a shallower try finds that room again.
template <typename Allocate>
auto AllocateFirstThatFits(absl::Span<const int32_t> depths, Allocate&& allocate)
    -> decltype(allocate(int32_t{0})) {
  auto ring = allocate(depths.front());
  for (size_t i = 1; i < depths.size() && absl::IsResourceExhausted(ring.status()); ++i) {
    ring = allocate(depths[i]);
  }
  return ring;
}

}  // namespace gpufeed::server
