// IEEE binary16 to double, written here from the format (a reference for tests, independent of
// the daemon's float-to-half conversion).
#pragma once

#include <cmath>
#include <cstdint>

namespace gpufeed::testing {

// Normal and subnormal numbers; tests expect no infinities or NaNs.
inline double HalfToDouble(uint16_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) != 0 ? -v : v;
}

}  // namespace gpufeed::testing
