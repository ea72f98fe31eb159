// Bounded cost through the session manager (docs/SECURITY.md §4): the ids budget charged at
// Attach and returned with the session, the sample cap, start.epoch's bound, and an exception
// in a fill ending that session only.
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/eventually.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wrapping_file_system.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;

using ::testing::ContainsRegex;
using ::testing::HasSubstr;

// The real file system, whose reads of sample data (past the first bytes) throw
// std::bad_alloc while `throw_reads` is set.
class ThrowingFileSystem final : public ::gpufeed::testing::WrappingFileSystem {
 public:
  ThrowingFileSystem() : WrappingFileSystem(PosixFileSystem()) {}
  std::atomic<bool> throw_reads{false};

 private:
  void OnRead(const RandomAccessFile& file, uint64_t, std::span<std::byte> dst) override {
    if (dst.size() < file.size() && throw_reads.load()) throw std::bad_alloc();
  }
};

// The next event other than kNothing, polling up to 5 s.
StreamEvent NextEvent(Session& session) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  StreamEvent event = session.NextEvent();
  while (event.kind == StreamEvent::kNothing && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
    event = session.NextEvent();
  }
  return event;
}

class BoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tokens(2 * 1001, '\x01');  // 1001 uint16 tokens, seq_len 10: 100 samples
    path_ = dir_.WriteFile("tokens.bin", tokens);
    absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(4 << 20, 4 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
  }
  void TearDown() override { manager_.reset(); }

  void Start(SessionManagerOptions options = {}) {
    options.threads = 2;
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), &fs_);
  }

  AttachSpec Spec(const std::string& job) const {
    AttachSpec spec;
    spec.caller.admin = true;  // attach by path, as an admin (docs/SECURITY.md 2)
    spec.job = job;
    spec.feed.dataset.kind = DatasetKind::kTokens;
    spec.feed.dataset.path = path_;
    spec.feed.dataset.token_dtype = DType::kUInt16;
    spec.feed.dataset.seq_len = 10;
    spec.feed.batch_size = 4;
    spec.feed.world_size = 1;
    spec.ring_slots = 2;
    return spec;
  }

  std::shared_ptr<Session> Find(const Attachment& a) {
    absl::StatusOr<std::shared_ptr<Session>> s = manager_->Find(a.session_id, a.token);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }

  gpufeed::testing::TempDir dir_;
  std::string path_;
  ThrowingFileSystem fs_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> manager_;
};

TEST_F(BoundsTest, TheIdsBudgetIsChargedAtAttachAndReturnedWhenTheSessionEnds) {
  SessionManagerOptions options;
  options.max_ids_bytes = 4 * 2 * 8 + 10;  // one session of batch 4, 2 slots
  Start(options);
  absl::StatusOr<Attachment> a = manager_->Attach(Spec("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(manager_->ids_bytes_in_use(), 64u);
  absl::StatusOr<Attachment> b = manager_->Attach(Spec("b"));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b.status().message(),
            "sample ids of 2 slots x 4 rows need 64 bytes; 64 of max_ids_bytes 74 are in use: "
            "lower batch_size or ring_slots, or retry later");
  EXPECT_EQ(manager_->num_sessions(), 1);
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  // Returned once the session (its fills finished) is gone.
  ASSERT_TRUE(Eventually([&] { return manager_->ids_bytes_in_use() == 0; }));
  absl::StatusOr<Attachment> again = manager_->Attach(Spec("b"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(manager_->ids_bytes_in_use(), 64u);
}

TEST_F(BoundsTest, TheSampleCapComesFromTheOptions) {
  SessionManagerOptions options;
  options.feed_limits.max_samples = 99;
  Start(options);
  absl::StatusOr<Attachment> a = manager_->Attach(Spec("a"));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a.status().message(),
              HasSubstr("makes 100 samples, more than this gpufeedd's max_samples_per_feed (99)"));
  EXPECT_EQ(manager_->ids_bytes_in_use(), 0u);
}

TEST_F(BoundsTest, StartEpochIsAtMost2To40) {
  Start();
  AttachSpec spec = Spec("a");
  spec.start.epoch = kMaxEpoch;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  std::shared_ptr<Session> session = Find(*a);
  ASSERT_TRUE(session->BindStream([] {}).ok());
  StreamEvent event = NextEvent(*session);
  ASSERT_EQ(event.kind, StreamEvent::kBatch);
  EXPECT_EQ(event.batch.position, (Position{kMaxEpoch, 0}));
  for (const int64_t epoch : {kMaxEpoch + 1, std::numeric_limits<int64_t>::max()}) {
    spec.job = "b";
    spec.start.epoch = epoch;
    absl::StatusOr<Attachment> refused = manager_->Attach(spec);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(refused.status().message(),
              absl::StrCat("start.epoch: at most 2^40 (1099511627776), got ", epoch));
  }
}

TEST_F(BoundsTest, AnExceptionInAFillEndsThatSessionOnlyAndTheDaemonServesOn) {
  Start();
  fs_.throw_reads = true;
  absl::StatusOr<Attachment> a = manager_->Attach(Spec("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  std::shared_ptr<Session> session = Find(*a);
  // The first fill fails at once, stream or not: the session is closed with the error.
  ASSERT_TRUE(Eventually([&] { return session->closed(); }));
  StreamEvent event = session->NextEvent();
  ASSERT_EQ(event.kind, StreamEvent::kClosed);
  EXPECT_EQ(event.status.code(), absl::StatusCode::kResourceExhausted);
  // Whichever of the two slots' fills (steps 0 and 1) failed first.
  EXPECT_THAT(std::string(event.status.message()),
              ContainsRegex("^sample [0-9]+ of epoch 0 step [01]: reading it: out of memory "
                            "\\(std::bad_alloc\\): the request needs more memory than "
                            "gpufeedd can allocate$"));
  // Its ring goes back: the same manager attaches and serves another session.
  fs_.throw_reads = false;
  manager_->End(a->session_id, event.status);
  absl::StatusOr<Attachment> b = manager_->Attach(Spec("b"));
  ASSERT_TRUE(b.ok()) << b.status();
  std::shared_ptr<Session> other = Find(*b);
  ASSERT_TRUE(other->BindStream([] {}).ok());
  EXPECT_EQ(NextEvent(*other).kind, StreamEvent::kBatch);
}

}  // namespace
}  // namespace gpufeed::server
