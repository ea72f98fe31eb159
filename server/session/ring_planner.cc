#include "server/session/ring_planner.h"

#include <algorithm>

namespace gpufeed::server {

int32_t DefaultRingSlots(const RingDepthRule& rule, uint64_t stride_bytes,
                         const StagedRingRoom* staged) {
  if (rule.default_ring_slots > 0) return rule.default_ring_slots;
  const uint64_t fit = rule.auto_ring_bytes / std::max<uint64_t>(stride_bytes, 1);
  const auto slots = static_cast<int32_t>(std::clamp<uint64_t>(fit, 2, 16));
  if (staged == nullptr) return slots;
  const uint64_t gpus = static_cast<uint64_t>(std::max(staged->gpus, 1));
  for (const int32_t deep : {4, 3}) {
    // stride < 2^45 (Feed bounds a batch), gpus a device count: the product cannot wrap.
    if (deep > slots && deep * stride_bytes * gpus <= staged->budget_bytes / 2) return deep;
  }
  return slots;
}

std::vector<int32_t> RingDepths(const RingDepthRule& rule, int32_t asked, uint64_t stride_bytes,
                                const StagedRingRoom* staged) {
  if (asked != 0) return {asked};
  std::vector<int32_t> depths = {DefaultRingSlots(rule, stride_bytes, staged)};
  const int32_t shallow = DefaultRingSlots(rule, stride_bytes);
  for (const int32_t fewer : {3, shallow}) {
    if (fewer < depths.back() && fewer >= shallow) depths.push_back(fewer);
  }
  return depths;
}

}  // namespace gpufeed::server
