// common/thread_pool.h: named workers with progress marks, a bounded queue, ParallelFor with
// the caller taking part, Shutdown that runs what is queued.
#include "common/thread_pool.h"

#include <atomic>
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

TEST(ThreadPoolTest, TrySubmitIsBoundedAndShutdownRunsWhatIsQueued) {
  ThreadPool pool("w", 1, 2);
  absl::Notification block;
  std::atomic<int> ran{0};
  ASSERT_TRUE(pool.TrySubmit([&] { block.WaitForNotification(); }).ok());
  // The worker may not have taken the first task yet: fill until refused.
  int queued = 0;
  while (pool.TrySubmit([&] { ++ran; }).ok()) ++queued;
  EXPECT_GE(queued, 1);
  EXPECT_LE(queued, 2);
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

}  // namespace
}  // namespace gpufeed
