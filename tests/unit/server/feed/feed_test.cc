// server/feed/: the fingerprint's sampler item and shard set, the sample cap
// (max_samples_per_feed), the ids budget (max_ids_bytes), and exceptions stopped at the fill and
// open boundaries (docs/SECURITY.md §4).
#include "server/feed/feed.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/feed/ids_budget.h"
#include "tests/testing/fake_file_system.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wrapping_file_system.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::FakeFileSystem;
using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

// `count` uint16 tokens t = t mod 2^16.
std::string Tokens(uint64_t count) {
  std::string out;
  for (uint64_t t = 0; t < count; ++t) {
    out += static_cast<char>(t & 0xff);
    out += static_cast<char>((t >> 8) & 0xff);
  }
  return out;
}

FeedSpec TokensSpec(const std::string& path, int64_t seq_len, int64_t batch) {
  FeedSpec spec;
  spec.dataset.kind = DatasetKind::kTokens;
  spec.dataset.path = path;
  spec.dataset.token_dtype = DType::kUInt16;
  spec.dataset.seq_len = seq_len;
  spec.batch_size = batch;
  spec.world_size = 1;
  spec.seed = 5;
  return spec;
}

// A file system whose files throw from ReadAt for the samples (row offsets) chosen, and whose
// opens throw when asked: what a dataset that runs out of memory (or has a bug) looks like.
class ThrowingFileSystem final : public ::gpufeed::testing::WrappingFileSystem {
 public:
  enum class What { kNothing, kBadAlloc, kRuntimeError };
  explicit ThrowingFileSystem(FakeFileSystem* inner) : WrappingFileSystem(inner) {}
  What open = What::kNothing;
  What read = What::kNothing;
  uint64_t throw_at_or_after = 0;  // reads at offsets >= this throw

 private:
  static void Throw(What what) {
    if (what == What::kBadAlloc) throw std::bad_alloc();
    if (what == What::kRuntimeError) throw std::runtime_error("a dataset bug");
  }
  void OnOpen() override { Throw(open); }
  void OnRead(const RandomAccessFile&, uint64_t offset, std::span<std::byte>) override {
    if (offset >= throw_at_or_after) Throw(read);
  }
};

TEST(FeedFingerprintTest, NamesTheSamplerAndRefusesPositionsOfTheOldOrder) {
  FakeFileSystem fs;
  fs.AddFile("/data/t.bin", Tokens(101));
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(TokensSpec("/data/t.bin", 10, 2), &fs);
  ASSERT_TRUE(feed.ok()) << feed.status();
  const std::string& fp = (*feed)->fingerprint();
  EXPECT_THAT(fp, HasSubstr(";shuffle=true;drop_last=true;sampler=feistel1"));
  // A position saved before feistel1 has every other item, but no sampler.
  std::string old = fp;
  old.erase(old.find(";sampler=feistel1"), std::string(";sampler=feistel1").size());
  const absl::Status refused = CompareFingerprints(old, fp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(),
            "start.fingerprint: the position was saved from another feed: sampler (the position "
            "was saved by a gpufeedd before feistel1, whose sample order differs: the same "
            "(epoch, step) names other samples now). Resume with the settings and data it was "
            "saved with, or start without it");
  // A future order is named as any changed field.
  std::string future = fp;
  future.replace(future.find("feistel1"), 8, "feistel2");
  EXPECT_THAT(CompareFingerprints(future, fp).message(),
              HasSubstr("sampler was feistel2, is feistel1"));
  EXPECT_TRUE(CompareFingerprints(fp, fp).ok());
}

// Moves `path`'s modification time one second on: a change no file system's granularity hides.
void TouchLater(const std::string& path) {
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  timespec times[2] = {st.st_atim, st.st_mtim};
  times[1].tv_sec += 1;
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

std::string FingerprintOf(const FeedSpec& spec) {
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(spec, PosixFileSystem());
  EXPECT_TRUE(feed.ok()) << feed.status();
  return feed.ok() ? (*feed)->fingerprint() : "";
}

// A directory of shards is named by its shards (names, sizes, times), not by the directory's
// own time: a dot-file or a folder added beside the shards (a lock, a checkpoint) does not
// stop a resume; a shard rewritten does. A position saved before the shards' times were part
// of the fingerprint (the directory's time instead) still resumes the same shard set.
TEST(FeedFingerprintTest, AShardDirectoryIsNamedByItsShardsNotByFilesBesideThem) {
  TempDir dir;
  dir.WriteFile("a.bin", Tokens(101));
  dir.WriteFile("b.bin", Tokens(57));
  const FeedSpec spec = TokensSpec(dir.path(), 10, 2);
  const std::string fp = FingerprintOf(spec);
  EXPECT_THAT(fp, HasSubstr(";path=" + dir.path() + ";shards=2 files, fnv1a64 "));
  EXPECT_THAT(fp, HasSubstr(", mtimes fnv1a64 "));
  EXPECT_THAT(fp, Not(HasSubstr("mtime_ns=")));

  dir.WriteFile(".lock", "pid 4242");
  ASSERT_EQ(::mkdir(dir.Join("checkpoints").c_str(), 0755), 0);
  TouchLater(dir.path());
  EXPECT_EQ(FingerprintOf(spec), fp);

  // b.bin rewritten in place, the same size: its time differs.
  TouchLater(dir.Join("b.bin"));
  const std::string rewritten = FingerprintOf(spec);
  const absl::Status refused = CompareFingerprints(fp, rewritten);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("shards was 2 files, fnv1a64 "));
  EXPECT_THAT(refused.message(), Not(HasSubstr("mtime_ns")));

  // The form an earlier gpufeedd saved: the directory's time, no shard times.
  const size_t times = fp.find(", mtimes fnv1a64 ");
  const size_t end = fp.find(';', times);
  std::string old = fp.substr(0, times) + fp.substr(end);
  old.insert(old.find(";shards="), ";mtime_ns=1764633600000000000");
  EXPECT_TRUE(CompareFingerprints(old, rewritten).ok()) << CompareFingerprints(old, rewritten);
  // ... but only for the same shard set: a third shard is refused, naming it.
  dir.WriteFile("c.bin", Tokens(33));
  const absl::Status more = CompareFingerprints(old, FingerprintOf(spec));
  EXPECT_EQ(more.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(more.message(), HasSubstr("shards was 2 files, fnv1a64 "));
  EXPECT_THAT(more.message(), HasSubstr(", is 3 files, fnv1a64 "));
  // A single file keeps its own size and time: an earlier release's position of it had them.
  const std::string one = FingerprintOf(TokensSpec(dir.Join("a.bin"), 10, 2));
  EXPECT_THAT(one, HasSubstr(";bytes=202;mtime_ns="));
}

TEST(FeedLimitsTest, ADatasetOfMoreSamplesThanTheCapIsRefusedNamingBoth) {
  FakeFileSystem fs;
  fs.AddFile("/data/t.bin", Tokens(1002));  // seq_len 1: 1001 samples
  FeedLimits limits;
  limits.max_samples = 1000;
  absl::StatusOr<std::shared_ptr<Feed>> refused =
      Feed::Create(TokensSpec("/data/t.bin", 1, 4), &fs, limits);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.status().message(),
            "dataset.path: /data/t.bin makes 1001 samples, more than this gpufeedd's "
            "max_samples_per_feed (1000); split the dataset or ask the admin to raise the cap");
  limits.max_samples = 1001;  // exactly the cap: served
  EXPECT_TRUE(Feed::Create(TokensSpec("/data/t.bin", 1, 4), &fs, limits).ok());
}

// A former crash: a 4 GiB sparse token file with seq_len 1 is 2^31 - 1 samples. The feed
// opens at once and gives any batch's ids without materialising an order.
TEST(FeedLimitsTest, A4GiBTokenFileWithSeqLen1OpensAndSamplesWithoutAPermutation) {
  FakeFileSystem fs;
  fs.AddFileWithSize("/data/sparse.bin", std::string(1 << 16, '\0'), uint64_t{4} << 30);
  absl::StatusOr<std::shared_ptr<Feed>> feed =
      Feed::Create(TokensSpec("/data/sparse.bin", 1, 8), &fs);
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->dataset().num_samples(), (uint64_t{1} << 31) - 1);
  std::vector<int64_t> ids(8);
  const Position last{7, (*feed)->sampler().steps_per_epoch() - 1};
  EXPECT_EQ((*feed)->sampler().RankSlice(last, 0, std::span<int64_t>(ids)), 8);
  const EpochOrder order((uint64_t{1} << 31) - 1, 5, 7, true);
  const uint64_t first = static_cast<uint64_t>(last.step) * 8;
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(ids[i], static_cast<int64_t>(order.At(first + i)));
}

TEST(FeedLimitsTest, TheSeqLenMessageDoesNotOverflow) {
  FakeFileSystem fs;
  fs.AddFile("/data/t.bin", Tokens(10));
  absl::StatusOr<std::shared_ptr<Feed>> refused =
      Feed::Create(TokensSpec("/data/t.bin", std::numeric_limits<int64_t>::max(), 1), &fs);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.status().message(),
            "dataset.seq_len: 9223372036854775807 needs at least 9223372036854775808 tokens, "
            "but /data/t.bin holds 10");
}

TEST(IdsBudgetTest, ChargesNameTheBytesAndReturnThemWhenDestroyed) {
  std::shared_ptr<ByteBudget> budget = CreateIdsBudget(1000, 1000);
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> a = TakeIds(*budget, 7, 10, 8);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->bytes(), 640u);
  EXPECT_EQ(budget->used(), 640u);
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> b = TakeIds(*budget, 7, 10, 5);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(b.status().message(),
            "sample ids of 5 slots x 10 rows need 400 bytes; 640 of max_ids_bytes 1000 are in "
            "use: lower batch_size or ring_slots, or retry later");
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> exact = TakeIds(*budget, 7, 45, 1);
  ASSERT_TRUE(exact.ok()) << exact.status();  // 360: exactly the rest
  EXPECT_EQ(budget->used(), 1000u);
  a->reset();
  EXPECT_EQ(budget->used(), 360u);
  // Sizes whose product wraps 64 bits are refused, not charged as a small number.
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> huge =
      TakeIds(*budget, 7, int64_t{1} << 62, 64);  // 2^71 bytes, 0 mod 2^64
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(huge.status().message(),
              HasSubstr("sample ids of 64 slots x 4611686018427387904 rows need more than 2^64 "
                        "bytes; 360 of max_ids_bytes 1000"));
  EXPECT_EQ(budget->used(), 360u);
}

TEST(IdsBudgetTest, OneUidTakesAtMostItsShareAndAdminsOnlyTheTotal) {
  // max_ids_bytes was once daemon-wide, so one uid's sessions inside its own quotas
  // could leave every other uid's Attach RESOURCE_EXHAUSTED.
  std::shared_ptr<ByteBudget> budget = CreateIdsBudget(1000);  // 500 a uid
  EXPECT_EQ(budget->per_uid(), 500u);
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> a = TakeIds(*budget, 7, 50, 1);
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> over = TakeIds(*budget, 7, 20, 1);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.status().message(),
            "sample ids of 1 slots x 20 rows need 160 bytes; uid 7 holds 400 of its share of "
            "max_ids_bytes (max_ids_bytes_per_uid 500): lower batch_size or ring_slots, or "
            "retry later");
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> other = TakeIds(*budget, 8, 50, 1);
  EXPECT_TRUE(other.ok());  // another uid has its own share
  absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> admin =
      TakeIds(*budget, std::nullopt, 25, 1);  // 200: past no share, within the total
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_EQ(budget->used(), 1000u);
  EXPECT_EQ(budget->used_by(7), 400u);
  a->reset();
  EXPECT_EQ(budget->used_by(7), 0u);
  EXPECT_TRUE(TakeIds(*budget, 7, 50, 1).ok());
}

class FeedExceptionTest : public ::testing::Test {
 protected:
  // seq_len 1023: rows of 2 KiB; a batch of 2048 is 4 MiB, two chunks of Feed::kChunkBytes.
  void SetUp() override { fake_.AddFile("/data/t.bin", Tokens(1024 * 4096 + 1)); }
  FakeFileSystem fake_;
  ThrowingFileSystem fs_{&fake_};
};

TEST_F(FeedExceptionTest, AnExceptionOpeningTheDatasetIsTheAttachsError) {
  fs_.open = ThrowingFileSystem::What::kBadAlloc;
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(TokensSpec("/data/t.bin", 1023, 4), &fs_);
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(feed.status().message(),
            "opening dataset /data/t.bin: out of memory (std::bad_alloc): the request needs more "
            "memory than gpufeedd can allocate");
  fs_.open = ThrowingFileSystem::What::kRuntimeError;
  feed = Feed::Create(TokensSpec("/data/t.bin", 1023, 4), &fs_);
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(feed.status().message(),
            "opening dataset /data/t.bin: unexpected exception: a dataset bug");
}

// A throw in any chunk, on the caller's thread or a pool helper's, is the fill's status.
TEST_F(FeedExceptionTest, AnExceptionInAFillChunkOnAnyThreadIsTheFillsStatus) {
  FeedSpec spec = TokensSpec("/data/t.bin", 1023, 2048);
  spec.shuffle = false;  // rows 0..2047 in order: the second chunk reads rows 1024..2047
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(spec, &fs_);
  ASSERT_TRUE(feed.ok()) << feed.status();
  ASSERT_EQ((*feed)->layout().used_bytes, uint64_t{2048} * 2048);
  std::vector<std::byte> slot((*feed)->layout().stride_bytes);
  std::vector<int64_t> ids(2048);
  ThreadPool pool("read", 2, 16);
  const Feed::ParallelFor parallel = [&pool](int n, const std::function<void(int)>& fn) {
    pool.ParallelFor(n, fn);
  };
  ASSERT_TRUE((*feed)->Fill({0, 0}, 0, slot.data(), std::span<int64_t>(ids), parallel).ok());

  fs_.read = ThrowingFileSystem::What::kBadAlloc;
  fs_.throw_at_or_after = uint64_t{1024} * 1023 * 2;  // row 1024 on: the second chunk only
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<int64_t> filled = (*feed)->Fill(
        {0, 0}, 0, slot.data(), std::span<int64_t>(ids), attempt == 0 ? parallel : nullptr);
    EXPECT_EQ(filled.status().code(), absl::StatusCode::kResourceExhausted) << attempt;
    EXPECT_EQ(filled.status().message(),
              "sample 1024 of epoch 0 step 0: reading it: out of memory (std::bad_alloc): the "
              "request needs more memory than gpufeedd can allocate")
        << attempt;
  }
  fs_.read = ThrowingFileSystem::What::kRuntimeError;
  absl::StatusOr<int64_t> filled =
      (*feed)->Fill({0, 0}, 0, slot.data(), std::span<int64_t>(ids), parallel);
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(filled.status().message(),
            "sample 1024 of epoch 0 step 0: reading it: unexpected exception: a dataset bug");
  // The pool's workers live on: the next fill is served.
  fs_.read = ThrowingFileSystem::What::kNothing;
  EXPECT_EQ(*(*feed)->Fill({0, 0}, 0, slot.data(), std::span<int64_t>(ids), parallel), 2048);
}

// The parallel-for itself throwing (here: a ParallelFor that allocates and fails) is caught at
// the fill's own boundary.
TEST_F(FeedExceptionTest, AnExceptionOutsideTheChunksIsCaughtAtTheFillBoundary) {
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(TokensSpec("/data/t.bin", 1023, 2048), &fs_);
  ASSERT_TRUE(feed.ok()) << feed.status();
  std::vector<std::byte> slot((*feed)->layout().stride_bytes);
  std::vector<int64_t> ids(2048);
  const Feed::ParallelFor throwing = [](int, const std::function<void(int)>&) {
    throw std::bad_alloc();
  };
  absl::StatusOr<int64_t> filled =
      (*feed)->Fill({3, 1}, 0, slot.data(), std::span<int64_t>(ids), throwing);
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(filled.status().message(),
            "filling epoch 3 step 1 rank 0: out of memory (std::bad_alloc): the request needs "
            "more memory than gpufeedd can allocate");
}

// docs/SECURITY.md section 4, max_batch_time: past its deadline a fill starts no further
// sample and returns DEADLINE_EXCEEDED naming the budget and how far it got, on the clock given.
TEST_F(FeedExceptionTest, AFillPastItsDeadlineStopsBeforeItsNextSample) {
  FeedSpec spec = TokensSpec("/data/t.bin", 1023, 2048);
  spec.shuffle = false;
  absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(spec, &fs_);
  ASSERT_TRUE(feed.ok()) << feed.status();
  std::vector<std::byte> slot((*feed)->layout().stride_bytes);
  std::vector<int64_t> ids(2048);
  const absl::Time start = absl::FromUnixSeconds(1000);
  auto calls = std::make_shared<std::atomic<int64_t>>(0);
  // Each look at the clock is 1 ms later: sample i looks at i + 1 ms.
  const Clock clock = [start, calls] { return start + absl::Milliseconds(++*calls); };
  const FillDeadline deadline{start + absl::Milliseconds(100), clock, absl::Milliseconds(100)};
  absl::StatusOr<int64_t> filled =
      (*feed)->Fill({0, 1}, 0, slot.data(), std::span<int64_t>(ids), nullptr, deadline);
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(filled.status().message(),
            "the batch of epoch 0 step 1 ran past max_batch_time (100ms) with 99 of 2048 samples "
            "done: this session ends; ask for smaller batches or smaller images");
  // On a pool, the same (some samples in flight may finish; none starts after).
  ThreadPool pool("read", 2, 16);
  const Feed::ParallelFor parallel = [&pool](int n, const std::function<void(int)>& fn) {
    pool.ParallelFor(n, fn);
  };
  *calls = 0;
  filled = (*feed)->Fill({0, 1}, 0, slot.data(), std::span<int64_t>(ids), parallel, deadline);
  EXPECT_EQ(filled.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(filled.status().message(), HasSubstr("ran past max_batch_time (100ms)"));
  // Without a deadline (the default) the batch is whole.
  EXPECT_EQ(*(*feed)->Fill({0, 1}, 0, slot.data(), std::span<int64_t>(ids), parallel), 2048);
}

}  // namespace
}  // namespace gpufeed::server
