// A fixed pool of named worker threads over one bounded, closable queue, with a progress mark
// per worker (common/progress.h) and a ParallelFor in which the caller takes part. The fill
// workers of the daemon ("read/N") are one.
//
// Exceptions stop at the boundaries (docs/SECURITY.md §4): our code throws none, but the
// standard library does (std::bad_alloc from a request that asks for too much). CallCatching
// turns one into a status where a request's work begins (a fill, an Attach, a stream
// reaction), so the request fails and the daemon does not terminate.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/bounded_queue.h"
#include "common/progress.h"

namespace gpufeed {

// The status of exception `e`, caught while doing `what` ("filling epoch 3 step 7"):
// RESOURCE_EXHAUSTED for std::bad_alloc and std::length_error (an allocation larger than
// memory), INTERNAL for anything else; the message names `what` and the exception's what().
absl::Status StatusOfException(const std::exception_ptr& e, absl::string_view what);
// One error line for a status StatusOfException made.
void LogCaughtException(const absl::Status& status);

// fn() (returning absl::Status or absl::StatusOr<T>), with any exception it throws turned into
// StatusOfException's status, logged once (error level) when `log`.
template <typename F>
auto CallCatching(absl::string_view what, F&& fn, bool log = false) -> decltype(fn()) {
  try {
    return fn();
  } catch (...) {
    absl::Status s = StatusOfException(std::current_exception(), what);
    if (log) LogCaughtException(s);
    return s;
  }
}

class ThreadPool {
 public:
  using Work = std::function<void()>;
  // `threads` workers named "<prefix>/<i>"; at most `capacity` tasks wait.
  ThreadPool(const std::string& prefix, int threads, size_t capacity);
  ~ThreadPool();  // Shutdown
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Never blocks: RESOURCE_EXHAUSTED when `capacity` tasks wait, the close status once shut
  // down. ParallelFor's helpers never take more than half of `capacity`: the other half is
  // TrySubmit's whatever ParallelFor calls left behind (a caller bounding its own tasks sizes
  // the pool at twice that bound). A task that throws is the last-resort boundary: the
  // exception is logged (one line) and the worker goes on; work that must report failure
  // catches its own (CallCatching).
  absl::Status TrySubmit(Work work);
  // Runs fn(0..n-1) with the help of idle workers, the caller taking part; returns when all
  // are done. The caller alone can finish every chunk, so helpers queued behind busy workers
  // cost nothing and the call never waits for a worker to become free. An exception thrown by
  // fn on any thread is carried to the caller and rethrown there once every chunk is done
  // (the other chunks still run), for the caller's boundary (CallCatching) to decide.
  void ParallelFor(int n, const std::function<void(int)>& fn);
  // Closes the queue with `reason`, runs what is queued, joins the workers. Idempotent.
  void Shutdown(const absl::Status& reason = absl::CancelledError("thread pool shut down"));

  bool closed() const { return queue_.closed(); }
  size_t queue_depth() const { return queue_.size(); }
  int size() const { return static_cast<int>(marks_.size()); }
  std::vector<const BusyMark*> busy_marks() const;

 private:
  void Loop(BusyMark& mark);

  BoundedQueue<Work> queue_;
  std::vector<std::unique_ptr<BusyMark>> marks_;  // one per worker, made before they start
  std::vector<std::thread> workers_;
};

}  // namespace gpufeed
