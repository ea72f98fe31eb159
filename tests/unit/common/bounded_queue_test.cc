#include "common/bounded_queue.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"

namespace gpufeed {
namespace {

using ::gpufeed::testing::Eventually;
using ::testing::HasSubstr;

// How long a waiter gets to reach its blocking call before we check it has not returned.
// Only ever used to give a thread a chance to (wrongly) finish; never as the success signal.
constexpr absl::Duration kSettle = absl::Milliseconds(50);

TEST(BoundedQueueTest, PopsInFifoOrder) {
  BoundedQueue<int> q(4);
  for (int i = 1; i <= 4; ++i) ASSERT_TRUE(q.Push(i * 10).ok());
  EXPECT_EQ(q.size(), 4u);
  for (int i = 1; i <= 4; ++i) {
    absl::StatusOr<int> v = q.Pop();
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, i * 10);
  }
  EXPECT_EQ(q.size(), 0u);
}

TEST(BoundedQueueTest, ZeroCapacityMeansOne) {
  BoundedQueue<int> q(0);
  EXPECT_EQ(q.capacity(), 1u);
  ASSERT_TRUE(q.TryPush(1).ok());
  EXPECT_EQ(q.TryPush(2).code(), absl::StatusCode::kResourceExhausted);
}

TEST(BoundedQueueTest, MoveOnlyItems) {
  BoundedQueue<std::unique_ptr<std::string>> q(2);
  ASSERT_TRUE(q.Push(std::make_unique<std::string>("a")).ok());
  absl::StatusOr<std::unique_ptr<std::string>> v = q.Pop();
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(**v, "a");
}

TEST(BoundedQueueTest, TryPushOnFullIsResourceExhausted) {
  BoundedQueue<int> q(2);
  ASSERT_TRUE(q.TryPush(1).ok());
  ASSERT_TRUE(q.TryPush(2).ok());
  const absl::Status s = q.TryPush(3);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("full"));
  EXPECT_EQ(q.size(), 2u);
  // The rejected item was not queued: the queue still yields exactly 1, 2.
  EXPECT_EQ(*q.Pop(), 1);
  EXPECT_EQ(*q.Pop(), 2);
  EXPECT_EQ(q.PopWithDeadline(absl::Now()).status().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(BoundedQueueTest, TryPushOnClosedReturnsCloseStatus) {
  BoundedQueue<int> q(2);
  q.Close(absl::AbortedError("gone"));
  const absl::Status s = q.TryPush(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(), "gone");
}

TEST(BoundedQueueTest, PushBlocksWhenFullUntilPop) {
  BoundedQueue<int> q(1);
  ASSERT_TRUE(q.Push(1).ok());
  absl::Notification started;
  absl::Notification pushed;
  absl::Status push_status;
  std::thread producer([&] {
    started.Notify();
    push_status = q.Push(2);
    pushed.Notify();
  });
  started.WaitForNotification();
  EXPECT_FALSE(pushed.WaitForNotificationWithTimeout(kSettle))
      << "Push into a full queue returned without a Pop";
  absl::StatusOr<int> first = q.Pop();
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 1);
  ASSERT_TRUE(pushed.WaitForNotificationWithTimeout(absl::Seconds(5)));
  producer.join();
  EXPECT_TRUE(push_status.ok()) << push_status;
  EXPECT_EQ(*q.Pop(), 2);
  // The producer's blocked time was accounted.
  EXPECT_GT(q.push_wait(), absl::ZeroDuration());
  EXPECT_EQ(q.pop_wait(), absl::ZeroDuration());
}

TEST(BoundedQueueTest, PopBlocksWhenEmptyUntilPush) {
  BoundedQueue<int> q(1);
  absl::Notification started;
  absl::Notification popped;
  absl::StatusOr<int> got;
  std::thread consumer([&] {
    started.Notify();
    got = q.Pop();
    popped.Notify();
  });
  started.WaitForNotification();
  EXPECT_FALSE(popped.WaitForNotificationWithTimeout(kSettle));
  ASSERT_TRUE(q.Push(7).ok());
  ASSERT_TRUE(popped.WaitForNotificationWithTimeout(absl::Seconds(5)));
  consumer.join();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 7);
  EXPECT_GT(q.pop_wait(), absl::ZeroDuration());
  EXPECT_EQ(q.push_wait(), absl::ZeroDuration());
}

TEST(BoundedQueueTest, WaitTimesStayZeroWithoutBlocking) {
  BoundedQueue<int> q(2);
  ASSERT_TRUE(q.Push(1).ok());
  ASSERT_TRUE(q.Pop().ok());
  EXPECT_EQ(q.push_wait(), absl::ZeroDuration());
  EXPECT_EQ(q.pop_wait(), absl::ZeroDuration());
}

TEST(BoundedQueueTest, CloseWakesBlockedPop) {
  BoundedQueue<int> q(1);
  absl::Notification done;
  absl::StatusOr<int> got;
  std::thread consumer([&] {
    got = q.Pop();
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kSettle));
  q.Close(absl::UnavailableError("shutting down"));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  consumer.join();
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(got.status().message(), "shutting down");
  EXPECT_GT(q.pop_wait(), absl::ZeroDuration());
}

TEST(BoundedQueueTest, CloseWakesBlockedPush) {
  BoundedQueue<int> q(1);
  ASSERT_TRUE(q.Push(1).ok());
  absl::Notification done;
  absl::Status push_status;
  std::thread producer([&] {
    push_status = q.Push(2);
    done.Notify();
  });
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(kSettle));
  q.Close(absl::UnavailableError("shutting down"));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  producer.join();
  EXPECT_EQ(push_status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(push_status.message(), "shutting down");
  // The woken push did not sneak its item in.
  EXPECT_EQ(q.size(), 1u);
  EXPECT_GT(q.push_wait(), absl::ZeroDuration());
}

TEST(BoundedQueueTest, PopsDrainAfterCloseThenReturnCloseStatus) {
  BoundedQueue<int> q(3);
  ASSERT_TRUE(q.Push(1).ok());
  ASSERT_TRUE(q.Push(2).ok());
  q.Close(absl::DataLossError("eof"));
  EXPECT_TRUE(q.closed());
  const absl::Status late = q.Push(3);
  EXPECT_EQ(late.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(*q.Pop(), 1);
  EXPECT_EQ(*q.PopWithDeadline(absl::Now()), 2);
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<int> v = q.Pop();
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_EQ(v.status().message(), "eof");
  }
  // A closed, drained queue reports the close status, not a timeout, even at a past deadline.
  EXPECT_EQ(q.PopWithDeadline(absl::InfinitePast()).status().code(), absl::StatusCode::kDataLoss);
}

TEST(BoundedQueueTest, PopWithDeadlineTimesOut) {
  BoundedQueue<int> q(1);
  const absl::Time start = absl::Now();
  absl::StatusOr<int> v = q.PopWithDeadline(start + absl::Milliseconds(30));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  EXPECT_GE(q.pop_wait(), absl::Milliseconds(25));
  EXPECT_FALSE(q.closed());
  // The queue still works afterwards.
  ASSERT_TRUE(q.Push(5).ok());
  EXPECT_EQ(*q.PopWithDeadline(absl::Now() + absl::Seconds(1)), 5);
}

TEST(BoundedQueueTest, FirstCloseStatusWins) {
  BoundedQueue<int> q(1);
  q.Close(absl::UnavailableError("first"));
  q.Close(absl::InternalError("second"));
  q.Close();
  const absl::Status s = q.Push(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "first");
  EXPECT_EQ(q.Pop().status().message(), "first");
}

TEST(BoundedQueueTest, CloseWithOkStatusBecomesCancelled) {
  BoundedQueue<int> q(1);
  q.Close(absl::OkStatus());
  EXPECT_TRUE(q.closed());
  EXPECT_EQ(q.Pop().status().code(), absl::StatusCode::kCancelled);
}

TEST(BoundedQueueTest, DefaultCloseIsCancelled) {
  BoundedQueue<int> q(1);
  q.Close();
  EXPECT_EQ(q.Push(1).code(), absl::StatusCode::kCancelled);
}

// Close wakes every thread blocked in Pop (an empty queue) and in Push (a full one), once
// they are all known to be blocked, and at once (not at the pops' deadline).
TEST(BoundedQueueTest, CloseWakesEveryWaiter) {
  constexpr int kWaiters = 4;
  BoundedQueue<int> empty(1);
  BoundedQueue<int> full(1);
  ASSERT_TRUE(full.Push(0).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::atomic<int> popped_aborted{0};
  std::atomic<int> pushed_aborted{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kWaiters; ++i) {
    threads.emplace_back([&] {
      if (empty.PopWithDeadline(deadline).status().code() == absl::StatusCode::kAborted) {
        ++popped_aborted;
      }
    });
    threads.emplace_back([&] {
      if (full.Push(1).code() == absl::StatusCode::kAborted) ++pushed_aborted;
    });
  }
  ASSERT_TRUE(Eventually([&] { return empty.waiters() == kWaiters && full.waiters() == kWaiters; }))
      << empty.waiters() << " pops and " << full.waiters() << " pushes blocked";
  empty.Close(absl::AbortedError("stop"));
  full.Close(absl::AbortedError("stop"));
  const bool woken = Eventually([&] { return empty.waiters() == 0 && full.waiters() == 0; });
  // Whatever Close did: taking the full queue's item unblocks its pushers and the pops end at
  // their deadline, so the joins end and a waiter left blocked fails the test, not hangs it.
  (void)full.Pop();
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(woken) << "Close left waiters blocked";
  EXPECT_EQ(popped_aborted.load(), kWaiters);
  EXPECT_EQ(pushed_aborted.load(), kWaiters);
}

TEST(BoundedQueueTest, MultiProducerMultiConsumerDeliversEachItemExactlyOnce) {
  constexpr int kProducers = 4;
  constexpr int kConsumers = 4;
  constexpr int kPerProducer = 5000;
  BoundedQueue<int> q(8);  // small: producers block often
  std::vector<std::vector<int>> received(kConsumers);
  std::vector<std::thread> consumers;
  for (int c = 0; c < kConsumers; ++c) {
    consumers.emplace_back([&q, &received, c] {
      while (true) {
        absl::StatusOr<int> v = q.Pop();
        if (!v.ok()) {
          EXPECT_EQ(v.status().code(), absl::StatusCode::kCancelled);
          return;
        }
        received[c].push_back(*v);
      }
    });
  }
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&q, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        ASSERT_TRUE(q.Push(p * kPerProducer + i).ok());
      }
    });
  }
  for (std::thread& t : producers) t.join();
  q.Close();  // consumers drain what is left, then stop
  for (std::thread& t : consumers) t.join();

  std::vector<int> all;
  for (int c = 0; c < kConsumers; ++c) {
    // Items of one producer reach one consumer in the order they were pushed.
    std::vector<int> last(kProducers, -1);
    for (int v : received[c]) {
      const int p = v / kPerProducer;
      EXPECT_GT(v, last[p]);
      last[p] = v;
    }
    all.insert(all.end(), received[c].begin(), received[c].end());
  }
  std::sort(all.begin(), all.end());
  ASSERT_EQ(all.size(), static_cast<size_t>(kProducers * kPerProducer));
  for (int i = 0; i < kProducers * kPerProducer; ++i) {
    ASSERT_EQ(all[static_cast<size_t>(i)], i) << "missing or duplicated item near " << i;
  }
}

}  // namespace
}  // namespace gpufeed
