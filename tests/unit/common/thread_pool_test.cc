// common/thread_pool.h: named workers with progress marks, a bounded queue, ParallelFor with
// the caller taking part, Shutdown that runs what is queued.
#include "common/thread_pool.h"

#include <atomic>
#include <new>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace gpufeed {
namespace {

TEST(ThreadPoolTest, WorkersAreNamedAndMarkTheItemTheyRun) {
  ThreadPool pool("read", 2, 8);
  ASSERT_EQ(pool.size(), 2);
  std::vector<const BusyMark*> marks = pool.busy_marks();
  EXPECT_EQ(marks[0]->name(), "read/0");
  EXPECT_EQ(marks[1]->name(), "read/1");
  absl::Notification started, finish;
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    finish.WaitForNotification();
  }).ok());
  started.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(10));
  const absl::Time now = absl::Now();
  EXPECT_GE(std::max(marks[0]->BusyFor(now), marks[1]->BusyFor(now)), absl::Milliseconds(10));
  finish.Notify();
}

// docs/SECURITY.md section 4: liveness counts from a thread's last progress, not from the
// start of its item, and a ParallelFor caller waiting for its helpers is idle.
TEST(ThreadPoolTest, ProgressRestartsTheMarkAndAWaitingCallerIsIdle) {
  ThreadPool pool("read", 2, 8);
  std::vector<const BusyMark*> marks = pool.busy_marks();
  auto longest = [&] {
    const absl::Time now = absl::Now();
    return std::max(marks[0]->BusyFor(now), marks[1]->BusyFor(now));
  };
  absl::Notification started, progressed, finish;
  ASSERT_TRUE(pool.TrySubmit([&] {
                    started.Notify();
                    absl::SleepFor(absl::Milliseconds(200));
                    BusyMark::Progress();  // a sample done
                    progressed.Notify();
                    finish.WaitForNotification();
                  })
                  .ok());
  started.WaitForNotification();
  progressed.WaitForNotification();
  // 200 ms in the item, but progress just now.
  EXPECT_LT(longest(), absl::Milliseconds(150));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_GE(longest(), absl::Milliseconds(50));
  finish.Notify();
  BusyMark::Progress();  // outside any item: a no-op

  // A caller (on a worker) whose helper runs a long chunk: the caller finishes its own chunk
  // (once the helper has taken the other) and waits, idle; only the helper's mark counts.
  absl::Notification helper_started, caller_waits, release;
  ASSERT_TRUE(pool.TrySubmit([&] {
                    const std::thread::id me = std::this_thread::get_id();
                    pool.ParallelFor(2, [&](int) {
                      if (std::this_thread::get_id() == me) {
                        helper_started.WaitForNotificationWithTimeout(absl::Seconds(5));
                        caller_waits.Notify();
                        return;
                      }
                      helper_started.Notify();
                      release.WaitForNotification();
                    });
                  })
                  .ok());
  caller_waits.WaitForNotification();
  ASSERT_TRUE(helper_started.HasBeenNotified());
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time now = absl::Now();
  const absl::Duration a = marks[0]->BusyFor(now), b = marks[1]->BusyFor(now);
  EXPECT_GE(std::max(a, b), absl::Milliseconds(250)) << a << " " << b;  // the helper
  EXPECT_LT(std::min(a, b), absl::Milliseconds(100)) << a << " " << b;  // the caller, waiting
  release.Notify();
}

TEST(ThreadPoolTest, TrySubmitIsBoundedAndShutdownRunsWhatIsQueued) {
  ThreadPool pool("w", 1, 2);
  absl::Notification block, started;
  std::atomic<int> ran{0};
  ASSERT_TRUE(pool.TrySubmit([&] {
    started.Notify();
    block.WaitForNotification();
  }).ok());
  // Once the worker holds the first task, exactly `capacity` more fit.
  started.WaitForNotification();
  int queued = 0;
  while (pool.TrySubmit([&] { ++ran; }).ok()) ++queued;
  EXPECT_EQ(queued, 2);
  EXPECT_EQ(pool.TrySubmit([] {}).code(), absl::StatusCode::kResourceExhausted);
  block.Notify();
  pool.Shutdown(absl::UnavailableError("stop"));
  EXPECT_EQ(ran, queued);
  EXPECT_EQ(pool.TrySubmit([] {}).code(), absl::StatusCode::kUnavailable);
}

TEST(ThreadPoolTest, ParallelForRunsEveryIndexOnceEvenWithEveryWorkerBusy) {
  ThreadPool pool("w", 2, 64);
  std::vector<std::atomic<int>> hits(100);
  pool.ParallelFor(100, [&](int i) { ++hits[static_cast<size_t>(i)]; });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  // Both workers blocked: the caller alone finishes every chunk.
  absl::Notification block;
  ASSERT_TRUE(pool.TrySubmit([&] { block.WaitForNotification(); }).ok());
  ASSERT_TRUE(pool.TrySubmit([&] { block.WaitForNotification(); }).ok());
  std::vector<std::atomic<int>> again(50);
  pool.ParallelFor(50, [&](int i) { ++again[static_cast<size_t>(i)]; });
  for (auto& h : again) EXPECT_EQ(h.load(), 1);
  block.Notify();
}

// Helpers a ParallelFor left queued (every worker busy, the caller did the chunks) stay
// until a worker pops them; they must not take the room a caller bounded its own tasks by
// (the session manager ends a session whose fill cannot be queued).
TEST(ThreadPoolTest, ParallelForHelpersLeaveHalfTheQueueToSubmittedWork) {
  ThreadPool pool("read", 4, 8);
  absl::Notification finish;
  std::atomic<int> started{0};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(pool.TrySubmit([&] {
                      started.fetch_add(1);
                      finish.WaitForNotification();
                    })
                    .ok());
  }
  while (started.load() < 4) absl::SleepFor(absl::Milliseconds(1));
  std::atomic<int> ran{0};
  // Up to 3 helpers a call: without the cap, helpers alone would fill the 8.
  for (int call = 0; call < 5; ++call) {
    pool.ParallelFor(4, [&](int) { ran.fetch_add(1); });
  }
  EXPECT_EQ(ran.load(), 20);          // the caller ran every chunk
  EXPECT_EQ(pool.queue_depth(), 4u);  // helpers: half of the 8
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(pool.TrySubmit([] {}).ok()) << i;
  EXPECT_EQ(pool.TrySubmit([] {}).code(), absl::StatusCode::kResourceExhausted);
  finish.Notify();
}

// Exceptions stop at the boundaries (docs/SECURITY.md §4).
TEST(ThreadPoolTest, StatusOfExceptionMapsOutOfMemoryToResourceExhausted) {
  auto status_of = [](auto thrown) {
    return CallCatching("filling", [&]() -> absl::Status { throw thrown; });
  };
  const absl::Status oom = status_of(std::bad_alloc());
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(oom.message(), "filling: out of memory (std::bad_alloc): the request needs more "
                           "memory than gpufeedd can allocate");
  const absl::Status huge = status_of(std::length_error("vector::_M_default_append"));
  EXPECT_EQ(huge.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(huge.message(),
            "filling: an allocation larger than any memory (vector::_M_default_append)");
  const absl::Status other = status_of(std::out_of_range("index 7"));
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(other.message(), "filling: unexpected exception: index 7");
  const absl::Status odd = status_of(42);
  EXPECT_EQ(odd.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(odd.message(), "filling: unexpected exception of an unknown type");
  // Values pass through; StatusOr too.
  absl::StatusOr<int> seven = CallCatching("x", [] { return absl::StatusOr<int>(7); });
  EXPECT_EQ(*seven, 7);
}

TEST(ThreadPoolTest, ATaskThatThrowsDoesNotEndItsWorker) {
  ThreadPool pool("w", 1, 8);
  ASSERT_TRUE(pool.TrySubmit([] { throw std::bad_alloc(); }).ok());
  ASSERT_TRUE(pool.TrySubmit([] { throw std::runtime_error("boom"); }).ok());
  absl::Notification ran;
  ASSERT_TRUE(pool.TrySubmit([&] { ran.Notify(); }).ok());
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(ThreadPoolTest, ParallelForCarriesAThrowToTheCallerAfterEveryChunkRan) {
  ThreadPool pool("w", 2, 64);
  std::vector<std::atomic<int>> hits(64);
  try {
    pool.ParallelFor(64, [&](int i) {
      ++hits[static_cast<size_t>(i)];
      if (i % 8 == 3) throw std::runtime_error("chunk");
    });
    ADD_FAILURE() << "ParallelFor returned normally";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "chunk");
  }
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);  // every chunk ran once, none was lost
  // The workers still serve.
  std::atomic<int> after{0};
  pool.ParallelFor(16, [&](int) { ++after; });
  EXPECT_EQ(after.load(), 16);
}

}  // namespace
}  // namespace gpufeed
