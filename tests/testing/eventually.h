// Polls a condition of the code under test until it holds: what tests wait on instead of a
// sleep followed by an assumption.
#pragma once

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gpufeed::testing {

// Whether `pred` held within `timeout`, polled every 200 us.
inline bool Eventually(const std::function<bool()>& pred,
                       absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!pred()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Microseconds(200));
  }
  return true;
}

}  // namespace gpufeed::testing
