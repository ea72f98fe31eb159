// Liveness from progress: a BusyMark says how long a thread's current work item has run.
// Pipeline threads (fill workers, GPU copy threads) mark each item they run; the daemon's
// monitor reads every mark and declares the daemon stalled when one item has run longer than
// --stall_timeout (health NOT_SERVING, the systemd watchdog no longer fed), so a wedged daemon
// is restarted instead of holding every job. A thread that waits for work is idle, not busy:
// an idle daemon, or a consumer that holds its batches, is never a stall.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gpufeed {

class BusyMark {
 public:
  explicit BusyMark(std::string name) : name_(std::move(name)) {}
  BusyMark(const BusyMark&) = delete;
  BusyMark& operator=(const BusyMark&) = delete;

  const std::string& name() const { return name_; }
  // How long the current item has run at `now`; zero while idle.
  absl::Duration BusyFor(absl::Time now) const {
    const int64_t since = since_ns_.load(std::memory_order_relaxed);
    if (since == 0) return absl::ZeroDuration();
    return now - absl::FromUnixNanos(since);
  }

  // Marks the thread busy for its lifetime (one work item).
  class Scope {
   public:
    explicit Scope(BusyMark& mark) : mark_(mark) {
      mark_.since_ns_.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed);
    }
    ~Scope() { mark_.since_ns_.store(0, std::memory_order_relaxed); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    BusyMark& mark_;
  };

 private:
  const std::string name_;
  std::atomic<int64_t> since_ns_{0};
};

// The mark busy longest at `now`, when it has been busy for `timeout` or more: what the
// daemon reports as a stall (liveness NOT_SERVING).
struct Stall {
  const BusyMark* mark = nullptr;
  absl::Duration busy;
};
inline std::optional<Stall> FindStall(const std::vector<const BusyMark*>& marks, absl::Time now,
                                      absl::Duration timeout) {
  Stall longest;
  for (const BusyMark* m : marks) {
    const absl::Duration busy = m->BusyFor(now);
    if (busy > longest.busy) longest = {m, busy};
  }
  if (longest.mark == nullptr || longest.busy < timeout) return std::nullopt;
  return longest;
}

}  // namespace gpufeed
