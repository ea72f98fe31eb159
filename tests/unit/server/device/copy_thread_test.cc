// The GPU copy thread's loop (server/device/copy_thread.h), shared by the CUDA and the fake
// backend: later work is polled without holding up posted work, progress marks say when an
// item runs, and nothing is dropped at Stop.
#include "server/device/copy_thread.h"

#include <atomic>
#include <functional>
#include <memory>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;

TEST(CopyThreadTest, LaterWorkIsPolledWhilePostedWorkRuns) {
  CopyThread thread("h2d/test");
  std::atomic<bool> released{false};
  std::atomic<int> polls{0}, ran{0}, posted{0};
  // A slot waiting for its consumer: re-posts itself until released, as Session::CopyOne does.
  std::function<void()> wait_for_release = [&] {
    if (!released) {
      ++polls;
      thread.PostLater(wait_for_release);
      return;
    }
    ++ran;
  };
  thread.Post(wait_for_release);
  // Other sessions' work goes on meanwhile.
  for (int i = 0; i < 100; ++i) thread.Post([&] { ++posted; });
  ASSERT_TRUE(Eventually([&] { return posted == 100 && polls >= 3; }));
  EXPECT_EQ(ran, 0);
  released = true;
  ASSERT_TRUE(Eventually([&] { return ran == 1; }));
  const int polls_at_release = polls;
  absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(polls, polls_at_release) << "nothing polls once the work has run";
}

TEST(CopyThreadTest, ProgressMarkShowsTheRunningItemOnly) {
  CopyThread thread("h2d/test");
  EXPECT_EQ(thread.busy().name(), "h2d/test");
  EXPECT_EQ(thread.busy().BusyFor(absl::Now()), absl::ZeroDuration());
  absl::Notification started, finish;
  thread.Post([&] {
    started.Notify();
    finish.WaitForNotification();
  });
  started.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_GE(thread.busy().BusyFor(absl::Now()), absl::Milliseconds(20));
  finish.Notify();
  ASSERT_TRUE(Eventually([&] { return thread.busy().BusyFor(absl::Now()) == absl::ZeroDuration(); }));
  // Waiting for work is idle, not busy.
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(thread.busy().BusyFor(absl::Now()), absl::ZeroDuration());
}

TEST(CopyThreadTest, StopRunsQueuedWorkAndLaterWorkOnceThenRunsInline) {
  auto thread = std::make_unique<CopyThread>("h2d/test");
  std::atomic<int> later_runs{0}, posted{0};
  absl::Notification block;
  thread->Post([&] { block.WaitForNotification(); });
  thread->Post([&] { ++posted; });
  thread->PostLater([&] { ++later_runs; });
  block.Notify();
  thread->Stop();
  EXPECT_EQ(posted, 1);
  EXPECT_EQ(later_runs, 1);
  // After Stop, work runs on the caller's thread: never dropped.
  thread->Post([&] { ++posted; });
  thread->PostLater([&] { ++later_runs; });
  EXPECT_EQ(posted, 2);
  EXPECT_EQ(later_runs, 2);
}

}  // namespace
}  // namespace gpufeed::server
