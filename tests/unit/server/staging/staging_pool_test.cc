#include "server/staging/staging_pool.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

const uint64_t kPage = PageSize();

std::unique_ptr<StagingPool> MakePool(uint64_t total, uint64_t slab) {
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(total, slab);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return pool.ok() ? std::move(*pool) : nullptr;
}

StagingRegion MustAllocate(StagingPool& pool, uint64_t bytes) {
  absl::StatusOr<StagingRegion> r = pool.Allocate(bytes);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : StagingRegion();
}

TEST(StagingPoolTest, CreateSplitsIntoSlabs) {
  std::unique_ptr<StagingPool> pool = MakePool(10 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->total_bytes(), 10 * kPage);
  EXPECT_EQ(pool->free_bytes(), 10 * kPage);
  ASSERT_EQ(pool->num_slabs(), 3);  // 4 + 4 + 2 pages
  const uint64_t expected_sizes[] = {4 * kPage, 4 * kPage, 2 * kPage};
  for (int s = 0; s < 3; ++s) {
    struct stat st {};
    ASSERT_EQ(::fstat(pool->slab_fd(s), &st), 0) << "slab " << s;
    EXPECT_EQ(static_cast<uint64_t>(st.st_size), expected_sizes[s]) << "slab " << s;
    EXPECT_NE(pool->slab_fd(s), pool->slab_fd((s + 1) % 3));
  }
}

TEST(StagingPoolTest, CreateRoundsToPages) {
  std::unique_ptr<StagingPool> pool = MakePool(3 * kPage + 1, kPage + 1);
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->total_bytes(), 4 * kPage);
  EXPECT_EQ(pool->num_slabs(), 2);  // slabs of 2 pages
}

TEST(StagingPoolTest, CreateRejectsZeroBytes) {
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(0, kPage);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("staging_bytes"));
}

TEST(StagingPoolTest, SlabsAreSealedAgainstShrinking) {
  std::unique_ptr<StagingPool> pool = MakePool(2 * kPage, 2 * kPage);
  ASSERT_NE(pool, nullptr);
  EXPECT_NE(::ftruncate(pool->slab_fd(0), 0), 0);
  EXPECT_EQ(errno, EPERM);
}

TEST(StagingPoolTest, AllocateRoundsUpToPages) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocate(*pool, 1);
  EXPECT_EQ(a.size(), kPage);
  EXPECT_EQ(a.offset() % kPage, 0u);
  StagingRegion b = MustAllocate(*pool, kPage + 1);
  EXPECT_EQ(b.size(), 2 * kPage);
  StagingRegion c = MustAllocate(*pool, kPage);
  EXPECT_EQ(c.size(), kPage);
  StagingRegion zero = MustAllocate(*pool, 0);  // at least a page
  EXPECT_EQ(zero.size(), kPage);
  EXPECT_EQ(pool->free_bytes(), 3 * kPage);
  for (const StagingRegion* r : {&a, &b, &c, &zero}) {
    EXPECT_EQ(r->offset() % kPage, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r->data()) % kPage, 0u);
  }
}

TEST(StagingPoolTest, FreeBytesReturnExactlyWhenRegionsAreDestroyed) {
  std::unique_ptr<StagingPool> pool = MakePool(16 * kPage, 16 * kPage);
  ASSERT_NE(pool, nullptr);
  {
    StagingRegion a = MustAllocate(*pool, 3 * kPage);
    EXPECT_EQ(pool->free_bytes(), 13 * kPage);
    {
      StagingRegion b = MustAllocate(*pool, 5 * kPage);
      EXPECT_EQ(pool->free_bytes(), 8 * kPage);
    }
    EXPECT_EQ(pool->free_bytes(), 13 * kPage);
  }
  EXPECT_EQ(pool->free_bytes(), 16 * kPage);
  // Everything coalesced back: the whole slab can be taken again.
  StagingRegion all = MustAllocate(*pool, 16 * kPage);
  EXPECT_EQ(all.offset(), 0u);
  EXPECT_EQ(pool->free_bytes(), 0u);
}

TEST(StagingPoolTest, MovingARegionDoesNotDoubleFree) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  {
    StagingRegion a = MustAllocate(*pool, kPage);
    std::byte* data = a.data();
    StagingRegion b(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_EQ(b.data(), data);
    EXPECT_EQ(b.size(), kPage);
    StagingRegion c;
    c = std::move(b);
    EXPECT_EQ(c.data(), data);
    EXPECT_EQ(pool->free_bytes(), 3 * kPage);
    { StagingRegion moved_out = std::move(c); }
    EXPECT_EQ(pool->free_bytes(), 4 * kPage);
  }
  // No region was freed twice: free bytes never exceed the total.
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
}

TEST(StagingPoolTest, MoveAssigningOverARegionFreesTheOldOne) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocate(*pool, kPage);
  StagingRegion b = MustAllocate(*pool, 2 * kPage);
  EXPECT_EQ(pool->free_bytes(), kPage);
  a = std::move(b);  // a's old page goes back
  EXPECT_EQ(pool->free_bytes(), 2 * kPage);
  EXPECT_EQ(a.size(), 2 * kPage);
  a = StagingRegion();
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
}

TEST(StagingPoolTest, ResourceExhaustedStatesBytesAskedAndFree) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocate(*pool, 5 * kPage);
  absl::StatusOr<StagingRegion> r = pool->Allocate(4 * kPage);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("asked for ", 4 * kPage, " bytes")));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat(3 * kPage, " of ", 8 * kPage)));
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("largest free block ", 3 * kPage)));
  EXPECT_EQ(pool->free_bytes(), 3 * kPage);  // a refusal takes nothing
  // What is free can still be had.
  StagingRegion b = MustAllocate(*pool, 3 * kPage);
  EXPECT_EQ(pool->free_bytes(), 0u);
}

TEST(StagingPoolTest, RequestLargerThanThePoolIsRefused) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<StagingRegion> r = pool->Allocate(4 * kPage + 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("asked for ", 4 * kPage + 1,
                                                           " bytes, more than the whole "
                                                           "pool (",
                                                           4 * kPage, " bytes free at most)")));
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
  // The whole pool, exactly, is not more than the pool.
  EXPECT_TRUE(pool->Allocate(4 * kPage).ok());
}

// First fit looks past a free range too small for the request to a later one in the same
// slab (mutation testing: ending the slab's scan at the first too-small range survived).
TEST(StagingPoolTest, FirstFitLooksPastASmallerHoleInTheSameSlab) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  std::optional<StagingRegion> a = MustAllocate(*pool, kPage);
  StagingRegion b = MustAllocate(*pool, kPage);
  std::optional<StagingRegion> c = MustAllocate(*pool, 2 * kPage);
  StagingRegion d = MustAllocate(*pool, 4 * kPage);
  ASSERT_EQ(c->offset(), 2 * kPage);
  a.reset();  // a hole of 1 page at 0
  c.reset();  // a hole of 2 pages at 2 pages
  absl::StatusOr<StagingRegion> e = pool->Allocate(2 * kPage);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->offset(), 2 * kPage);
  EXPECT_EQ(pool->free_bytes(), kPage);
}

// An exact fit between two regions keeps no empty free range behind it: one would share its
// offset with the next region, whose Free would then find the range taken and return nothing.
TEST(StagingPoolTest, AnExactFitBetweenTwoRegionsReturnsEveryByteWhenAllAreFreed) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  std::optional<StagingRegion> a = MustAllocate(*pool, kPage);
  std::optional<StagingRegion> b = MustAllocate(*pool, kPage);
  std::optional<StagingRegion> c = MustAllocate(*pool, kPage);
  std::optional<StagingRegion> d = MustAllocate(*pool, kPage);
  b.reset();
  std::optional<StagingRegion> e = MustAllocate(*pool, kPage);  // exactly b's page
  EXPECT_EQ(e->offset(), kPage);
  c.reset();
  a.reset();
  d.reset();
  e.reset();
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
  EXPECT_TRUE(pool->Allocate(4 * kPage).ok());
}

TEST(StagingPoolTest, AFullPoolSaysItsLargestFreeBlockIsZero) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion all = MustAllocate(*pool, 4 * kPage);
  absl::StatusOr<StagingRegion> r = pool->Allocate(1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(),
              HasSubstr(absl::StrCat("asked for ", kPage, " bytes, 0 of ", 4 * kPage,
                                     " bytes free (largest free block 0 bytes)")));
}

TEST(StagingPoolTest, HugeRequestDoesNotWrapAround) {
  // Page rounding of a request near 2^64 once wrapped to 0, and Allocate(UINT64_MAX)
  // "succeeded" with a 0-byte region.
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  for (uint64_t bytes : {~uint64_t{0}, ~uint64_t{0} - kPage + 2, uint64_t{1} << 63}) {
    absl::StatusOr<StagingRegion> r = pool->Allocate(bytes);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
    EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("asked for ", bytes)));
    if (r.ok()) {
      EXPECT_GE(r->size(), bytes) << "a region smaller than asked";
    }
  }
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
}

TEST(StagingPoolTest, FragmentationThenCoalescing) {
  std::unique_ptr<StagingPool> pool = MakePool(6 * kPage, 6 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocate(*pool, 2 * kPage);
  StagingRegion b = MustAllocate(*pool, 2 * kPage);
  StagingRegion c = MustAllocate(*pool, 2 * kPage);
  EXPECT_EQ(a.offset(), 0u);
  EXPECT_EQ(b.offset(), 2 * kPage);
  EXPECT_EQ(c.offset(), 4 * kPage);
  EXPECT_EQ(pool->free_bytes(), 0u);

  b = StagingRegion();  // hole in the middle
  EXPECT_EQ(pool->free_bytes(), 2 * kPage);
  // 3 pages are not contiguous anywhere yet.
  absl::StatusOr<StagingRegion> too_big = pool->Allocate(3 * kPage);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted);

  a = StagingRegion();  // A's range is merged with B's
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
  StagingRegion ab = MustAllocate(*pool, 4 * kPage);
  EXPECT_EQ(ab.offset(), 0u);
  EXPECT_EQ(ab.size(), 4 * kPage);
  EXPECT_EQ(pool->free_bytes(), 0u);
}

// A 6-page slab cut into regions A, B, C of 2 pages each, in that order.
std::vector<StagingRegion> ThreeRegions(StagingPool& pool) {
  std::vector<StagingRegion> abc;
  for (int i = 0; i < 3; ++i) abc.push_back(MustAllocate(pool, 2 * kPage));
  return abc;
}

TEST(StagingPoolTest, CoalescesWithTheFollowingRangeToo) {
  std::unique_ptr<StagingPool> pool = MakePool(6 * kPage, 6 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<StagingRegion> abc = ThreeRegions(*pool);
  abc[1] = StagingRegion();
  abc[2] = StagingRegion();  // merges with B's range before it
  StagingRegion bc = MustAllocate(*pool, 4 * kPage);
  EXPECT_EQ(bc.offset(), 2 * kPage);
  abc[0] = StagingRegion();
  bc = StagingRegion();  // A, B, C all back: one range of 6 pages
  StagingRegion all = MustAllocate(*pool, 6 * kPage);
  EXPECT_EQ(all.offset(), 0u);
}

// The range freed between two free ranges joins both of them (the merge with the following
// range and the merge with the preceding one, in one Free): one range of the whole slab.
TEST(StagingPoolTest, CoalescesWithBothNeighboursInOneFree) {
  std::unique_ptr<StagingPool> pool = MakePool(6 * kPage, 6 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<StagingRegion> abc = ThreeRegions(*pool);
  abc[0] = StagingRegion();
  abc[2] = StagingRegion();
  abc[1] = StagingRegion();  // between A's free range and C's
  EXPECT_EQ(pool->free_bytes(), 6 * kPage);
  absl::StatusOr<StagingRegion> all = pool->Allocate(6 * kPage);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->offset(), 0u);
  EXPECT_EQ(all->size(), 6 * kPage);
}

TEST(StagingPoolTest, RegionsAreWritableAndDoNotOverlap) {
  std::unique_ptr<StagingPool> pool = MakePool(12 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<StagingRegion> regions;
  const uint64_t sizes[] = {kPage, 3 * kPage, 2 * kPage, kPage, 4 * kPage, kPage};
  for (uint64_t size : sizes) regions.push_back(MustAllocate(*pool, size));
  ASSERT_EQ(pool->free_bytes(), 0u);
  // Fill each with its own byte; then check that no write landed in another region.
  for (size_t i = 0; i < regions.size(); ++i) {
    std::fill(regions[i].data(), regions[i].data() + regions[i].size(),
              static_cast<std::byte>(i + 1));
  }
  for (size_t i = 0; i < regions.size(); ++i) {
    for (uint64_t k = 0; k < regions[i].size(); ++k) {
      ASSERT_EQ(regions[i].data()[k], static_cast<std::byte>(i + 1)) << "region " << i;
    }
    for (size_t j = i + 1; j < regions.size(); ++j) {
      if (regions[i].slab() != regions[j].slab()) continue;
      const bool disjoint = regions[i].offset() + regions[i].size() <= regions[j].offset() ||
                            regions[j].offset() + regions[j].size() <= regions[i].offset();
      EXPECT_TRUE(disjoint) << "regions " << i << " and " << j;
    }
  }
}

TEST(StagingPoolTest, RegionDataIsTheSlabAtItsOffset) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocate(*pool, 3 * kPage);
  StagingRegion b = MustAllocate(*pool, 2 * kPage);  // does not fit behind a: slab 1
  EXPECT_EQ(a.slab(), 0);
  EXPECT_EQ(b.slab(), 1);
  EXPECT_EQ(b.offset(), 0u);
  const std::string text = "written through the region";
  std::memcpy(b.data() + 5, text.data(), text.size());
  // A consumer maps the slab's fd at the region's offset and sees the same bytes.
  absl::StatusOr<Mapping> m = Mapping::Map(pool->slab_fd(b.slab()), b.offset(), b.size(), false);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m->data()) + 5, text.size()), text);
}

TEST(StagingPoolTest, RegionNeverSpansTwoSlabs) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 4 * kPage);  // 2 slabs of 4 pages
  ASSERT_NE(pool, nullptr);
  ASSERT_EQ(pool->num_slabs(), 2);
  // 5 pages are free in total (8) but no slab holds them.
  absl::StatusOr<StagingRegion> r = pool->Allocate(5 * kPage);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("largest free block ", 4 * kPage)));
  EXPECT_EQ(pool->free_bytes(), 8 * kPage);
  // Free space split across slabs: 2 pages in each, 4 free in total; 3 pages do not fit.
  StagingRegion a = MustAllocate(*pool, 2 * kPage);
  StagingRegion b = MustAllocate(*pool, 3 * kPage);  // slab 0 has only 2 left: slab 1
  EXPECT_EQ(a.slab(), 0);
  EXPECT_EQ(b.slab(), 1);
  EXPECT_EQ(pool->free_bytes(), 3 * kPage);
  EXPECT_EQ(pool->Allocate(3 * kPage).status().code(), absl::StatusCode::kResourceExhausted);
  StagingRegion c = MustAllocate(*pool, 2 * kPage);
  EXPECT_EQ(c.slab(), 0);
  EXPECT_EQ(c.offset(), 2 * kPage);
  for (const StagingRegion* x : {&a, &b, &c}) {
    const uint64_t slab_size = 4 * kPage;
    EXPECT_LE(x->offset() + x->size(), slab_size);
  }
}

TEST(StagingPoolTest, ManyAllocationsAndFreesReturnEverything) {
  std::unique_ptr<StagingPool> pool = MakePool(64 * kPage, 16 * kPage);
  ASSERT_NE(pool, nullptr);
  std::vector<StagingRegion> live;
  uint64_t x = 12345;
  for (int round = 0; round < 500; ++round) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const uint64_t pages = 1 + (x >> 60) % 5;
    if ((x >> 33) % 3 != 0) {
      absl::StatusOr<StagingRegion> r = pool->Allocate(pages * kPage);
      if (r.ok()) live.push_back(std::move(*r));
    } else if (!live.empty()) {
      live.erase(live.begin() + static_cast<int64_t>((x >> 20) % live.size()));
    }
    uint64_t held = 0;
    for (const StagingRegion& r : live) held += r.size();
    ASSERT_EQ(pool->free_bytes() + held, 64 * kPage) << "round " << round;
  }
  live.clear();
  EXPECT_EQ(pool->free_bytes(), 64 * kPage);
  for (int s = 0; s < 4; ++s) {
    StagingRegion whole = MustAllocate(*pool, 16 * kPage);
    EXPECT_EQ(whole.offset(), 0u);
    live.push_back(std::move(whole));
  }
}

}  // namespace
}  // namespace gpufeed::server

namespace gpufeed::server {
namespace {

// A new ring never shows the previous session's bytes, whether it takes the freed
// range exactly, a part of it, or a range that spans two freed ones.
TEST(StagingPoolTest, ANewRegionIsZeroedWhateverTheLastOwnerWrote) {
  auto pool = StagingPool::Create(16 * PageSize(), 16 * PageSize());
  ASSERT_TRUE(pool.ok());
  auto all_zero = [](const StagingRegion& r) {
    for (uint64_t i = 0; i < r.size(); ++i) {
      if (r.data()[i] != std::byte{0}) return false;
    }
    return true;
  };
  {
    auto a = (*pool)->Allocate(4 * PageSize());
    auto b = (*pool)->Allocate(4 * PageSize());
    ASSERT_TRUE(a.ok() && b.ok());
    std::memset(a->data(), 0xAB, a->size());
    std::memset(b->data(), 0xCD, b->size());
  }
  auto exact = (*pool)->Allocate(4 * PageSize());
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->offset(), 0u);  // the first owner's range
  EXPECT_TRUE(all_zero(*exact));
  std::memset(exact->data(), 0xEF, exact->size());
  exact = StagingRegion();
  auto spanning = (*pool)->Allocate(7 * PageSize());  // both old ranges, in part
  ASSERT_TRUE(spanning.ok());
  EXPECT_EQ(spanning->offset(), 0u);
  EXPECT_TRUE(all_zero(*spanning));
}

}  // namespace
}  // namespace gpufeed::server

// ---- a host ring's own memfd (docs/SECURITY.md section 3) ----

namespace gpufeed::server {
namespace {

struct stat Stat(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0) << std::strerror(errno);
  return st;
}

UniqueFd MustDup(const StagingRegion& r) {
  absl::StatusOr<UniqueFd> fd = r.DupMemfd();
  EXPECT_TRUE(fd.ok()) << fd.status();
  return fd.ok() ? std::move(*fd) : UniqueFd();
}

StagingRegion MustAllocateOwn(StagingPool& pool, uint64_t bytes) {
  absl::StatusOr<StagingRegion> r = pool.AllocateOwnMemfd(bytes);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : StagingRegion();
}

TEST(StagingPoolTest, AnOwnMemfdIsExactlyTheRingRoundedToAPageAndSealed) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion ring = MustAllocateOwn(*pool, 3 * kPage - 5);
  ASSERT_TRUE(ring.own_memfd());
  EXPECT_EQ(ring.size(), 3 * kPage);
  EXPECT_EQ(ring.slab(), -1);
  EXPECT_EQ(ring.offset(), 0u);
  EXPECT_EQ(pool->free_bytes(), 5 * kPage);
  UniqueFd fd = MustDup(ring);
  ASSERT_TRUE(fd.valid());
  EXPECT_EQ(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  // The file is the ring, not the pool's 8 pages.
  EXPECT_EQ(static_cast<uint64_t>(Stat(fd.get()).st_size), 3 * kPage);
  EXPECT_EQ(::fcntl(fd.get(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // Whoever holds the fd cannot widen it (to reach memory beyond), shrink it (to SIGBUS the
  // daemon) or lift the seals.
  errno = 0;
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(8 * kPage)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(kPage)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  const char byte = 'x';
  EXPECT_EQ(::pwrite(fd.get(), &byte, 1, static_cast<off_t>(3 * kPage)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(static_cast<uint64_t>(Stat(fd.get()).st_size), 3 * kPage);
  // What the daemon writes is what a consumer's mapping of the fd reads.
  const std::string text = "through the ring's own memfd";
  std::memcpy(ring.data() + kPage + 7, text.data(), text.size());
  absl::StatusOr<Mapping> m = Mapping::Map(fd.get(), 0, ring.size(), false);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m->data()) + kPage + 7, text.size()), text);
}

TEST(StagingPoolTest, OwnMemfdsAreDifferentFilesFromEachOtherAndFromTheSlabs) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocateOwn(*pool, kPage);
  StagingRegion b = MustAllocateOwn(*pool, kPage);
  UniqueFd fa = MustDup(a);
  UniqueFd fb = MustDup(b);
  ASSERT_TRUE(fa.valid() && fb.valid());
  const struct stat sa = Stat(fa.get()), sb = Stat(fb.get()), slab = Stat(pool->slab_fd(0));
  EXPECT_NE(sa.st_ino, sb.st_ino);
  EXPECT_NE(sa.st_ino, slab.st_ino);
  EXPECT_NE(sb.st_ino, slab.st_ino);
  // A second dup is the same file (the consumer may ask twice), a new descriptor.
  UniqueFd fa2 = MustDup(a);
  EXPECT_NE(fa2.get(), fa.get());
  EXPECT_EQ(Stat(fa2.get()).st_ino, sa.st_ino);
  std::memset(a.data(), 0xAA, a.size());
  std::memset(b.data(), 0xBB, b.size());
  EXPECT_EQ(a.data()[0], std::byte{0xAA});
  EXPECT_EQ(b.data()[kPage - 1], std::byte{0xBB});
  for (int s = 0; s < pool->num_slabs(); ++s) {
    EXPECT_EQ(pool->slab_data(s)[0], std::byte{0}) << "an own memfd wrote into slab " << s;
  }
}

TEST(StagingPoolTest, ASlabRegionIsNeverHandedOut) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion r = MustAllocate(*pool, kPage);
  EXPECT_FALSE(r.own_memfd());
  absl::StatusOr<UniqueFd> fd = r.DupMemfd();
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fd.status().message(), HasSubstr("never handed out"));
  EXPECT_EQ(StagingRegion().DupMemfd().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(StagingPoolTest, OwnMemfdsAndSlabRegionsShareOneBudget) {
  std::unique_ptr<StagingPool> pool = MakePool(8 * kPage, 8 * kPage);
  ASSERT_NE(pool, nullptr);
  {
    StagingRegion own = MustAllocateOwn(*pool, 3 * kPage);
    EXPECT_EQ(pool->free_bytes(), 5 * kPage);
    // The slab is all free, but the budget has 5 pages left.
    absl::StatusOr<StagingRegion> slab = pool->Allocate(6 * kPage);
    EXPECT_EQ(slab.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(slab.status().message(),
                HasSubstr(absl::StrCat("asked for ", 6 * kPage, " bytes, ", 5 * kPage, " of ",
                                       8 * kPage, " bytes free (largest free block ", 5 * kPage)));
    StagingRegion s = MustAllocate(*pool, 4 * kPage);
    EXPECT_EQ(pool->free_bytes(), kPage);
    absl::StatusOr<StagingRegion> more = pool->AllocateOwnMemfd(2 * kPage);
    EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(more.status().message(),
                HasSubstr(absl::StrCat("staging pool: asked for ", 2 * kPage, " bytes, ", kPage,
                                       " of ", 8 * kPage, " bytes free")));
    EXPECT_THAT(more.status().message(), HasSubstr("--staging_bytes"));
    EXPECT_EQ(pool->free_bytes(), kPage);  // a refusal takes nothing
    StagingRegion last = MustAllocateOwn(*pool, kPage);
    EXPECT_EQ(pool->free_bytes(), 0u);
  }
  // Every byte came back: the whole budget can be had again, either way.
  EXPECT_EQ(pool->free_bytes(), 8 * kPage);
  StagingRegion all = MustAllocateOwn(*pool, 8 * kPage);
  EXPECT_EQ(pool->free_bytes(), 0u);
  all = StagingRegion();
  StagingRegion whole_slab = MustAllocate(*pool, 8 * kPage);
  EXPECT_EQ(whole_slab.offset(), 0u);
}

TEST(StagingPoolTest, AnOwnMemfdLargerThanThePoolIsRefused) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  absl::StatusOr<StagingRegion> r = pool->AllocateOwnMemfd(4 * kPage + 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("asked for ", 4 * kPage + 1,
                                                           " bytes, more than the whole pool")));
  for (uint64_t bytes : {~uint64_t{0}, uint64_t{1} << 63}) {
    r = pool->AllocateOwnMemfd(bytes);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
    EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("asked for ", bytes)));
  }
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
  StagingRegion zero = MustAllocateOwn(*pool, 0);  // at least a page
  EXPECT_EQ(zero.size(), kPage);
}

TEST(StagingPoolTest, MovingAnOwnMemfdKeepsOneOwnerAndReturnsItsBytesOnce) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion a = MustAllocateOwn(*pool, kPage);
  std::byte* data = a.data();
  StagingRegion b(std::move(a));
  EXPECT_FALSE(a.own_memfd());
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_TRUE(b.own_memfd());
  EXPECT_EQ(b.data(), data);
  StagingRegion c = MustAllocateOwn(*pool, 2 * kPage);
  EXPECT_EQ(pool->free_bytes(), kPage);
  c = std::move(b);  // c's 2 pages go back
  EXPECT_EQ(pool->free_bytes(), 3 * kPage);
  EXPECT_EQ(c.data(), data);
  c = StagingRegion();
  a = StagingRegion();
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);
}

TEST(StagingPoolTest, TakingTheMemfdLeavesTheMappingAndTheBudgetWithTheRegion) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  StagingRegion r = MustAllocateOwn(*pool, kPage);
  UniqueFd fd = r.TakeMemfd();
  ASSERT_TRUE(fd.valid());
  EXPECT_TRUE(r.own_memfd());
  EXPECT_EQ(r.DupMemfd().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.DupMemfd().status().message(), HasSubstr("held by its session"));
  r.data()[3] = std::byte{0x5A};  // still mapped
  EXPECT_EQ(pool->free_bytes(), 3 * kPage);
  absl::StatusOr<Mapping> m = Mapping::Map(fd.get(), 0, kPage, false);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->data()[3], std::byte{0x5A});
  r = StagingRegion();
  EXPECT_EQ(pool->free_bytes(), 4 * kPage);  // the budget went with the region
  struct stat st {};
  ASSERT_EQ(::fstat(fd.get(), &st), 0);
  EXPECT_EQ(st.st_blocks, 0);  // and so did its pages: nothing held outside the budget
  // A mapping reads zeros (a page it touches now is its own process's to pay for).
  EXPECT_EQ(m->data()[3], std::byte{0});
}

// The equivalent of ANewRegionIsZeroedWhateverTheLastOwnerWrote for rings of their own: a
// new ring is zeroed, and a consumer that still maps an ended ring sees nothing of the next
// session's.
TEST(StagingPoolTest, ANewOwnMemfdIsZeroedAndAnOldMappingSeesOnlyItsOwnPages) {
  std::unique_ptr<StagingPool> pool = MakePool(4 * kPage, 4 * kPage);
  ASSERT_NE(pool, nullptr);
  auto all = [](const std::byte* p, uint64_t n, std::byte v) {
    return std::all_of(p, p + n, [v](std::byte b) { return b == v; });
  };
  for (bool keep : {false, true}) {
    absl::StatusOr<Mapping> old_view;
    {
      StagingRegion first = MustAllocateOwn(*pool, 4 * kPage);
      std::memset(first.data(), 0xAB, first.size());
      UniqueFd fd = MustDup(first);
      old_view = Mapping::Map(fd.get(), 0, first.size(), false);
      ASSERT_TRUE(old_view.ok()) << old_view.status();
      if (keep) first.KeepPagesForConsumer();
    }  // the session ended: the daemon unmapped and closed it, the budget is back
    EXPECT_EQ(pool->free_bytes(), 4 * kPage);
    StagingRegion second = MustAllocateOwn(*pool, 4 * kPage);  // the whole budget again
    EXPECT_TRUE(all(second.data(), second.size(), std::byte{0}));
    std::memset(second.data(), 0xCD, second.size());
    // The ended ring's pages went with its budget (zeros), unless left to the consumer (a
    // daemon shutting down): holding ring fds cannot keep memory past --staging_bytes.
    EXPECT_TRUE(all(old_view->data(), old_view->size(), keep ? std::byte{0xAB} : std::byte{0}))
        << keep;
  }
}

}  // namespace
}  // namespace gpufeed::server
