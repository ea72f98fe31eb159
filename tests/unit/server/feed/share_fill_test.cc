// Sharing groups at the feed (docs/ARCHITECTURE.md section 9): jobs of one group, each its own
// feed (batch size, world size, augmentation seed), fill through one ShareCache. Each job's
// slots are byte for byte its fills alone in the group, whatever the others did first; what a
// job decoded, the others find.
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/feed/feed.h"
#include "server/share/share_cache.h"
#include "tests/testing/image_files.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::EncodePng;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::WriteFileBytes;

constexpr int kImages = 48;

struct Job {
  int64_t batch;
  int32_t world;
  uint64_t seed;
};

class ShareFillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < kImages; ++i) {
      const int h = 30 + (i * 7) % 40, w = 30 + (i * 13) % 50;
      const std::string name = absl::StrCat(dir_.path(), "/c", i % 3, "/", 100 + i);
      if (i % 5 == 4) {
        WriteFileBytes(name + ".png", EncodePng(Picture(h, w, 3, i), h, w));
      } else {
        WriteFileBytes(name + ".jpg", EncodeJpeg(Picture(h, w, 3, i), h, w, TJPF_RGB,
                                                 TJSAMP_420, 90));
      }
    }
  }

  std::shared_ptr<Feed> FeedOf(const Job& job, const std::string& group = "sweep") {
    FeedSpec spec;
    spec.dataset.kind = DatasetKind::kImageFolder;
    spec.dataset.path = dir_.path();
    spec.dataset.pipeline = {RandomResizedCropStep{12, {}}, FlipStep{0.5}};
    spec.batch_size = job.batch;
    spec.world_size = job.world;
    spec.seed = job.seed;
    spec.drop_last = false;
    spec.share_group = group;
    absl::StatusOr<std::shared_ptr<Feed>> feed = Feed::Create(spec, PosixFileSystem());
    EXPECT_TRUE(feed.ok()) << feed.status();
    return *feed;
  }

  // Every slot of `epochs` epochs of every rank, in order: (epoch, step, rank) -> bytes + ids.
  using Slots = std::map<std::tuple<int64_t, int64_t, int32_t>, std::vector<uint8_t>>;
  static void FillEpoch(const Feed& feed, int64_t epoch,
                        std::vector<ShareCache::Member*> members, Slots* out) {
    for (int64_t step = 0; step < feed.sampler().steps_per_epoch(); ++step) {
      for (int32_t rank = 0; rank < feed.spec().world_size; ++rank) {
        std::vector<uint8_t> slot(feed.layout().stride_bytes);
        std::vector<int64_t> ids(static_cast<size_t>(feed.spec().batch_size));
        absl::StatusOr<int64_t> valid =
            feed.Fill({epoch, step}, rank, reinterpret_cast<std::byte*>(slot.data()), ids,
                      nullptr, {}, members.empty() ? nullptr : members[rank]);
        ASSERT_TRUE(valid.ok()) << valid.status();
        slot.resize(feed.layout().used_bytes);
        for (int64_t id : ids) slot.insert(slot.end(), reinterpret_cast<uint8_t*>(&id),
                                           reinterpret_cast<uint8_t*>(&id) + sizeof(id));
        (*out)[{epoch, step, rank}] = std::move(slot);
      }
    }
  }

  testing::TempDir dir_;
};

TEST_F(ShareFillTest, EachJobGetsItsSoloBytesAndTheGroupDecodesEachImageOnce) {
  const std::vector<Job> jobs = {{8, 1, 1}, {4, 2, 2}, {16, 1, 3}};
  // Alone in the group: each job with a cache of its own.
  std::vector<Slots> solo(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    ShareCache own(64 << 20);
    std::shared_ptr<Feed> feed = FeedOf(jobs[j]);
    std::vector<ShareCache::Member> members;
    for (int32_t r = 0; r < jobs[j].world; ++r) {
      members.push_back(*own.Join("g", feed->ShareIdentity(), feed->OrderCursor({0, 0})));
    }
    std::vector<ShareCache::Member*> ptrs;
    for (auto& m : members) ptrs.push_back(&m);
    for (int64_t e = 0; e < 2; ++e) FillEpoch(*feed, e, ptrs, &solo[j]);
  }
  // Together, one epoch after another, the first job leading: the others find its decodes.
  ShareCache cache(64 << 20);
  std::vector<std::shared_ptr<Feed>> feeds;
  std::vector<std::vector<ShareCache::Member>> members(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    feeds.push_back(FeedOf(jobs[j]));
    for (int32_t r = 0; r < jobs[j].world; ++r) {
      members[j].push_back(
          *cache.Join("g", feeds[j]->ShareIdentity(), feeds[j]->OrderCursor({0, 0})));
    }
  }
  std::vector<Slots> shared(jobs.size());
  for (int64_t e = 0; e < 2; ++e) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      std::vector<ShareCache::Member*> ptrs;
      for (auto& m : members[j]) ptrs.push_back(&m);
      FillEpoch(*feeds[j], e, ptrs, &shared[j]);
    }
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    ASSERT_EQ(shared[j].size(), solo[j].size()) << "job " << j;
    for (const auto& [key, bytes] : solo[j]) {
      EXPECT_TRUE(shared[j].at(key) == bytes)
          << "job " << j << " epoch " << std::get<0>(key) << " step " << std::get<1>(key)
          << " rank " << std::get<2>(key);
    }
  }
  // The leader missed each image of the first epoch once; everything after found it (the
  // cache holds the whole dataset): 48 misses of 3 jobs x 2 epochs x 48 rows.
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.misses, uint64_t{kImages});
  EXPECT_EQ(c.hits, uint64_t{3 * 2 * kImages - kImages});
}

// The group's name fixes the order; the job's seed only its crops: two jobs of one group with
// other seeds read the same ids, other pixels; another group reads another order.
TEST_F(ShareFillTest, TheGroupNameIsTheOrderAndTheSeedOnlyTheAugmentation) {
  std::shared_ptr<Feed> a = FeedOf({8, 1, 1}), b = FeedOf({8, 1, 2});
  std::shared_ptr<Feed> c = FeedOf({8, 1, 1}, "another");
  Slots sa, sb, sc;
  FillEpoch(*a, 0, {}, &sa);
  FillEpoch(*b, 0, {}, &sb);
  FillEpoch(*c, 0, {}, &sc);
  const size_t ids_at = a->layout().used_bytes;
  int same_pixels = 0;
  for (const auto& [key, bytes] : sa) {
    EXPECT_TRUE(std::equal(bytes.begin() + ids_at, bytes.end(), sb.at(key).begin() + ids_at));
    same_pixels += std::equal(bytes.begin(), bytes.begin() + ids_at, sb.at(key).begin());
  }
  EXPECT_EQ(same_pixels, 0);
  EXPECT_FALSE(sa.at({0, 0, 0}) == sc.at({0, 0, 0}));
  EXPECT_EQ(a->spec().order_seed(), OrderSeedOf("sweep"));
  EXPECT_NE(a->fingerprint().find(";share_group=sweep"), std::string::npos) << a->fingerprint();
}

}  // namespace
}  // namespace gpufeed::server
