// SplitMix64 (Steele, Lea, Flood 2014), the key schedule of EpochOrder and of a blend's
// sources: one definition, so that both derive their keys the same way.
#pragma once

#include <cstdint>

namespace gpufeed::server {

// Advances `state` by SplitMix64's gamma, 0x9E3779B97F4A7C15, and returns the next output.
uint64_t SplitMix64(uint64_t& state);

}  // namespace gpufeed::server
