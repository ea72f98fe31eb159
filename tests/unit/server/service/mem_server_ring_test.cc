// The memory socket hands a host session exactly its own ring (docs/SECURITY.md section 3):
// the ring's sealed memfd, from offset 0, ring bytes long; never the staging slab.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "common/os/unix_socket.h"
#include "gmock/gmock.h"
#include "gpufeed/v1/feed.pb.h"
#include "gtest/gtest.h"
#include "server/service/mem_server.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

struct Reply {
  v1::MemResponse response;
  UniqueFd fd;
};

class MemServerRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tokens;
    for (uint16_t t = 0; t < 1001; ++t) {
      tokens += static_cast<char>(t & 0xff);
      tokens += static_cast<char>(t >> 8);
    }
    path_ = dir_.WriteFile("tokens.bin", tokens);
    auto pool = StagingPool::Create(4 << 20, 4 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    SessionManagerOptions options;
    options.threads = 2;
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem());
    socket_ = dir_.path() + "/mem.sock";
    auto server = MemServer::Start(socket_, manager_.get());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }

  void TearDown() override {
    server_.reset();
    manager_.reset();  // before the pool
  }

  AttachSpec Spec(int rank) const {
    AttachSpec spec;
    // This process attaches by path as an admin; the memory socket sees the same uid.
    spec.caller.cred.uid = static_cast<uint32_t>(::geteuid());
    spec.caller.admin = true;
    spec.job = "mem";
    spec.rank = rank;
    spec.feed.dataset.kind = DatasetKind::kTokens;
    spec.feed.dataset.path = path_;
    spec.feed.dataset.token_dtype = DType::kUInt16;
    spec.feed.dataset.seq_len = 10;
    spec.feed.batch_size = 4;
    spec.feed.world_size = 2;
    spec.feed.shuffle = false;
    spec.ring_slots = 3;
    return spec;
  }

  // One request on the memory socket, as the client library makes it.
  Reply Ask(uint64_t id, const std::string& token) const {
    Reply reply;
    absl::StatusOr<UniqueFd> conn = ConnectUnix(socket_);
    EXPECT_TRUE(conn.ok()) << conn.status();
    if (!conn.ok()) return reply;
    v1::MemRequest request;
    request.set_session_id(id);
    request.set_token(token);
    EXPECT_TRUE(SendFrame(conn->get(), request.SerializeAsString()).ok());
    absl::StatusOr<Frame> frame = RecvFrame(conn->get(), 1 << 16);
    EXPECT_TRUE(frame.ok()) << frame.status();
    if (!frame.ok()) return reply;
    EXPECT_TRUE(reply.response.ParseFromString(frame->bytes));
    reply.fd = std::move(frame->fd);
    return reply;
  }

  testing::TempDir dir_;
  std::string path_;
  std::string socket_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> manager_;
  std::unique_ptr<MemServer> server_;
};

TEST_F(MemServerRingTest, AHostSessionReceivesExactlyItsOwnRing) {
  const uint64_t free_before = pool_->free_bytes();
  absl::StatusOr<Attachment> a = manager_->Attach(Spec(0));
  absl::StatusOr<Attachment> b = manager_->Attach(Spec(1));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  const uint64_t ring = 3 * a->layout.stride_bytes;  // 3 pages, of a 4 MiB pool

  Reply ra = Ask(a->session_id, a->token);
  Reply rb = Ask(b->session_id, b->token);
  ASSERT_EQ(ra.response.code(), 0) << ra.response.message();
  ASSERT_EQ(rb.response.code(), 0) << rb.response.message();
  ASSERT_TRUE(ra.fd.valid() && rb.fd.valid());
  EXPECT_FALSE(ra.response.device());
  EXPECT_EQ(ra.response.map_offset(), 0u);
  EXPECT_EQ(ra.response.map_bytes(), ring);
  struct stat sa {}, sb {}, slab {};
  ASSERT_EQ(::fstat(ra.fd.get(), &sa), 0);
  ASSERT_EQ(::fstat(rb.fd.get(), &sb), 0);
  ASSERT_EQ(::fstat(pool_->slab_fd(0), &slab), 0);
  EXPECT_EQ(static_cast<uint64_t>(sa.st_size), ring) << "the fd is more than the ring";
  EXPECT_EQ(static_cast<uint64_t>(sb.st_size), ring);
  EXPECT_NE(sa.st_ino, sb.st_ino) << "two sessions share a file";
  EXPECT_NE(sa.st_ino, slab.st_ino) << "the consumer got the staging slab";
  // The consumer cannot widen its file to reach beyond the ring, nor shrink it.
  errno = 0;
  EXPECT_EQ(::ftruncate(ra.fd.get(), static_cast<off_t>(4 << 20)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::ftruncate(ra.fd.get(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(::fcntl(ra.fd.get(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);

  // The client maps it as before (map_offset, map_bytes, shared, writable) and reads its
  // batches: with no shuffle, rank 0's first batch is samples 0..3, token t = t.
  absl::StatusOr<std::shared_ptr<Session>> session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}).ok());
  StreamEvent e;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while ((e = (*session)->NextEvent()).kind == StreamEvent::kNothing && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
  absl::StatusOr<Mapping> m = Mapping::Map(ra.fd.get(), ra.response.map_offset(),
                                           ra.response.map_bytes(), true);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::byte* slot = m->data() + static_cast<uint64_t>(e.batch.slot) * a->layout.stride_bytes;
  for (int row = 0; row < 4; ++row) {
    uint16_t first;
    std::memcpy(&first, slot + a->layout.tensors[0].byte_offset + row * a->layout.tensors[0].row_bytes, 2);
    EXPECT_EQ(first, e.batch.ids[static_cast<size_t>(row)] * 10) << "row " << row;
  }

  // Once detached the ring is handed out no more and its bytes are back in the budget, pages
  // included: the consumer's old mapping reads zeros, never anything of another session.
  const std::string kept(reinterpret_cast<const char*>(slot), a->layout.tensors[0].byte_size);
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  Reply after = Ask(a->session_id, a->token);
  EXPECT_NE(after.response.code(), 0);
  EXPECT_FALSE(after.fd.valid());
  const absl::Time back = absl::Now() + absl::Seconds(5);
  while (pool_->free_bytes() != free_before - ring && absl::Now() < back) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(pool_->free_bytes(), free_before - ring);
  EXPECT_NE(kept, std::string(kept.size(), '\0'));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(slot), kept.size()),
            std::string(kept.size(), '\0'));
}

TEST_F(MemServerRingTest, AWrongTokenGetsNoDescriptor) {
  absl::StatusOr<Attachment> a = manager_->Attach(Spec(0));
  ASSERT_TRUE(a.ok()) << a.status();
  std::string wrong = a->token;
  wrong[0] = wrong[0] == '0' ? '1' : '0';
  Reply r = Ask(a->session_id, wrong);
  EXPECT_EQ(r.response.code(), static_cast<int32_t>(absl::StatusCode::kPermissionDenied));
  EXPECT_FALSE(r.fd.valid());
}

}  // namespace
}  // namespace gpufeed::server
