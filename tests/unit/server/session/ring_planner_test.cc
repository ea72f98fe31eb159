// The ring planner (server/session/ring_planner.h): the default depth, the depths tried, the
// tries; and the depths Attach gives its rings, through the manager.
#include "server/session/ring_planner.h"

#include <vector>

#include "tests/unit/server/session/session_manager_fixture.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

TEST_F(SessionManagerTest, RingThatDoesNotFitIsResourceExhausted) {
  // A pool of 8 pages; a slot of this feed takes one page.
  absl::StatusOr<std::unique_ptr<StagingPool>> small =
      StagingPool::Create(8 * PageSize(), 8 * PageSize());
  ASSERT_TRUE(small.ok());
  pool_ = std::move(*small);
  StartManager();
  const uint64_t free_before = pool_->free_bytes();
  AttachSpec spec = Spec();
  spec.ring_slots = 16;
  const absl::Status s = manager_->Attach(spec).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("ring of 16 slots"));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("asked for ", 16 * PageSize(), " bytes")));
  EXPECT_EQ(pool_->free_bytes(), free_before);
  EXPECT_EQ(manager_->num_sessions(), 0);
  // Fixed: the same (job, rank) attaches with a ring that fits.
  spec.ring_slots = 8;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->ring_slots, 8);
  EXPECT_EQ(pool_->free_bytes(), 0u);
}

TEST_F(SessionManagerTest, ConfiguredDefaultRingSlots) {
  SessionManagerOptions options;
  options.default_ring_slots = 3;
  StartManager(options);
  AttachSpec spec = Spec();
  spec.ring_slots = 0;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->ring_slots, 3);
  std::shared_ptr<Session> session = MustFind(*a);
  ASSERT_NE(session, nullptr);
  EXPECT_EQ(session->ring_bytes(), 3 * a->layout.stride_bytes);
  EXPECT_EQ(pool_->free_bytes(), pool_->total_bytes() - 3 * a->layout.stride_bytes);
}

TEST_F(SessionManagerTest, AutoRingSlotsFitTheAutoBudget) {
  SessionManagerOptions options;
  options.default_ring_slots = 0;  // auto
  options.auto_ring_bytes = 5 * PageSize();
  StartManager(options);
  AttachSpec spec = Spec();
  spec.ring_slots = 0;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->layout.stride_bytes, PageSize());  // 4 rows of 22 bytes fit one page
  EXPECT_EQ(a->ring_slots, 5);
  EXPECT_EQ(MustFind(*a)->ring_bytes(), 5 * PageSize());
  // An explicit ring_slots wins over the default.
  AttachSpec explicit_spec = Spec();
  explicit_spec.rank = 1;
  explicit_spec.ring_slots = 7;
  absl::StatusOr<Attachment> b = manager_->Attach(explicit_spec);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->ring_slots, 7);
}

TEST(DefaultRingSlotsTest, AutoDepthIsWhatFitsClampedTo2Through16) {
  RingDepthRule options;
  options.default_ring_slots = 0;
  options.auto_ring_bytes = uint64_t{64} << 20;
  EXPECT_EQ(DefaultRingSlots(options, 256 << 10), 16);  // 256 fit: at most 16
  EXPECT_EQ(DefaultRingSlots(options, 8 << 20), 8);     // exactly 8 fit
  EXPECT_EQ(DefaultRingSlots(options, 9 << 20), 7);     // 7.1 fit: rounded down
  EXPECT_EQ(DefaultRingSlots(options, 40 << 20), 2);    // 1 fits: at least 2
  EXPECT_EQ(DefaultRingSlots(options, uint64_t{1} << 40), 2);
  EXPECT_EQ(DefaultRingSlots(options, 0), 16);  // no division by zero
  options.default_ring_slots = 5;
  EXPECT_EQ(DefaultRingSlots(options, 8 << 20), 5);  // configured: used as is
}

TEST(DefaultRingSlotsTest, AStagedDeviceRingTakes4Or3SlotsWhereThatManyPerGpuFitHalfItsBudget) {
  RingDepthRule options;
  options.default_ring_slots = 0;
  options.auto_ring_bytes = uint64_t{64} << 20;
  const uint64_t stride = uint64_t{168} << 20;  // 256 images at 640 KiB of arena each
  auto slots = [&](int gpus, uint64_t budget) {
    StagedRingRoom room{gpus, budget};
    return DefaultRingSlots(options, stride, &room);
  };
  EXPECT_EQ(DefaultRingSlots(options, stride), 2);  // not staged: what fits 64 MiB, floored
  EXPECT_EQ(slots(1, uint64_t{4} << 30), 4);        // --staging_bytes 8 GiB: a uid's 4 GiB
  EXPECT_EQ(slots(2, uint64_t{4} << 30), 4);        // 2 x 4 x 168 MiB = 1,344 MiB <= 2 GiB
  EXPECT_EQ(slots(4, uint64_t{4} << 30), 3);        // 4 x 4 x 168 > 2 GiB >= 4 x 3 x 168
  EXPECT_EQ(slots(8, uint64_t{4} << 30), 2);        // 8 x 3 x 168 > 2 GiB: the 64 MiB rule
  EXPECT_EQ(slots(1, uint64_t{512} << 20), 2);      // the default 1 GiB pool's 512 MiB cap
  EXPECT_EQ(slots(1, 8 * stride), 4);               // exactly half: fits
  EXPECT_EQ(slots(1, 8 * stride - 1), 3);
  EXPECT_EQ(slots(0, 8 * stride), 4);  // no GPU counted: as one
  StagedRingRoom small{1, uint64_t{1} << 40};
  EXPECT_EQ(DefaultRingSlots(options, 8 << 20, &small), 8);  // more fit 64 MiB: kept
  options.default_ring_slots = 5;
  EXPECT_EQ(DefaultRingSlots(options, stride, &small), 5);  // configured: used as is
}

TEST(RingDepthsTest, AnAskedDepthIsTheOnlyOne) {
  const RingDepthRule rule;
  const uint64_t stride = uint64_t{168} << 20;
  StagedRingRoom roomy{1, uint64_t{1} << 40};
  EXPECT_EQ(RingDepths(rule, 7, stride, &roomy), (std::vector<int32_t>{7}));
  EXPECT_EQ(RingDepths(rule, 1, 4096, nullptr), (std::vector<int32_t>{1}));
}

TEST(RingDepthsTest, ADeepStagedDefaultFallsBackTo3ThenTheByteRulesDepth) {
  RingDepthRule rule;
  rule.auto_ring_bytes = uint64_t{64} << 20;
  const uint64_t stride = uint64_t{168} << 20;  // the byte rule gives 2
  StagedRingRoom roomy{1, uint64_t{1} << 40};
  EXPECT_EQ(RingDepths(rule, 0, stride, &roomy), (std::vector<int32_t>{4, 3, 2}));
  StagedRingRoom three{4, uint64_t{4} << 30};  // 4 x 4 x 168 MiB > 2 GiB >= 4 x 3 x 168 MiB
  EXPECT_EQ(RingDepths(rule, 0, stride, &three), (std::vector<int32_t>{3, 2}));
  StagedRingRoom tight{8, uint64_t{4} << 30};  // neither 4 nor 3 fits: the byte rule alone
  EXPECT_EQ(RingDepths(rule, 0, stride, &tight), (std::vector<int32_t>{2}));
  // Not staged: the byte rule's depth, nothing shallower to try.
  EXPECT_EQ(RingDepths(rule, 0, stride, nullptr), (std::vector<int32_t>{2}));
  EXPECT_EQ(RingDepths(rule, 0, 256 << 10, nullptr), (std::vector<int32_t>{16}));
  // A byte rule of 3 or more: 3 is no step down from it.
  rule.auto_ring_bytes = 3 * stride;
  EXPECT_EQ(RingDepths(rule, 0, stride, &roomy), (std::vector<int32_t>{4, 3}));
  // A configured default is used as is.
  rule.default_ring_slots = 5;
  EXPECT_EQ(RingDepths(rule, 0, stride, &roomy), (std::vector<int32_t>{5}));
}

TEST(AllocateFirstThatFitsTest, TriesShallowerOnlyWhileResourceExhausted) {
  std::vector<int32_t> tried;
  // Room for 3 slots: 4 is refused as RESOURCE_EXHAUSTED, 3 fits, 2 is never tried.
  auto fits_three = [&](int32_t slots) -> absl::StatusOr<int32_t> {
    tried.push_back(slots);
    if (slots > 3) return absl::ResourceExhaustedError(absl::StrCat("no room for ", slots));
    return slots;
  };
  const std::vector<int32_t> depths = {4, 3, 2};
  absl::StatusOr<int32_t> got = AllocateFirstThatFits(depths, fits_three);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, 3);
  EXPECT_EQ(tried, (std::vector<int32_t>{4, 3}));
  // Nothing fits: every depth tried, the last refusal answered.
  tried.clear();
  auto fits_none = [&](int32_t slots) -> absl::StatusOr<int32_t> {
    tried.push_back(slots);
    return absl::ResourceExhaustedError(absl::StrCat("no room for ", slots));
  };
  got = AllocateFirstThatFits(depths, fits_none);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(got.status().message(), "no room for 2");
  EXPECT_EQ(tried, depths);
  // Another refusal ends the tries at once.
  tried.clear();
  auto broken = [&](int32_t slots) -> absl::StatusOr<int32_t> {
    tried.push_back(slots);
    return absl::InternalError("device ring: broken");
  };
  got = AllocateFirstThatFits(depths, broken);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(tried, (std::vector<int32_t>{4}));
}

}  // namespace
}  // namespace gpufeed::server
