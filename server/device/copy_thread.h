// A GPU's copy thread: runs posted work in order, and re-runs "later" work after a short poll
// interval without blocking the rest. Later work is how a slot waits for its consumer's
// release: the copy thread asks the release event (a non-blocking query) and, while the
// consumer still reads, puts the slot's work back for the next poll instead of making a CUDA
// stream wait on another process's event. So one consumer that holds its batches (a rank
// stuck in NCCL, a slow job) never stalls the other sessions on its GPU, and nothing the
// daemon enqueues can wait on something it cannot see.
//
// Shared by the CUDA backend and the fake one (tests/testing/fake_device_backend.h), so the
// loop itself is tested without a GPU. Progress (heartbeat) is what the liveness check reads.
#pragma once

#include <pthread.h>

#include <atomic>
#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/bounded_queue.h"
#include "common/progress.h"

namespace gpufeed::server {

class CopyThread {
 public:
  using Work = std::function<void()>;
  static constexpr absl::Duration kPollInterval = absl::Microseconds(100);

  // `init` runs first on the new thread (e.g. cudaSetDevice).
  CopyThread(std::string name, std::function<void()> init = nullptr)
      : name_(std::move(name)), work_(1 << 16), busy_(name_) {
    thread_ = std::thread([this, init = std::move(init)] {
      pthread_setname_np(pthread_self(), name_.substr(0, 15).c_str());
      if (init) init();
      Loop();
    });
  }
  ~CopyThread() { Stop(); }
  CopyThread(const CopyThread&) = delete;
  CopyThread& operator=(const CopyThread&) = delete;

  // Work is never dropped: a session counts it in flight until it runs. Push blocks only
  // while 65536 tasks wait, which the ring depths bound far below. Once stopped, runs inline.
  void Post(Work work) {
    if (work_.Push(work).ok()) return;
    work();
  }
  void PostLater(Work work) {
    {
      absl::MutexLock lock(&later_mu_);
      if (!stopped_) {
        later_.push_back(std::move(work));
        return;
      }
    }
    work();
  }
  // Runs what is queued, then ends the thread. Later work still waiting runs once, inline.
  void Stop() {
    work_.Close(absl::CancelledError("copy thread stopped"));
    if (thread_.joinable()) thread_.join();
    std::deque<Work> left;
    {
      absl::MutexLock lock(&later_mu_);
      stopped_ = true;
      left.swap(later_);
    }
    for (Work& w : left) w();
  }
  const BusyMark& busy() const { return busy_; }

 private:
  void Loop() {
    absl::Time next_poll = absl::InfinitePast();
    while (true) {
      bool waiting;
      {
        absl::MutexLock lock(&later_mu_);
        waiting = !later_.empty();
      }
      absl::StatusOr<Work> work =
          waiting ? work_.PopWithDeadline(std::max(absl::Now(), next_poll)) : work_.Pop();
      if (work.ok()) {
        BusyMark::Scope scope(busy_);
        (*work)();
      } else if (!absl::IsDeadlineExceeded(work.status())) {
        return;  // closed
      }
      if (waiting && absl::Now() >= next_poll) {
        std::deque<Work> due;
        {
          absl::MutexLock lock(&later_mu_);
          due.swap(later_);
        }
        for (Work& w : due) {
          BusyMark::Scope scope(busy_);
          w();
        }
        next_poll = absl::Now() + kPollInterval;
      }
    }
  }

  const std::string name_;
  BoundedQueue<Work> work_;
  absl::Mutex later_mu_;
  std::deque<Work> later_ ABSL_GUARDED_BY(later_mu_);
  bool stopped_ ABSL_GUARDED_BY(later_mu_) = false;
  BusyMark busy_;
  std::thread thread_;  // last: starts once the rest is built
};

}  // namespace gpufeed::server
