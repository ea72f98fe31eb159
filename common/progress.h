// Liveness from progress: a BusyMark says how long a thread has gone without progress in its
// current work item. Pipeline threads (fill workers, GPU copy threads) mark each item they
// run, and a fill marks progress after each sample it reads or stages (Progress); the daemon's
// monitor reads every mark and declares the daemon stalled when one thread has been busy that
// long without progress: --stall_timeout (health NOT_SERVING, the systemd watchdog no longer
// fed), so a wedged daemon is restarted instead of holding every job.
//
// The rule, exactly (docs/SECURITY.md section 4): stalled when some thread has been inside
// one work item for --stall_timeout with no sample finished on that thread in that time. A
// thread that waits for work is idle, not busy: an idle daemon, or a consumer that holds its
// batches, is never a stall; nor is a thread that waits for other marked threads to finish
// their part of its work (ThreadPool::ParallelFor's caller: Idle). So a batch that is slow
// because a user asked for much work (many large images) is progress, sample by sample; one
// sample that takes the whole window (a read that never returns, a decode that loops) is a
// stall. The cost of one sample is bounded by the decoder's limits (a pixel cap, at most 500
// progressive scans: server/decode/image_decoder.h), the cost of one batch by
// max_batch_time (the session's own problem, DEADLINE_EXCEEDED).
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
  // How long the current item has run at `now` since it started or last made progress; zero
  // while idle.
  absl::Duration BusyFor(absl::Time now) const {
    const int64_t since = since_ns_.load(std::memory_order_relaxed);
    if (since == 0) return absl::ZeroDuration();
    return now - absl::FromUnixNanos(since);
  }

  // Marks the thread busy for its lifetime (one work item): the mark this thread's Progress
  // and Idle act on meanwhile.
  class Scope {
   public:
    explicit Scope(BusyMark& mark) : mark_(mark), outer_(current_) {
      mark_.Start();
      current_ = &mark_;
    }
    ~Scope() {
      mark_.since_ns_.store(0, std::memory_order_relaxed);
      current_ = outer_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    BusyMark& mark_;
    BusyMark* const outer_;
  };

  // The calling thread's work item made progress (a sample done): its mark restarts from
  // now. A no-op on a thread outside any Scope, or idle.
  static void Progress() {
    if (current_ != nullptr && current_->since_ns_.load(std::memory_order_relaxed) != 0) {
      current_->Start();
    }
  }

  // Marks the calling thread idle for its lifetime, within a Scope: it waits for other
  // marked threads (whose marks show a stall of theirs), and restarts from now when done.
  class Idle {
   public:
    Idle() : mark_(current_) {
      if (mark_ != nullptr) mark_->since_ns_.store(0, std::memory_order_relaxed);
    }
    ~Idle() {
      if (mark_ != nullptr) mark_->Start();
    }
    Idle(const Idle&) = delete;
    Idle& operator=(const Idle&) = delete;

   private:
    BusyMark* const mark_;
  };

 private:
  void Start() { since_ns_.store(absl::ToUnixNanos(absl::Now()), std::memory_order_relaxed); }

  const std::string name_;
  std::atomic<int64_t> since_ns_{0};
  // The mark of the Scope the calling thread is in, if any.
  static inline thread_local BusyMark* current_ = nullptr;
};

// The mark busy longest without progress at `now`, when that is `timeout` or more: what the
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
