// The attach queue: fair between uids, one uid's running attaches capped (one uid's
// slow attaches held every attach thread and the others' Attach timed out).
#include "server/service/attach_queue.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Pops one attach and runs it: what it appended to `order`.
std::string PopRun(AttachQueue& q, std::vector<std::string>* order) {
  absl::StatusOr<AttachQueue::Work> w = q.Pop();
  EXPECT_TRUE(w.ok()) << w.status();
  if (!w.ok()) return "";
  w->run();
  return order->back();
}

TEST(AttachQueueTest, UidsTakeTurnsAndOneUidRunsAtMostItsCap) {
  AttachQueue q({.max_queued = 16, .max_queued_per_uid = 8, .max_running_per_uid = 1});
  std::vector<std::string> order;
  auto push = [&](uint32_t uid, const std::string& name, bool capped = true) {
    return q.TryPush(uid, capped, [&order, name] { order.push_back(name); });
  };
  // The attacker's three slow attaches come first, then the victim's.
  ASSERT_TRUE(push(2, "a1").ok());
  ASSERT_TRUE(push(2, "a2").ok());
  ASSERT_TRUE(push(2, "a3").ok());
  ASSERT_TRUE(push(1, "v1").ok());
  absl::StatusOr<AttachQueue::Work> first = q.Pop();  // a1 runs (still running: no Done)
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->uid, 2u);
  // The second thread gets the victim's, though two of the attacker's are older: uid 2 runs
  // its one attach already.
  absl::StatusOr<AttachQueue::Work> second = q.Pop();
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->uid, 1u);
  second->run();
  q.Done(1);
  first->run();
  q.Done(2);
  EXPECT_EQ(PopRun(q, &order), "a2");
  q.Done(2);
  EXPECT_EQ(PopRun(q, &order), "a3");
  q.Done(2);
  EXPECT_THAT(order, ElementsAre("v1", "a1", "a2", "a3"));
  EXPECT_EQ(q.queued(), 0u);
}

TEST(AttachQueueTest, RoundRobinBetweenUidsAndAdminsAreNotCapped) {
  AttachQueue q({.max_queued = 16, .max_queued_per_uid = 8, .max_running_per_uid = 1});
  std::vector<std::string> order;
  for (const char* n : {"x1", "x2"}) {
    ASSERT_TRUE(q.TryPush(7, true, [&order, n] { order.push_back(n); }).ok());
  }
  for (const char* n : {"y1", "y2"}) {
    ASSERT_TRUE(q.TryPush(8, true, [&order, n] { order.push_back(n); }).ok());
  }
  for (const char* n : {"r1", "r2"}) {  // an admin: never waits for its own running ones
    ASSERT_TRUE(q.TryPush(0, false, [&order, n] { order.push_back(n); }).ok());
  }
  // Each Pop without Done: x1, y1, r1, then only the admin may run more (7 and 8 are at cap).
  std::vector<uint32_t> uids;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<AttachQueue::Work> w = q.Pop();
    ASSERT_TRUE(w.ok());
    uids.push_back(w->uid);
    w->run();
  }
  EXPECT_THAT(uids, ElementsAre(7u, 8u, 0u, 0u));
  q.Done(7);
  q.Done(8);
  EXPECT_EQ(PopRun(q, &order), "x2");
  EXPECT_EQ(PopRun(q, &order), "y2");
}

TEST(AttachQueueTest, BoundsNameTheirCapAndCloseDrainsThenFails) {
  AttachQueue q({.max_queued = 3, .max_queued_per_uid = 2, .max_running_per_uid = 1});
  ASSERT_TRUE(q.TryPush(5, true, [] {}).ok());
  ASSERT_TRUE(q.TryPush(5, true, [] {}).ok());
  absl::Status per_uid = q.TryPush(5, true, [] {});
  EXPECT_EQ(per_uid.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(per_uid.message(),
            "uid 5 has 2 attaches waiting already (at most 2 a uid); retry later");
  ASSERT_TRUE(q.TryPush(6, true, [] {}).ok());
  absl::Status total = q.TryPush(7, true, [] {});
  EXPECT_EQ(total.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(total.message(), HasSubstr("3 attaches are waiting already"));
  q.Close();
  EXPECT_EQ(q.TryPush(7, true, [] {}).code(), absl::StatusCode::kUnavailable);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<AttachQueue::Work> w = q.Pop();
    ASSERT_TRUE(w.ok()) << i;
    q.Done(w->uid);
  }
  EXPECT_EQ(q.Pop().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace gpufeed::server
