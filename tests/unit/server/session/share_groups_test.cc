// Sharing groups through the session manager: each uid's groups are its own, but for the names
// the admin lets uids share (share_groups_across_uids). Two uids here are two callers' creds:
// the daemon checks the mode bits of the files for the caller itself, so the test runs as one
// user.
#include <sys/stat.h>

#include "tests/unit/server/session/session_manager_fixture.h"
#include "tests/testing/image_files.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::WriteFileBytes;

constexpr int kImages = 16;

class ShareGroupsTest : public SessionManagerTest {
 protected:
  void SetUp() override {
    SessionManagerTest::SetUp();
    images_ = dir_.path() + "/images";
    for (int i = 0; i < kImages; ++i) {
      const int h = 24 + i, w = 30 + 2 * i;
      WriteFileBytes(absl::StrCat(images_, "/c", i % 2, "/", 100 + i, ".jpg"),
                     EncodeJpeg(Picture(h, w, 3, i), h, w, TJPF_RGB, TJSAMP_420, 90));
    }
    ASSERT_EQ(::chmod(images_.c_str(), 0755), 0);
  }

  void Start(std::vector<std::string> across) {
    SessionManagerOptions options;
    options.share_groups_across_uids = std::move(across);
    options.feed_limits.counters = counters_;
    StartManager(options);
  }

  // Uid `uid`'s job in group "sweep": batches of 4, a ring of 2, its own augmentation seed.
  std::shared_ptr<Session> AttachAs(uint32_t uid) {
    AttachSpec spec = Spec();
    spec.job = absl::StrCat("job", uid);
    spec.feed.dataset.kind = DatasetKind::kImageFolder;
    spec.feed.dataset.path = images_;
    spec.feed.dataset.token_dtype = DType::kUnspecified;
    spec.feed.dataset.seq_len = 0;
    spec.feed.dataset.pipeline = {RandomResizedCropStep{12, {}}, FlipStep{0.5}};
    spec.feed.world_size = 1;
    spec.feed.seed = uid;
    spec.feed.share_group = "sweep";
    absl::StatusOr<Attachment> a = manager_->Attach(SpecOf(spec, uid));
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? MustFind(*a) : nullptr;
  }

  // Both sessions' rings filled (2 batches of 4 each, the same 8 samples of the group's
  // order): the decodes the node made for them.
  uint64_t DecodesOfTwoRings(Session& a, Session& b) {
    StreamProbe pa, pb;
    EXPECT_TRUE(a.BindStream(pa.Callback()).ok());
    EXPECT_TRUE(b.BindStream(pb.Callback()).ok());
    for (int n = 0; n < 2; ++n) {
      EXPECT_EQ(pa.Next(a).kind, StreamEvent::kBatch) << "batch " << n;
      EXPECT_EQ(pb.Next(b).kind, StreamEvent::kBatch) << "batch " << n;
    }
    return counters_->decodes(metrics::Decoder::kCpu) +
           counters_->decodes(metrics::Decoder::kCpuRegion);
  }

  std::string images_;
  std::shared_ptr<metrics::Counters> counters_ = std::make_shared<metrics::Counters>();
};

TEST_F(ShareGroupsTest, WithoutTheSettingTheSameNameUnderTwoUidsIsTwoGroups) {
  Start({});
  std::shared_ptr<Session> a = AttachAs(1001), b = AttachAs(1002);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(DecodesOfTwoRings(*a, *b), 16u);
  std::vector<ShareGroupInfo> groups = manager_->share_cache().Groups();
  ASSERT_EQ(groups.size(), 2u);
  std::sort(groups.begin(), groups.end(),
            [](const ShareGroupInfo& x, const ShareGroupInfo& y) { return x.key < y.key; });
  EXPECT_EQ(groups[0].key, "uid 1001/sweep");
  EXPECT_EQ(groups[1].key, "uid 1002/sweep");
  for (const ShareGroupInfo& g : groups) {
    EXPECT_EQ(g.members, 1) << g.key;
    EXPECT_EQ(g.counters.misses, 8u) << g.key;
    EXPECT_EQ(g.counters.read_checks_passed, 0u) << g.key;
  }
}

// One group of both uids: each sample decoded once, for whichever uid came first; the other
// uid's row took it after its own open of the file succeeded.
TEST_F(ShareGroupsTest, AGroupAcrossUidsDecodesEachSampleOnceForBoth) {
  Start({"other", "sweep"});
  std::shared_ptr<Session> a = AttachAs(1001), b = AttachAs(1002);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(DecodesOfTwoRings(*a, *b), 8u);
  const std::vector<ShareGroupInfo> groups = manager_->share_cache().Groups();
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].key, "uid */sweep");
  EXPECT_EQ(groups[0].members, 2);
  EXPECT_EQ(groups[0].counters.hits + groups[0].counters.misses, 16u);
  EXPECT_EQ(groups[0].counters.read_checks_passed, 8u);
  EXPECT_EQ(groups[0].counters.read_checks_refused, 0u);
  EXPECT_EQ(groups[0].pending, 0);
}

}  // namespace
}  // namespace gpufeed::server
