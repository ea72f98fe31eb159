#include "common/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <stdexcept>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "spdlog/spdlog.h"

namespace gpufeed {

absl::Status StatusOfException(const std::exception_ptr& e, absl::string_view what) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc& x) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": out of memory (", x.what(), "): the request needs more memory than gpufeedd "
        "can allocate"));
  } catch (const std::length_error& x) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": an allocation larger than any memory (", x.what(), ")"));
  } catch (const std::exception& x) {
    return absl::InternalError(absl::StrCat(what, ": unexpected exception: ", x.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(what, ": unexpected exception of an unknown type"));
  }
}

void LogCaughtException(const absl::Status& status) {
  spdlog::error("caught at a task boundary: {}", status.ToString());
}

ThreadPool::ThreadPool(const std::string& prefix, int threads, size_t capacity)
    : queue_(capacity) {
  threads = std::max(1, threads);
  for (int i = 0; i < threads; ++i) {
    marks_.push_back(std::make_unique<BusyMark>(absl::StrCat(prefix, "/", i)));
  }
  for (int i = 0; i < threads; ++i) {
    BusyMark* mark = marks_[static_cast<size_t>(i)].get();
    workers_.emplace_back([this, mark] {
      pthread_setname_np(pthread_self(), mark->name().substr(0, 15).c_str());
      Loop(*mark);
    });
  }
}

ThreadPool::~ThreadPool() { Shutdown(); }

absl::Status ThreadPool::TrySubmit(Work work) { return queue_.TryPush(std::move(work)); }

void ThreadPool::Loop(BusyMark& mark) {
  while (true) {
    absl::StatusOr<Work> work = queue_.Pop();
    if (!work.ok()) return;  // closed and drained
    BusyMark::Scope busy(mark);
    // The last-resort boundary: a worker never terminates the daemon.
    absl::Status s = CallCatching(mark.name(), [&] {
      (*work)();
      return absl::OkStatus();
    });
    if (!s.ok()) LogCaughtException(s);
  }
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& fn) {
  // Chunks are claimed from a shared counter by the caller and by helpers that idle workers
  // pick up; one that starts late finds no chunk left and returns without touching fn.
  struct Shared {
    std::atomic<int> next{0};
    absl::Mutex mu;
    int done ABSL_GUARDED_BY(mu) = 0;
    int n = 0;
    const std::function<void(int)>* fn = nullptr;
    std::exception_ptr thrown ABSL_GUARDED_BY(mu);  // the first chunk's that threw
  };
  auto shared = std::make_shared<Shared>();
  shared->n = n;
  shared->fn = &fn;
  auto run = [shared] {
    for (int i = shared->next.fetch_add(1); i < shared->n; i = shared->next.fetch_add(1)) {
      std::exception_ptr thrown;
      try {
        (*shared->fn)(i);
      } catch (...) {
        thrown = std::current_exception();  // carried to the caller: done must still count
      }
      BusyMark::Progress();  // a chunk done is progress (common/progress.h)
      absl::MutexLock lock(&shared->mu);
      if (thrown != nullptr && shared->thrown == nullptr) shared->thrown = thrown;
      ++shared->done;
    }
  };
  const int helpers = std::min(n, size()) - 1;
  // Helpers of calls already done stay queued until a worker pops them (and finds nothing
  // to do), so they are kept to half of the queue: submitted work always has the other half.
  for (int h = 0; h < helpers; ++h) {
    if (!queue_.TryPushBelow(run, queue_.capacity() / 2).ok()) break;  // the caller does the rest
  }
  run();
  std::exception_ptr thrown;
  {
    // Every chunk left runs on a helper whose own mark shows its progress (or its stall):
    // the caller, only waiting, is idle meanwhile.
    BusyMark::Idle idle;
    absl::MutexLock lock(&shared->mu);
    shared->mu.Await(absl::Condition(
        +[](Shared* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu) { return s->done == s->n; },
        shared.get()));
    thrown = shared->thrown;
  }
  if (thrown != nullptr) std::rethrow_exception(thrown);  // for the caller's boundary
}

void ThreadPool::Shutdown(const absl::Status& reason) {
  queue_.Close(reason);
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

std::vector<const BusyMark*> ThreadPool::busy_marks() const {
  std::vector<const BusyMark*> out;
  for (const auto& m : marks_) out.push_back(m.get());
  return out;
}

}  // namespace gpufeed
