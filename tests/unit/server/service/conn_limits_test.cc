// The caps on what a client holds before it works (docs/SECURITY.md section 4): counts per uid
// and in total with admins exempt per uid, connections forgotten once gRPC closed their fds
// (a fake probe here, and fstat on real sockets), unopened streams timed out on time.
#include "server/service/conn_limits.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <set>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

PeerCred Uid(uint32_t uid) {
  PeerCred c;
  c.uid = uid;
  c.gid = uid;
  return c;
}

TEST(UidCapsTest, CapsEachUidAndTheTotalNamingTheField) {
  UidCaps caps("connections", 2, "max_connections_per_uid", 3, "max_connections");
  EXPECT_TRUE(caps.Acquire(1000, false).ok());
  EXPECT_TRUE(caps.Acquire(1000, false).ok());
  absl::Status third = caps.Acquire(1000, false);
  EXPECT_TRUE(absl::IsResourceExhausted(third)) << third;
  EXPECT_THAT(third.message(), HasSubstr("uid 1000 holds 2 connections"));
  EXPECT_THAT(third.message(), HasSubstr("(max_connections_per_uid)"));
  EXPECT_EQ(caps.of(1000), 2);
  EXPECT_TRUE(caps.Acquire(1001, false).ok());
  absl::Status full = caps.Acquire(1002, false);
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_THAT(full.message(), HasSubstr("max_connections: 3 connections are held"));
  EXPECT_EQ(caps.of(1002), 0);
  EXPECT_EQ(caps.total(), 3);
  caps.Release(1000);
  EXPECT_EQ(caps.total(), 2);
  EXPECT_TRUE(caps.Acquire(1002, false).ok());
  caps.Release(4242);  // never acquired: nothing changes
  EXPECT_EQ(caps.total(), 3);
}

TEST(UidCapsTest, AnExemptUidIsCountedButCappedOnlyInTotal) {
  UidCaps caps("connections", 1, "max_connections_per_uid", 3, "max_connections");
  EXPECT_TRUE(caps.Acquire(0, true).ok());
  EXPECT_TRUE(caps.Acquire(0, true).ok());
  EXPECT_TRUE(caps.Acquire(0, true).ok());
  EXPECT_EQ(caps.of(0), 3);
  EXPECT_TRUE(absl::IsResourceExhausted(caps.Acquire(0, true)));
}

// Which (fd, inode) pairs are still open, as the test says.
class FakeFds {
 public:
  ConnectionTable::StillOpen Probe() {
    return [this](int fd, uint64_t inode) {
      absl::MutexLock lock(&mu_);
      ++probes_;
      return open_.count({fd, inode}) > 0;
    };
  }
  void Open(int fd, uint64_t inode) {
    absl::MutexLock lock(&mu_);
    open_.insert({fd, inode});
  }
  void Close(int fd, uint64_t inode) {
    absl::MutexLock lock(&mu_);
    open_.erase({fd, inode});
  }
  int probes() {
    absl::MutexLock lock(&mu_);
    return probes_;
  }

 private:
  absl::Mutex mu_;
  std::set<std::pair<int, uint64_t>> open_ ABSL_GUARDED_BY(mu_);
  int probes_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(ConnectionTableTest, CapsConnectionsAndForgetsThoseClosedSinceOnlyNearTheCap) {
  FakeFds fds;
  ConnectionTable table(2, 3, fds.Probe());
  for (int fd : {10, 11}) {
    fds.Open(fd, 100 + fd);
    ASSERT_TRUE(table.Admit(fd, 100 + fd, Uid(1000), false).ok());
  }
  EXPECT_EQ(fds.probes(), 0);  // nothing checked below the caps
  EXPECT_EQ(table.Lookup(10)->uid, 1000u);
  EXPECT_FALSE(table.Lookup(12).has_value());

  fds.Open(12, 112);
  absl::Status refused = table.Admit(12, 112, Uid(1000), false);
  EXPECT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("max_connections_per_uid: uid 1000 holds 2"));
  EXPECT_FALSE(table.Lookup(12).has_value());
  EXPECT_EQ(fds.probes(), 2);  // both checked: both still open

  // gRPC closed fd 10: the next admission past the cap finds out and takes its place.
  fds.Close(10, 110);
  EXPECT_TRUE(table.Admit(12, 112, Uid(1000), false).ok());
  EXPECT_EQ(table.of(1000), 2);
  EXPECT_FALSE(table.Lookup(10).has_value());

  // The total: another uid takes the last place, then a third uid is refused.
  fds.Open(13, 113);
  EXPECT_TRUE(table.Admit(13, 113, Uid(1001), false).ok());
  fds.Open(14, 114);
  absl::Status full = table.Admit(14, 114, Uid(1002), true);
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_THAT(full.message(), HasSubstr("max_connections"));
  EXPECT_EQ(table.size(), 3);
}

TEST(ConnectionTableTest, AReusedFdNumberReplacesItsEntry) {
  FakeFds fds;
  ConnectionTable table(1, 8, fds.Probe());
  fds.Open(10, 1);
  ASSERT_TRUE(table.Admit(10, 1, Uid(1000), false).ok());
  // gRPC closed fd 10 and the next accept got the number again, another uid's connection.
  fds.Close(10, 1);
  fds.Open(10, 2);
  ASSERT_TRUE(table.Admit(10, 2, Uid(1001), false).ok());
  EXPECT_EQ(table.Lookup(10)->uid, 1001u);
  EXPECT_EQ(table.of(1000), 0);
  EXPECT_EQ(table.size(), 1);
  EXPECT_EQ(table.Sweep(), 0);  // the entry is the live socket's
}

TEST(ConnectionTableTest, FstatTellsAClosedSocketFromOneReusingItsNumber) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, pair), 0);
  struct stat st {};
  ASSERT_EQ(::fstat(pair[0], &st), 0);
  const uint64_t inode = st.st_ino;
  EXPECT_TRUE(ConnectionTable::FstatStillOpen(pair[0], inode));
  EXPECT_FALSE(ConnectionTable::FstatStillOpen(pair[0], inode + 1));
  const int number = pair[0];
  ::close(pair[0]);
  EXPECT_FALSE(ConnectionTable::FstatStillOpen(number, inode));
  // The number reused by another socket: a different inode.
  int again[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, again), 0);
  ASSERT_EQ(again[0], number);
  EXPECT_FALSE(ConnectionTable::FstatStillOpen(number, inode));
  ::close(again[0]);
  ::close(again[1]);
  ::close(pair[1]);
}

TEST(UnopenedStreamsTest, CapsPerUidAndTimesOutThoseNeverOpened) {
  UnopenedStreams streams(2, 4, absl::Milliseconds(300));
  std::atomic<int> timed_out{0};
  absl::Notification second_timed_out;
  const absl::Time start = absl::Now();
  absl::StatusOr<uint64_t> a = streams.Admit(1000, false, [&] { ++timed_out; });
  absl::StatusOr<uint64_t> b = streams.Admit(1000, false, [&] {
    ++timed_out;
    second_timed_out.Notify();
  });
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<uint64_t> c = streams.Admit(1000, false, [] {});
  EXPECT_TRUE(absl::IsResourceExhausted(c.status())) << c.status();
  EXPECT_THAT(c.status().message(), HasSubstr("uid 1000 holds 2 streams waiting for their open "
                                              "message"));
  EXPECT_THAT(c.status().message(), HasSubstr("(max_connections_per_uid)"));
  // Opened in time: its on_timeout never runs.
  EXPECT_TRUE(streams.Remove(*a));
  EXPECT_FALSE(streams.Remove(*a));
  ASSERT_TRUE(second_timed_out.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_EQ(timed_out.load(), 1);
  EXPECT_FALSE(streams.Remove(*b));  // timed out already
  EXPECT_EQ(streams.size(), 0);
  // Its place is free again.
  EXPECT_TRUE(streams.Admit(1000, false, [] {}).ok());
}

TEST(UnopenedStreamsTest, AdminsAreCappedOnlyInTotal) {
  UnopenedStreams streams(1, 3, absl::Seconds(60));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(streams.Admit(0, true, [] {}).ok());
  absl::StatusOr<uint64_t> more = streams.Admit(1000, false, [] {});
  EXPECT_TRUE(absl::IsResourceExhausted(more.status())) << more.status();
  EXPECT_THAT(more.status().message(), HasSubstr("max_connections"));
}

TEST(UnopenedStreamsTest, DestroyedWithStreamsPendingRunsNoTimeout) {
  std::atomic<int> timed_out{0};
  {
    UnopenedStreams streams(8, 8, absl::Milliseconds(200));
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(streams.Admit(1000, false, [&] { ++timed_out; }).ok());
  }
  EXPECT_EQ(timed_out.load(), 0);
}

}  // namespace
}  // namespace gpufeed::server
