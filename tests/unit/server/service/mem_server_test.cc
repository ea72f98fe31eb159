// The memory socket on a real socket in a temp dir: open_dataset, and connections served
// concurrently, each within one deadline for the whole request (docs/SECURITY.md section 4).
#include "server/service/mem_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/unix_socket.h"
#include "gmock/gmock.h"
#include "gpufeed/v1/feed.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/eventually.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;

using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

class MemServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(4 << 20, 4 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    SessionManagerOptions options;
    options.threads = 1;
    sessions_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem());
    path_ = dir_.Join("mem.sock");
    tokens_ = dir_.WriteFile("tokens.bin", std::string(2 * 101, 'x'));
  }
  void TearDown() override {
    server_.reset();
    sessions_.reset();
  }

  void Start(MemServerOptions options) {
    absl::StatusOr<std::unique_ptr<MemServer>> server =
        MemServer::Start(path_, sessions_.get(), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  UniqueFd Connect() {
    absl::StatusOr<UniqueFd> conn = ConnectUnix(path_);
    EXPECT_TRUE(conn.ok()) << conn.status();
    if (!conn.ok()) return UniqueFd();
    EXPECT_TRUE(SetSocketTimeout(conn->get(), absl::Seconds(10)).ok());
    return std::move(*conn);
  }

  static v1::MemResponse Reply(int conn) {
    v1::MemResponse reply;
    absl::StatusOr<Frame> frame = RecvFrame(conn, 1 << 16);
    EXPECT_TRUE(frame.ok()) << frame.status();
    if (frame.ok()) {
      EXPECT_TRUE(reply.ParseFromString(frame->bytes));
    }
    return reply;
  }

  // open_dataset with `fd` (or none) on a fresh connection.
  v1::MemResponse OpenDataset(int fd) {
    UniqueFd conn = Connect();
    v1::MemRequest request;
    request.set_open_dataset(true);
    EXPECT_TRUE(SendFrame(conn.get(), request.SerializeAsString(), fd).ok());
    return Reply(conn.get());
  }

  v1::MemResponse OpenTokens() {
    UniqueFd fd(::open(tokens_.c_str(), O_RDONLY | O_CLOEXEC));
    return OpenDataset(fd.get());
  }

  // With two silent connections held, a third is refused at once with `message`; a hang-up
  // of one of them makes room again for a request that is served.
  void ExpectThirdRefusedThenRoom(const std::string& message) {
    UniqueFd a = Connect(), b = Connect();  // silent
    ASSERT_TRUE(Eventually([&] { return server_->active() == 2; }));
    const absl::Time asked = absl::Now();
    UniqueFd c = Connect();
    v1::MemResponse refused = Reply(c.get());
    EXPECT_LT(absl::Now() - asked, absl::Seconds(1));
    EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_EQ(refused.message(), message);
    EXPECT_EQ(server_->active(), 2);
    a.Reset();  // a hang-up ends that connection's wait: room again
    ASSERT_TRUE(Eventually([&] { return server_->active() == 1; }));
    EXPECT_EQ(OpenTokens().code(), 0);
  }

  TempDir dir_;
  std::string path_;
  std::string tokens_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<MemServer> server_;
};

TEST_F(MemServerTest, OpenDatasetGivesAHandleTheSendersAttachUses) {
  Start({});
  v1::MemResponse reply = OpenTokens();
  ASSERT_EQ(reply.code(), 0) << reply.message();
  EXPECT_THAT(reply.dataset_handle(), MatchesRegex("[0-9a-f]{32}"));
  AttachSpec spec;
  spec.caller.cred.uid = ::getuid();  // the memory socket saw this process's uid
  spec.job = "j";
  spec.feed.dataset.kind = DatasetKind::kTokens;
  spec.feed.dataset.path = "/shown/tokens.bin";
  spec.feed.dataset.handle = reply.dataset_handle();
  spec.feed.dataset.token_dtype = DType::kUInt16;
  spec.feed.dataset.seq_len = 10;
  spec.feed.batch_size = 2;
  spec.feed.world_size = 1;
  spec.ring_slots = 2;
  absl::StatusOr<Attachment> attached = sessions_->Attach(spec);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->num_samples, 10u);
  // Another uid cannot spend it (it is spent anyway now).
  spec.caller.cred.uid = ::getuid() + 1;
  spec.feed.dataset.handle = OpenTokens().dataset_handle();
  EXPECT_EQ(sessions_->Attach(spec).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(MemServerTest, OpenDatasetWithoutADescriptorIsInvalidArgument) {
  Start({});
  v1::MemResponse reply = OpenDataset(-1);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(reply.message(), "open_dataset: no descriptor came with the request (SCM_RIGHTS)");
  EXPECT_TRUE(reply.dataset_handle().empty());
}

// A client that dribbles its request one byte at a time is cut off at the deadline for the
// whole request (not per read), and others are served meanwhile.
TEST_F(MemServerTest, ADribblingClientIsCutOffAtTheDeadlineAndDelaysNoOne) {
  Start({.request_timeout = absl::Seconds(1)});
  UniqueFd slow = Connect();
  const absl::Time connected = absl::Now();
  std::atomic<bool> stop{false};
  std::thread dribbler([&] {
    // A frame of 16 bytes, a byte at a time: it would take 6 s.
    const std::string wire = std::string("\x10\x00\x00\x00", 4) + std::string(16, 'x');
    for (size_t i = 0; i < wire.size() && !stop.load(); ++i) {
      if (::send(slow.get(), &wire[i], 1, MSG_NOSIGNAL) != 1) return;
      absl::SleepFor(absl::Milliseconds(300));  // each byte well inside a per-read timeout
    }
  });
  ASSERT_TRUE(Eventually([&] { return server_->active() == 1; }));
  const absl::Time asked = absl::Now();
  v1::MemResponse fast = OpenTokens();
  EXPECT_EQ(fast.code(), 0) << fast.message();
  EXPECT_LT(absl::Now() - asked, absl::Milliseconds(500));

  v1::MemResponse cut = Reply(slow.get());
  const absl::Duration took = absl::Now() - connected;
  stop = true;
  dribbler.join();
  EXPECT_EQ(cut.code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(cut.message(),
            "memory socket: the request did not arrive within 1s (mem_request_timeout)");
  EXPECT_GE(took, absl::Milliseconds(950));
  EXPECT_LT(took, absl::Milliseconds(1800));
  EXPECT_TRUE(Eventually([&] { return server_->active() == 0; }));
}

TEST_F(MemServerTest, ConnectionsPastTheLimitAreRefusedAtOnce) {
  Start({.request_timeout = absl::Seconds(30), .max_connections = 2});
  ExpectThirdRefusedThenRoom("memory socket: 2 connections are being served; retry shortly");
}

// One uid cannot hold every slot: past its share its connections are refused at once, and
// another uid (here: none; root and the daemon's uid are exempt in a daemon) keeps room.
TEST_F(MemServerTest, OneUidGetsAtMostItsShareOfTheConnections) {
  Start({.request_timeout = absl::Seconds(30),
         .max_connections = 8,
         .max_connections_per_uid = 2,
         .exempt_root_and_daemon = false});
  ExpectThirdRefusedThenRoom(
      absl::StrCat("memory socket: uid ", ::geteuid(),
                   " has 2 connections being served, the most one uid may; retry shortly"));
}

TEST_F(MemServerTest, ShutdownDoesNotWaitForSilentClients) {
  Start({.request_timeout = absl::Seconds(60)});
  UniqueFd a = Connect(), b = Connect();
  ASSERT_TRUE(Eventually([&] { return server_->active() == 2; }));
  const absl::Time stopping = absl::Now();
  server_.reset();
  EXPECT_LT(absl::Now() - stopping, absl::Seconds(1));
}

}  // namespace
}  // namespace gpufeed::server
