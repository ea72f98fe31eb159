// The injected clock (docs/STYLE.md rule 8): what the core asks for "now" where a decision
// depends on elapsed time (lease timeouts, dataset handle lifetimes), so that tests advance a
// fake one (tests/testing/fake_clock.h) instead of sleeping. Default: absl::Now.
#pragma once

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gpufeed {

// Must be callable from any thread.
using Clock = std::function<absl::Time()>;

inline Clock RealClock() { return &absl::Now; }

}  // namespace gpufeed
