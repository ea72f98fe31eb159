// A bounded, closable multi-producer multi-consumer queue: every arrow between threads.
//
// Push blocks while the queue is full (backpressure); Pop blocks while it is empty. Close()
// wakes every waiter: later pushes fail with the close status, pops drain what is left and
// then fail with it. Time spent blocked on either side is accumulated, since per-stage stall
// time is a first-class metric.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gpufeed {

template <typename T>
class BoundedQueue {
 public:
  explicit BoundedQueue(size_t capacity) : capacity_(capacity == 0 ? 1 : capacity) {}
  BoundedQueue(const BoundedQueue&) = delete;
  BoundedQueue& operator=(const BoundedQueue&) = delete;

  // Blocks until there is room or the queue is closed; returns the close status then.
  absl::Status Push(T value) {
    absl::MutexLock lock(&mu_);
    if (items_.size() >= capacity_ && status_.ok()) {
      const absl::Time start = absl::Now();
      ++waiters_;
      mu_.Await(absl::Condition(this, &BoundedQueue::CanPush));
      --waiters_;
      push_wait_ += absl::Now() - start;
    }
    if (!status_.ok()) return status_;
    items_.push_back(std::move(value));
    return absl::OkStatus();
  }

  // Never blocks: RESOURCE_EXHAUSTED when full, the close status when closed.
  absl::Status TryPush(T value) { return TryPushBelow(std::move(value), capacity_); }
  // As TryPush, but RESOURCE_EXHAUSTED once `limit` (<= the capacity) items wait: a
  // producer whose items may be dropped leaves the rest of the room to others.
  absl::Status TryPushBelow(T value, size_t limit) {
    absl::MutexLock lock(&mu_);
    if (!status_.ok()) return status_;
    if (items_.size() >= std::min(limit, capacity_)) {
      return absl::ResourceExhaustedError("queue is full");
    }
    items_.push_back(std::move(value));
    return absl::OkStatus();
  }

  // Blocks until an item is there; after Close, returns the remaining items and then the
  // close status.
  absl::StatusOr<T> Pop() { return PopWithDeadline(absl::InfiniteFuture()); }

  // As Pop, but gives up at the deadline with DEADLINE_EXCEEDED.
  absl::StatusOr<T> PopWithDeadline(absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (items_.empty() && status_.ok()) {
      const absl::Time start = absl::Now();
      ++waiters_;
      mu_.AwaitWithDeadline(absl::Condition(this, &BoundedQueue::CanPop), deadline);
      --waiters_;
      pop_wait_ += absl::Now() - start;
    }
    if (!items_.empty()) {
      T value = std::move(items_.front());
      items_.pop_front();
      return value;
    }
    if (!status_.ok()) return status_;
    return absl::DeadlineExceededError("timed out waiting for the queue");
  }

  // Closes with `status` (must not be OK). Idempotent: the first status wins.
  void Close(const absl::Status& status = absl::CancelledError("queue closed")) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = status.ok() ? absl::CancelledError("queue closed") : status;
  }

  size_t size() const {
    absl::MutexLock lock(&mu_);
    return items_.size();
  }
  size_t capacity() const { return capacity_; }
  bool closed() const {
    absl::MutexLock lock(&mu_);
    return !status_.ok();
  }
  // Threads blocked in Push or Pop now: what a test waits on to know a thread really blocked.
  size_t waiters() const {
    absl::MutexLock lock(&mu_);
    return waiters_;
  }
  // Total time producers were blocked on a full queue / consumers on an empty one.
  absl::Duration push_wait() const {
    absl::MutexLock lock(&mu_);
    return push_wait_;
  }
  absl::Duration pop_wait() const {
    absl::MutexLock lock(&mu_);
    return pop_wait_;
  }

 private:
  bool CanPush() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return items_.size() < capacity_ || !status_.ok();
  }
  bool CanPop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !items_.empty() || !status_.ok();
  }

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<T> items_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Duration push_wait_ ABSL_GUARDED_BY(mu_);
  absl::Duration pop_wait_ ABSL_GUARDED_BY(mu_);
  size_t waiters_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed
