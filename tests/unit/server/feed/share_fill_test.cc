// Sharing groups at the feed (docs/ARCHITECTURE.md section 9): jobs of one group, each its own
// feed (batch size, world size, augmentation seed), fill through one ShareCache. Each job's
// slots are byte for byte its fills alone in the group, whatever the others did first; what a
// job decoded, the others find.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
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

// A fill that ends early (here its deadline, after 3 of its 8 rows) lets go of the decodes in
// flight of every row it claimed, started or not: the group holds none once it ended, the
// other member still in it, nor after its member left.
TEST_F(ShareFillTest, AFillCutShortLeavesNoDecodeInFlight) {
  ShareCache cache(64 << 20);
  std::shared_ptr<Feed> feed = FeedOf({8, 1, 1});
  auto a = std::make_unique<ShareCache::Member>(
      *cache.Join("g", feed->ShareIdentity(), feed->OrderCursor({0, 0})));
  ShareCache::Member b = *cache.Join("g", feed->ShareIdentity(), feed->OrderCursor({0, 0}));
  int ticks = 0;
  FillDeadline deadline;
  deadline.at = absl::UnixEpoch() + absl::Seconds(3);
  deadline.clock = [&ticks] { return absl::UnixEpoch() + absl::Seconds(ticks++); };
  deadline.budget = absl::Seconds(3);
  std::vector<uint8_t> slot(feed->layout().stride_bytes);
  std::vector<int64_t> ids(8);
  absl::StatusOr<int64_t> valid = feed->Fill({0, 0}, 0, reinterpret_cast<std::byte*>(slot.data()),
                                             ids, nullptr, deadline, a.get());
  EXPECT_EQ(valid.status().code(), absl::StatusCode::kDeadlineExceeded) << valid.status();
  EXPECT_EQ(cache.Groups()[0].counters.misses, 8u);
  EXPECT_EQ(cache.Groups()[0].pending, 0);
  a.reset();
  ASSERT_EQ(cache.Groups().size(), 1u);
  EXPECT_EQ(cache.Groups()[0].members, 1);
  EXPECT_EQ(cache.Groups()[0].pending, 0);
}

// A sharing group across uids (the daemon's share_groups_across_uids), with two readers'
// rights: the daemon checks mode bits for the reader itself (common/os/file.h), so two uids
// need no uid switching here, only two PeerCreds. The owner may read every file; another uid
// may list every folder but not read one file (0600).
class ShareAcrossUidsTest : public ShareFillTest {
 protected:
  void SetUp() override {
    ShareFillTest::SetUp();
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    for (int c = 0; c < 3; ++c) {
      ASSERT_EQ(::chmod(absl::StrCat(dir_.path(), "/c", c).c_str(), 0755), 0);
    }
    secret_ = absl::StrCat(dir_.path(), "/c0/100.jpg");  // sample 0
    ASSERT_EQ(::chmod(secret_.c_str(), 0600), 0);
    owner_.uid = ::geteuid();
    owner_.gid = ::getegid();
    other_.uid = owner_.uid == 4242 ? 4243 : 4242;
    other_.gid = other_.uid;
  }

  // The feed `reader` attaches through a descriptor of the folder, as the client library does.
  std::shared_ptr<Feed> FeedAs(const PeerCred& reader, const Job& job) {
    FeedSpec spec = FeedOf(job)->spec();
    UniqueFd fd(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    absl::StatusOr<std::string> handle = registry_.AddDatasetHandle(std::move(fd), reader);
    EXPECT_TRUE(handle.ok()) << handle.status();
    spec.dataset.handle = *handle;
    Caller caller;
    caller.cred = reader;
    absl::StatusOr<std::shared_ptr<Feed>> feed = registry_.GetOrCreate(spec, caller);
    EXPECT_TRUE(feed.ok()) << feed.status();
    return *feed;
  }

  static uint64_t Decodes(const Feed& feed) {
    return feed.counters().decodes(metrics::Decoder::kCpu) +
           feed.counters().decodes(metrics::Decoder::kCpuRegion);
  }

  FeedRegistry registry_{PosixFileSystem()};
  std::string secret_;
  PeerCred owner_, other_;
};

// The other uid's rows take the owner's decodes of every file it may read (each checked by
// its own open) and never the owner's decode of the file it may not: that row reads the file
// itself, which fails as it fails alone (a bad sample, replaced by the next). Its bytes are
// its solo run's.
TEST_F(ShareAcrossUidsTest, ARowNeverGetsAnotherUidsDecodeOfAFileItsUidMayNotRead) {
  const Job job{8, 1, 5};
  std::shared_ptr<Feed> a = FeedAs(owner_, job), b = FeedAs(other_, job);
  ASSERT_NE(a, b);
  EXPECT_EQ(a->ShareIdentity(true), b->ShareIdentity(true));
  EXPECT_NE(a->ShareIdentity(), b->ShareIdentity());  // a group of one uid: its rights differ
  EXPECT_EQ(a->ShareIdentity(true).find(dir_.path()), std::string::npos) << a->ShareIdentity(true);
  Slots solo;
  {
    ShareCache own(64 << 20);
    ShareCache::Member m = *own.Join("uid 4242/sweep", b->ShareIdentity(), 0, {other_.uid});
    FillEpoch(*b, 0, {&m}, &solo);
  }
  // The secret one is never decoded; its replacement, the next sample, is decoded twice.
  const uint64_t solo_decodes = Decodes(*b);
  EXPECT_EQ(solo_decodes, uint64_t{kImages});
  ShareCache cache(64 << 20);
  ShareCache::Member ma =
      *cache.Join("uid */sweep", a->ShareIdentity(true), 0, {owner_.uid});
  ShareCache::Member mb =
      *cache.Join("uid */sweep", b->ShareIdentity(true), 0, {other_.uid});
  Slots owner_slots, shared;
  FillEpoch(*a, 0, {&ma}, &owner_slots);
  EXPECT_EQ(cache.counters().entries, uint64_t{kImages});  // the secret one's decode among them
  FillEpoch(*b, 0, {&mb}, &shared);
  EXPECT_TRUE(shared == solo);
  const ShareCounters c = cache.counters();
  EXPECT_EQ(c.read_checks_refused, 1u);
  EXPECT_EQ(c.read_checks_passed, uint64_t{kImages} - 1);
  EXPECT_EQ(c.misses, uint64_t{kImages});  // the owner's
  // The other uid decoded only the replacement of the file it may not read; the next sample,
  // which it had found in the cache, is read privately as the replacement.
  EXPECT_EQ(Decodes(*b) - solo_decodes, 1u);
}

// A uid that cannot list a folder the owner lists reads another sample list: it cannot join,
// and the refusal names nothing of the other uid's attach.
TEST_F(ShareAcrossUidsTest, AnotherSampleListIsAnotherDataset) {
  const std::string hidden = absl::StrCat(dir_.path(), "/c2/hidden");
  WriteFileBytes(hidden + "/extra.jpg",
                 EncodeJpeg(Picture(32, 32, 3, 99), 32, 32, TJPF_RGB, TJSAMP_420, 90));
  ASSERT_EQ(::chmod(hidden.c_str(), 0700), 0);
  const Job job{8, 1, 5};
  std::shared_ptr<Feed> a = FeedAs(owner_, job), b = FeedAs(other_, job);
  EXPECT_EQ(a->dataset().num_samples(), uint64_t{kImages} + 1);
  EXPECT_EQ(b->dataset().num_samples(), uint64_t{kImages});
  ShareCache cache(64 << 20);
  ShareCache::Member ma = *cache.Join("uid */sweep", a->ShareIdentity(true), 0, {owner_.uid});
  absl::StatusOr<ShareCache::Member> mb =
      cache.Join("uid */sweep", b->ShareIdentity(true), 0, {other_.uid});
  EXPECT_EQ(mb.status().code(), absl::StatusCode::kFailedPrecondition) << mb.status();
  EXPECT_EQ(mb.status().message().find(dir_.path()), std::string::npos) << mb.status();
}

// As many samples, other files: the sample list's digest tells them apart. Two folders each
// only one of two uids may list (chown: as root only).
TEST_F(ShareAcrossUidsTest, AsManySamplesOfOtherFilesIsAnotherDataset) {
  if (::geteuid() != 0) GTEST_SKIP() << "giving each uid a folder of its own needs chown (root)";
  const PeerCred first{4241, 4241, 0, {}}, second{4242, 4242, 0, {}};
  for (const PeerCred& who : {first, second}) {
    const std::string folder = absl::StrCat(dir_.path(), "/c2/only", who.uid);
    WriteFileBytes(folder + "/extra.jpg",
                   EncodeJpeg(Picture(32, 32, 3, 99), 32, 32, TJPF_RGB, TJSAMP_420, 90));
    ASSERT_EQ(::chown(folder.c_str(), who.uid, who.gid), 0);
    ASSERT_EQ(::chmod(folder.c_str(), 0700), 0);
  }
  const Job job{8, 1, 5};
  std::shared_ptr<Feed> a = FeedAs(first, job), b = FeedAs(second, job);
  EXPECT_EQ(a->dataset().num_samples(), b->dataset().num_samples());
  EXPECT_NE(a->ShareIdentity(true), b->ShareIdentity(true));
  ShareCache cache(64 << 20);
  ShareCache::Member ma = *cache.Join("uid */sweep", a->ShareIdentity(true), 0, {first.uid});
  EXPECT_EQ(cache.Join("uid */sweep", b->ShareIdentity(true), 0, {second.uid}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace gpufeed::server
