#include "server/objstore/object_cache.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::objstore {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kBlock = 4096;

std::vector<std::byte> MakeBytes(uint64_t size, uint64_t seed) {
  std::vector<std::byte> bytes(size);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : bytes) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::byte>(x);
  }
  return bytes;
}

// One version of an object in a fake store, counting the fetches made of it. A fetch can be
// held at a gate, and the first `fail_calls` calls fail.
struct Source {
  explicit Source(ObjectId object_id, uint64_t size, uint64_t seed)
      : id(std::move(object_id)), bytes(MakeBytes(size, seed)) {}

  absl::Status Fetch(uint64_t offset, std::span<std::byte> out) {
    ++calls;
    if (offset > bytes.size() || out.size() > bytes.size() - offset) {
      ++past_end;
      return absl::OutOfRangeError("fetch past the end");
    }
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](bool* closed) { return !*closed; }, &gate_closed));
    }
    if (fail_calls.fetch_sub(1) > 0) return absl::UnavailableError("injected: 503 SlowDown");
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    std::memcpy(out.data(), bytes.data() + offset, out.size());
    fetched_bytes += out.size();
    return absl::OkStatus();
  }
  void CloseGate() {
    absl::MutexLock lock(&mu);
    gate_closed = true;
  }
  void OpenGate() {
    absl::MutexLock lock(&mu);
    gate_closed = false;
  }
  uint64_t size() const { return bytes.size(); }

  const ObjectId id;
  const std::vector<std::byte> bytes;
  std::atomic<int> calls{0};
  std::atomic<int> past_end{0};
  std::atomic<uint64_t> fetched_bytes{0};
  std::atomic<int> fail_calls{0};
  int delay_ms = 0;
  absl::Mutex mu;
  bool gate_closed ABSL_GUARDED_BY(mu) = false;
};

std::shared_ptr<Source> MakeSource(const std::string& key, uint64_t size, uint64_t seed = 1,
                                   const std::string& etag = "\"e1\"") {
  return std::make_shared<Source>(ObjectId{"", "bucket", key, etag}, size, seed);
}

// The fetch a reader hands the cache: it shares the source, so it outlives the Read.
BlockFetch FetchOf(const std::shared_ptr<Source>& source) {
  return [source](uint64_t offset, std::span<std::byte> out) { return source->Fetch(offset, out); };
}

// Reads [offset, offset + n) of `source` through `cache`, and checks the bytes.
void ReadAndCheck(ObjectCache& cache, const std::shared_ptr<Source>& source, uint64_t offset,
                  uint64_t n) {
  std::vector<std::byte> dst(n);
  ASSERT_TRUE(cache.Read(source->id, source->size(), offset, dst, FetchOf(source)).ok())
      << "offset " << offset << " n " << n;
  ASSERT_EQ(0, std::memcmp(dst.data(), source->bytes.data() + offset, n))
      << "offset " << offset << " n " << n;
}

void ReadBlockAndCheck(ObjectCache& cache, const std::shared_ptr<Source>& source, uint64_t index) {
  uint64_t offset = index * cache.block_bytes();
  ReadAndCheck(cache, source, offset, std::min(cache.block_bytes(), source->size() - offset));
}

// Waits (up to 10 s) for a counter of the cache (moved by other threads) to reach `value`.
void WaitForStat(const ObjectCache& cache, uint64_t ObjectCacheStats::*counter, uint64_t value) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (cache.stats().*counter < value && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(cache.stats().*counter, value);
}

std::unique_ptr<ObjectCache> MakeCache(uint64_t capacity_blocks, int read_ahead,
                                       const std::string& dir = "") {
  ObjectCacheOptions options;
  options.dir = dir;
  options.capacity_bytes = capacity_blocks * kBlock;
  options.block_bytes = kBlock;
  options.read_ahead_blocks = read_ahead;
  options.prefetch_threads = 2;
  absl::StatusOr<std::unique_ptr<ObjectCache>> cache = ObjectCache::Create(options);
  EXPECT_TRUE(cache.ok()) << cache.status();
  return cache.ok() ? std::move(*cache) : nullptr;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "object_cache_test.XXXXXX");
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<std::string> FileNames(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Memory and disk mode run the same tests where the mode should not matter.
class ObjectCacheModeTest : public ::testing::TestWithParam<bool> {
 protected:
  std::string Dir() { return GetParam() ? dir_.path() + "/cache" : ""; }
  TempDir dir_;
};

TEST_P(ObjectCacheModeTest, RandomReadsAcrossBlockEdgesAreExact) {
  auto cache = MakeCache(64, 2, Dir());
  auto a = MakeSource("a", 10 * kBlock + 123, 1);
  auto b = MakeSource("b", 3 * kBlock, 2);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 400; ++i) {
    const auto& s = (i % 3 == 0) ? b : a;
    uint64_t offset = rng() % s->size();
    // Often straddle a block edge.
    if (i % 2 == 0) offset = std::min<uint64_t>(s->size() - 1, (offset / kBlock + 1) * kBlock - 7);
    uint64_t n = 1 + rng() % std::min<uint64_t>(3 * kBlock, s->size() - offset);
    ReadAndCheck(*cache, s, offset, n);
  }
  ReadAndCheck(*cache, a, 0, a->size());  // the whole object, last block short
  std::vector<std::byte> dst(2);
  absl::Status past = cache->Read(a->id, a->size(), a->size() - 1, dst, FetchOf(a));
  EXPECT_EQ(past.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(past.message(), HasSubstr("s3://bucket/a"));
  EXPECT_TRUE(cache->Read(a->id, a->size(), a->size(), {}, FetchOf(a)).ok());
  EXPECT_EQ(a->past_end + b->past_end, 0);
}

TEST_P(ObjectCacheModeTest, SecondPassOverASetThatFitsFetchesNothing) {
  auto cache = MakeCache(16, 0, Dir());
  std::vector<std::shared_ptr<Source>> set = {
      MakeSource("x", 5 * kBlock + 10, 1), MakeSource("y", 4 * kBlock, 2), MakeSource("z", 100, 3)};
  for (const auto& s : set) ReadAndCheck(*cache, s, 0, s->size());
  ObjectCacheStats first = cache->stats();
  EXPECT_EQ(first.fetches, 6u + 4u + 1u);
  EXPECT_EQ(first.fetched_bytes, 5 * kBlock + 10 + 4 * kBlock + 100);
  for (const auto& s : set) ReadAndCheck(*cache, s, 0, s->size());
  ObjectCacheStats second = cache->stats();
  EXPECT_EQ(second.fetched_bytes, first.fetched_bytes);
  EXPECT_EQ(second.fetches, first.fetches);
  EXPECT_EQ(second.hits, 11u);
  EXPECT_EQ(second.evictions, 0u);
  EXPECT_EQ(second.resident_bytes, 11 * kBlock);  // the short blocks are charged 4 KiB
}

TEST_P(ObjectCacheModeTest, ConcurrentReadersOfAMissingBlockShareOneFetch) {
  auto cache = MakeCache(16, 0, Dir());
  auto s = MakeSource("one", 2 * kBlock);
  s->CloseGate();
  constexpr int kThreads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      std::vector<std::byte> dst(100 + i);
      if (cache->Read(s->id, s->size(), 50 * i, dst, FetchOf(s)).ok() &&
          std::memcmp(dst.data(), s->bytes.data() + 50 * i, dst.size()) == 0) {
        ++ok;
      }
    });
  }
  // Every reader is in: one fetching, the others waiting for it.
  WaitForStat(*cache, &ObjectCacheStats::misses, kThreads);
  EXPECT_EQ(s->calls, 1);
  s->OpenGate();
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok, kThreads);
  EXPECT_EQ(s->calls, 1);
  EXPECT_EQ(cache->stats().fetches, 1u);
}

// A failed fetch is its own reader's error: the readers waiting on it fetch once themselves
// (the failed fetch may have carried another tenant's expired credentials), and the block is
// cached from the fetch that worked. Where the store fails them too, each has the error after
// at most one fetch of its own, and nothing is cached.
TEST_P(ObjectCacheModeTest, AFailedFetchIsItsReadersAndItsWaitersFetchThemselves) {
  constexpr int kThreads = 6;
  const auto run = [&](ObjectCache& cache, const std::shared_ptr<Source>& s) {
    s->CloseGate();
    const uint64_t misses = cache.stats().misses;
    std::vector<std::thread> threads;
    std::vector<absl::Status> results(kThreads);
    for (int i = 0; i < kThreads; ++i) {
      threads.emplace_back([&, i] {
        std::vector<std::byte> dst(10);
        results[i] = cache.Read(s->id, s->size(), 0, dst, FetchOf(s));
      });
    }
    WaitForStat(cache, &ObjectCacheStats::misses, misses + kThreads);
    s->OpenGate();
    for (auto& t : threads) t.join();
    return results;
  };
  auto cache = MakeCache(16, 0, Dir());
  auto s = MakeSource("flaky", kBlock);
  s->fail_calls = 1;
  std::vector<absl::Status> results = run(*cache, s);
  int failed = 0;
  for (const absl::Status& r : results) {
    if (r.ok()) continue;
    ++failed;
    EXPECT_EQ(r.code(), absl::StatusCode::kUnavailable) << r;
    EXPECT_THAT(r.message(), HasSubstr("SlowDown"));
  }
  EXPECT_EQ(failed, 1);  // only the reader whose fetch failed
  EXPECT_EQ(s->calls, 2);
  ReadAndCheck(*cache, s, 0, s->size());  // cached from the second fetch
  EXPECT_EQ(s->calls, 2);

  auto down = MakeSource("down", kBlock, 2);
  down->fail_calls = 1000;
  for (const absl::Status& r : run(*cache, down)) {
    EXPECT_EQ(r.code(), absl::StatusCode::kUnavailable) << r;
  }
  EXPECT_LE(down->calls, kThreads);
  EXPECT_EQ(cache->stats().resident_bytes, 4096u);  // `flaky`'s block only
}

TEST_P(ObjectCacheModeTest, AnotherEtagIsFetchedNotServedFromTheCache) {
  auto cache = MakeCache(16, 0, Dir());
  auto v1 = MakeSource("k", 2 * kBlock, 1, "\"v1\"");
  auto v2 = MakeSource("k", 2 * kBlock, 2, "\"v2\"");
  ReadAndCheck(*cache, v1, 0, v1->size());
  ReadAndCheck(*cache, v2, 0, v2->size());  // checks v2's bytes: none of v1's
  EXPECT_EQ(v1->calls, 2);
  EXPECT_EQ(v2->calls, 2);
  auto other_endpoint = std::make_shared<Source>(
      ObjectId{"http://minio:9000", "bucket", "k", "\"v1\""}, 2 * kBlock, 3);
  ReadAndCheck(*cache, other_endpoint, 0, other_endpoint->size());
  EXPECT_EQ(other_endpoint->calls, 2);
  ReadAndCheck(*cache, v1, 0, v1->size());  // still cached
  EXPECT_EQ(v1->calls, 2);
}

TEST_P(ObjectCacheModeTest, CapacityHoldsUnderConcurrentRandomReads) {
  constexpr uint64_t kCapacityBlocks = 12;
  auto cache = MakeCache(kCapacityBlocks, 2, Dir());
  std::vector<std::shared_ptr<Source>> sources;
  for (int i = 0; i < 5; ++i) {
    sources.push_back(MakeSource(absl::StrCat("obj", i), 20 * kBlock + 17 * i, i + 1));
  }
  std::atomic<uint64_t> max_resident{0};
  std::atomic<bool> done{false};
  std::thread monitor([&] {
    while (!done) {
      uint64_t r = cache->stats().resident_bytes;
      uint64_t m = max_resident.load();
      while (r > m && !max_resident.compare_exchange_weak(m, r)) {
      }
    }
  });
  std::vector<std::thread> readers;
  std::atomic<int> bad{0};
  for (int t = 0; t < 8; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int i = 0; i < 300; ++i) {
        const auto& s = sources[rng() % sources.size()];
        uint64_t offset = rng() % s->size();
        uint64_t n = 1 + rng() % std::min<uint64_t>(2 * kBlock, s->size() - offset);
        std::vector<std::byte> dst(n);
        if (!cache->Read(s->id, s->size(), offset, dst, FetchOf(s)).ok() ||
            std::memcmp(dst.data(), s->bytes.data() + offset, n) != 0) {
          ++bad;
        }
      }
    });
  }
  for (auto& r : readers) r.join();
  done = true;
  monitor.join();
  EXPECT_EQ(bad, 0);
  ObjectCacheStats st = cache->stats();
  EXPECT_LE(max_resident.load(), kCapacityBlocks * kBlock);
  EXPECT_LE(st.resident_bytes, kCapacityBlocks * kBlock);
  EXPECT_GT(st.evictions, 0u);
  for (const auto& s : sources) EXPECT_EQ(s->past_end, 0);
  if (GetParam()) {
    // On disk: the block files are the resident blocks, nothing more (read-ahead may still
    // be finishing: wait for it by destroying the cache's threads first).
    cache.reset();
    uint64_t files = 0;
    for (const auto& name : FileNames(Dir())) files += name.ends_with(".blk");
    EXPECT_LE(files, kCapacityBlocks);
  }
}

INSTANTIATE_TEST_SUITE_P(MemoryAndDisk, ObjectCacheModeTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Disk" : "Memory"; });

TEST(ObjectCacheTest, HintedBlocksOutliveAScanLargerThanTheCache) {
  for (bool hinted : {false, true}) {
    auto cache = MakeCache(4, 0);
    auto s = MakeSource("scan", 12 * kBlock);
    ReadBlockAndCheck(*cache, s, 0);
    ReadBlockAndCheck(*cache, s, 1);
    if (hinted) {
      cache->Hint(s->id, 0, 100);
      cache->Hint(s->id, 1, 101);
    }
    for (uint64_t i = 2; i < 12; ++i) ReadBlockAndCheck(*cache, s, i);
    EXPECT_EQ(s->calls, 12);
    ReadBlockAndCheck(*cache, s, 0);
    ReadBlockAndCheck(*cache, s, 1);
    // With the hints, blocks 0 and 1 stayed; without them LRU dropped them first.
    EXPECT_EQ(s->calls, hinted ? 12 : 14) << (hinted ? "hinted" : "LRU");
    EXPECT_LE(cache->stats().resident_bytes, 4 * kBlock);
  }
}

TEST(ObjectCacheTest, FarthestNextUseBeatsLruOnACycle) {
  // Six blocks read in a cycle, three times, through a cache of four: LRU misses every read;
  // with each block's next read hinted (the feed knows its order), Belady's rule keeps the
  // blocks read soonest: 10 misses (6 first reads, then 2 per round).
  constexpr int kBlocks = 6;
  constexpr int kRounds = 3;
  for (bool hinted : {false, true}) {
    auto cache = MakeCache(4, 0);
    auto s = MakeSource("cycle", kBlocks * kBlock);
    if (hinted) {
      for (int b = 0; b < kBlocks; ++b) cache->Hint(s->id, b, b);
    }
    for (int t = 0; t < kBlocks * kRounds; ++t) {
      ReadBlockAndCheck(*cache, s, t % kBlocks);
      if (hinted && t + kBlocks < kBlocks * kRounds) cache->Hint(s->id, t % kBlocks, t + kBlocks);
    }
    EXPECT_EQ(s->calls, hinted ? 10 : kBlocks * kRounds) << (hinted ? "hinted" : "LRU");
  }
}

TEST(ObjectCacheTest, HintsNamingAReadAlreadyMadeAreIgnored) {
  auto cache = MakeCache(2, 0);
  auto s = MakeSource("stale", 4 * kBlock);
  cache->Hint(s->id, 0, 5);
  ReadBlockAndCheck(*cache, s, 0);  // consumes the read at 5
  cache->Hint(s->id, 0, 5);         // a window re-hinted after the read: stale
  cache->Hint(s->id, 1, 9);
  ReadBlockAndCheck(*cache, s, 1);  // consumes 9
  cache->Hint(s->id, 1, 20);
  ReadBlockAndCheck(*cache, s, 2);  // must evict: block 0 (no pending read), not block 1
  EXPECT_EQ(s->calls, 3);
  ReadBlockAndCheck(*cache, s, 1);
  EXPECT_EQ(s->calls, 3);
}

TEST(ObjectCacheTest, ReadAheadTurnsASequentialScanIntoHitsAndStopsAtTheEnd) {
  auto cache = MakeCache(64, 2);
  auto s = MakeSource("seq", 5 * kBlock + 100);
  for (uint64_t i = 0; i < 6; ++i) {
    ReadBlockAndCheck(*cache, s, i);
    // After block i, blocks up to i+2 are fetched (or being fetched): wait for them.
    uint64_t through = std::min<uint64_t>(i + 2, 5);
    WaitForStat(*cache, &ObjectCacheStats::fetched_bytes,
                std::min(s->size(), (through + 1) * kBlock));
  }
  ObjectCacheStats st = cache->stats();
  EXPECT_EQ(st.misses, 1u);
  EXPECT_EQ(st.hits, 5u);
  EXPECT_EQ(st.prefetches, 5u);
  EXPECT_EQ(st.prefetch_hits, 5u);
  EXPECT_EQ(st.fetches, 6u);
  EXPECT_EQ(st.fetched_bytes, s->size());
  EXPECT_EQ(s->past_end, 0);
  EXPECT_EQ(s->calls, 6);
}

// A feed's own order (ObjectStore::File::WillRead): blocks prefetched out of the object's
// order, each read then a hit; a resident block and one past the end are not fetched again.
TEST(ObjectCacheTest, PrefetchFetchesTheBlocksAReaderNamesInItsOrder) {
  auto cache = MakeCache(64, 2);
  auto s = MakeSource("shuffled", 6 * kBlock);
  for (uint64_t b : {4u, 1u, 5u}) {
    cache->Hint(s->id, b, 10 + b);
    cache->Prefetch(s->id, s->size(), b, FetchOf(s));
  }
  cache->Prefetch(s->id, s->size(), 9, FetchOf(s));  // past the end: nothing
  WaitForStat(*cache, &ObjectCacheStats::fetched_bytes, 3 * kBlock);
  cache->Prefetch(s->id, s->size(), 4, FetchOf(s));  // resident: nothing
  for (uint64_t b : {4u, 1u, 5u}) ReadBlockAndCheck(*cache, s, b);
  ObjectCacheStats st = cache->stats();
  EXPECT_EQ(st.hits, 3u);
  EXPECT_EQ(st.misses, 0u);
  EXPECT_EQ(st.prefetch_hits, 3u);
  // The three, and the sequential read-ahead their first reads started (blocks 2 and 3 after
  // 1; none after 4 and 5): five fetches, no block twice, none past the end.
  WaitForStat(*cache, &ObjectCacheStats::fetched_bytes, 5 * kBlock);
  EXPECT_EQ(s->calls, 5);
  EXPECT_EQ(s->past_end, 0);
}

TEST(ObjectCacheTest, ReadAheadNeverEvictsABlockNeededSooner) {
  // Capacity 2: `soon` is hinted; block 0 of `scan` fills the cache while its fetch is slow,
  // so the read-ahead of block 1 could only make room by evicting `soon`: it must not.
  auto cache = MakeCache(2, 1);
  auto soon = MakeSource("soon", kBlock);
  auto scan = MakeSource("scan", 2 * kBlock);
  ReadAndCheck(*cache, soon, 0, kBlock);
  cache->Hint(soon->id, 0, 1);
  scan->delay_ms = 200;
  ReadBlockAndCheck(*cache, scan, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ReadAndCheck(*cache, soon, 0, kBlock);
  EXPECT_EQ(soon->calls, 1);
  EXPECT_LE(cache->stats().resident_bytes, 2 * kBlock);
}

TEST(ObjectCacheTest, ABlockLargerThanTheCapacityIsReadThrough) {
  ObjectCacheOptions options;
  options.capacity_bytes = kBlock;
  options.block_bytes = 4 * kBlock;
  options.read_ahead_blocks = 2;
  auto cache = ObjectCache::Create(options);
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto s = MakeSource("big", 10 * kBlock);
  ReadAndCheck(**cache, s, 3 * kBlock + 5, 2 * kBlock);
  ReadAndCheck(**cache, s, 3 * kBlock + 5, 2 * kBlock);
  ObjectCacheStats st = (*cache)->stats();
  EXPECT_EQ(st.resident_bytes, 0u);
  EXPECT_EQ(st.fetched_bytes, 4 * kBlock);  // only what was asked, twice
  EXPECT_EQ(s->fetched_bytes, 4 * kBlock);
}

TEST(ObjectCacheTest, ReadersThatDisagreeOnTheSizeAreRefused) {
  auto cache = MakeCache(8, 0);
  auto s = MakeSource("sized", kBlock + 10);
  ReadAndCheck(*cache, s, 0, s->size());
  std::vector<std::byte> dst(5);
  absl::Status st = cache->Read(s->id, kBlock + 20, kBlock, dst, FetchOf(s));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
}

TEST(ObjectCacheTest, OptionsAreValidatedNamingTheFlag) {
  ObjectCacheOptions options;
  options.capacity_bytes = 0;
  auto cache = ObjectCache::Create(options);
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(cache.status().message(), HasSubstr("cache_bytes"));

  TempDir tmp;
  std::string file = tmp.path() + "/plain";
  WriteFile(file, "x");
  options.capacity_bytes = kBlock;
  options.dir = file;
  cache = ObjectCache::Create(options);
  EXPECT_FALSE(cache.ok());
  EXPECT_THAT(cache.status().message(), HasSubstr("cache_dir"));
}

// A directory others may write is refused: a block file swapped in there would be served to
// every reader of the node.
TEST(ObjectCacheDiskTest, ADirectoryOthersMayWriteIsRefused) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/shared";
  ASSERT_EQ(::mkdir(dir.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  ObjectCacheOptions o;
  o.dir = dir;
  o.capacity_bytes = 8 * kBlock;
  o.block_bytes = kBlock;
  absl::StatusOr<std::unique_ptr<ObjectCache>> cache = ObjectCache::Create(o);
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(cache.status().message(), HasSubstr("cache_dir: " + dir));
  EXPECT_THAT(cache.status().message(), HasSubstr("mode 0777"));
  ASSERT_EQ(::chmod(dir.c_str(), 0700), 0);
  EXPECT_TRUE(ObjectCache::Create(o).ok());
}

TEST(ObjectCacheDiskTest, DirectoryAndFilesArePrivateAndForeignFilesSurvive) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/a/b";
  auto cache = MakeCache(8, 0, dir);
  ASSERT_NE(cache, nullptr);
  struct stat st;
  ASSERT_EQ(stat(dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat((tmp.path() + "/a").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  auto s = MakeSource("f", 2 * kBlock);
  ReadAndCheck(*cache, s, 0, s->size());
  int blocks = 0;
  for (const auto& name : FileNames(dir)) {
    ASSERT_EQ(stat((dir + "/" + name).c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << name;
    if (name.ends_with(".blk")) {
      ++blocks;
      EXPECT_EQ(st.st_size, static_cast<off_t>(kBlock)) << name;
      EXPECT_TRUE(name.starts_with("gpufeed-cache-")) << name;
    }
    EXPECT_FALSE(name.ends_with(".tmp")) << name;
  }
  EXPECT_EQ(blocks, 2);
}

TEST(ObjectCacheDiskTest, ANewCacheOverTheSameDirectoryStartsCleanAndServesNoStaleFile) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  auto s = MakeSource("f", 3 * kBlock);
  {
    auto cache = MakeCache(8, 0, dir);
    ReadAndCheck(*cache, s, 0, s->size());
    // Another cache may not share the directory while this one holds it.
    ObjectCacheOptions options;
    options.dir = dir;
    options.capacity_bytes = kBlock;
    auto second = ObjectCache::Create(options);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(second.status().message(), HasSubstr("cache_dir"));
  }
  EXPECT_EQ(s->calls, 3);
  // What a crash may leave: a half-written temp file, and a block file with wrong bytes under
  // the name the next cache will write first. Files of other naming are not the cache's.
  WriteFile(dir + "/gpufeed-cache-0000000000000001.blk", "garbage");
  WriteFile(dir + "/gpufeed-cache-00000000000000ff.tmp", "half");
  WriteFile(dir + "/gpufeed-cache-notmine.blk", "keep");
  WriteFile(dir + "/gpufeed-cache-00000000000000FF.blk", "keep: upper case is not ours");
  WriteFile(dir + "/README", "keep");

  auto cache = MakeCache(8, 0, dir);
  std::vector<std::string> names = FileNames(dir);
  EXPECT_EQ(names, (std::vector<std::string>{"README", "gpufeed-cache-00000000000000FF.blk",
                                             "gpufeed-cache-notmine.blk", "gpufeed-cache.lock"}));
  ReadAndCheck(*cache, s, 0, s->size());  // refetched, exact
  EXPECT_EQ(s->calls, 6);
  ReadAndCheck(*cache, s, 0, s->size());  // and now cached
  EXPECT_EQ(s->calls, 6);
}

TEST(ObjectCacheDiskTest, ABlockFileRemovedBehindTheCacheIsFetchedAgain) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/cache";
  auto cache = MakeCache(8, 0, dir);
  auto s = MakeSource("f", kBlock);
  ReadAndCheck(*cache, s, 0, s->size());
  for (const auto& name : FileNames(dir)) {
    if (name.ends_with(".blk")) std::filesystem::remove(dir + "/" + name);
  }
  ReadAndCheck(*cache, s, 0, s->size());
  EXPECT_EQ(s->calls, 2);
  ReadAndCheck(*cache, s, 0, s->size());
  EXPECT_EQ(s->calls, 2);
  EXPECT_EQ(cache->stats().resident_bytes, kBlock);
}

}  // namespace
}  // namespace gpufeed::objstore
