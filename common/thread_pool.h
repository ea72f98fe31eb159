// A fixed pool of named worker threads over one bounded, closable queue, with a progress mark
// per worker (common/progress.h) and a ParallelFor in which the caller takes part. The fill
// workers of the daemon ("read/N") are one.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/bounded_queue.h"
#include "common/progress.h"

namespace gpufeed {

class ThreadPool {
 public:
  using Work = std::function<void()>;
  // `threads` workers named "<prefix>/<i>"; at most `capacity` tasks wait.
  ThreadPool(const std::string& prefix, int threads, size_t capacity);
  ~ThreadPool();  // Shutdown
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Never blocks: RESOURCE_EXHAUSTED when `capacity` tasks wait, the close status once shut
  // down.
  absl::Status TrySubmit(Work work);
  // Runs fn(0..n-1) with the help of idle workers, the caller taking part; returns when all
  // are done. The caller alone can finish every chunk, so helpers queued behind busy workers
  // cost nothing and the call never waits for a worker to become free.
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
