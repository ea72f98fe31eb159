// The C++ client's Session against an in-process daemon (tests/testing/test_daemon.h): where
// the consumer is, where the daemon is, and a batch's wait when both slots are held.
#include <cstdint>
#include <string>
#include <vector>

#include "gpufeed/client.h"
#include "gtest/gtest.h"
#include "tests/testing/test_daemon.h"

namespace gpufeed::client {
namespace {

using ::gpufeed::testing::TestDaemon;
using ::gpufeed::testing::TestDaemonOptions;

// 41 uint16 tokens: (41 - 1) / 4 = 10 samples of seq_len 4; batches of 2, 5 a epoch.
class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(TestDaemonOptions());
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    options_.job = "session";
    options_.kind = "tokens";
    options_.dataset = daemon_->dir().WriteFile("tokens.bin", std::string(41 * 2, '\1'));
    options_.token_dtype = "uint16";
    options_.seq_len = 4;
    options_.batch_size = 2;
    options_.shuffle = false;
    options_.ring_slots = 2;
  }

  std::unique_ptr<TestDaemon> daemon_;
  AttachOptions options_;
};

// With both slots held the daemon can fill no more: it has delivered exactly two batches, the
// consumer stands before the third, and Next waits out its timeout.
TEST_F(SessionTest, BothPositionsAndTheWaitWhileEverySlotIsHeld) {
  absl::StatusOr<std::unique_ptr<Session>> session = daemon_->Attach(options_);
  ASSERT_TRUE(session.ok()) << session.status();
  Session& s = **session;
  EXPECT_EQ(s.info().steps_per_epoch, 5);
  EXPECT_EQ(s.position().epoch, 0);
  EXPECT_EQ(s.position().step, 0);
  EXPECT_FALSE(s.reconnecting());
  std::vector<Batch> held;
  for (int64_t step = 0; step < 2; ++step) {
    absl::StatusOr<Batch> batch = s.Next(absl::Seconds(10));
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->step(), step);
    EXPECT_TRUE(batch->WaitReady().ok());  // host memory: nothing to wait for
    held.push_back(*std::move(batch));
  }
  absl::StatusOr<Batch> none = s.Next(absl::Milliseconds(50));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(none.status().message(), "no batch within 50ms");
  EXPECT_FALSE(s.reconnecting());  // a slow daemon is no lost one
  const Position here = s.position();
  EXPECT_EQ(here.epoch, 0);
  EXPECT_EQ(here.step, 2);
  EXPECT_FALSE(here.fingerprint.empty());
  absl::StatusOr<Position> there = s.DaemonPosition();
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->epoch, 0);
  EXPECT_EQ(there->step, 2);
  EXPECT_EQ(there->fingerprint, here.fingerprint);
  // One released: the daemon fills it with step 2 and is then one ahead of the consumer.
  held[0].Release();
  absl::StatusOr<Batch> third = s.Next(absl::Seconds(10));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->step(), 2);
  EXPECT_EQ(s.position().step, 3);
  there = s.DaemonPosition();
  ASSERT_TRUE(there.ok()) << there.status();
  EXPECT_EQ(there->step, 3);
}

// After the session detached (its batches released), the daemon knows it no more.
TEST_F(SessionTest, TheDaemonsPositionOfADetachedSessionIsNotFound) {
  absl::StatusOr<std::unique_ptr<Session>> session = daemon_->Attach(options_);
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->Detach().ok());
  ASSERT_TRUE((*session)->Detach().ok());  // idempotent
  absl::StatusOr<Position> there = (*session)->DaemonPosition();
  EXPECT_EQ(there.status().code(), absl::StatusCode::kNotFound) << there.status();
  EXPECT_EQ(there.status().message().substr(0, 10), "position: ");
}

}  // namespace
}  // namespace gpufeed::client
