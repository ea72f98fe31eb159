// Admission (server/session/admission.h): the daemon's state, its session limit and the
// per-uid quotas, directly and through the manager (docs/SECURITY.md section 4).
#include "server/session/admission.h"

#include <optional>

#include "tests/unit/server/session/session_manager_fixture.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

TEST_F(SessionManagerTest, SessionsPerUidAreCapped) {
  SessionManagerOptions options;
  options.max_sessions_per_uid = 2;
  StartManager(options);
  std::vector<Attachment> held;
  for (int32_t rank = 0; rank < 2; ++rank) {
    AttachSpec spec = SpecOf(Spec(), 1000);
    spec.rank = rank;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    ASSERT_TRUE(a.ok()) << a.status();
    held.push_back(*a);
  }
  const uint64_t free_before = pool_->free_bytes();
  AttachSpec third = SpecOf(Spec(), 1000);
  third.job = "eval";
  const absl::Status s = manager_->Attach(third).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "max_sessions_per_uid: uid 1000 has 2 sessions attached, the most one uid may hold; "
            "detach one (or an admin raises max_sessions_per_uid)");
  EXPECT_EQ(pool_->free_bytes(), free_before);
  // The refused Attach spent its dataset handle: the descriptor is not held until it expires.
  const absl::Status spent = manager_->Attach(third).status();
  EXPECT_EQ(spent.code(), absl::StatusCode::kResourceExhausted);  // the quota, checked first
  ASSERT_TRUE(manager_->Detach(held[1].session_id, held[1].token, AsUid(1000)).ok());
  EXPECT_THAT(manager_->Attach(third).status().message(), HasSubstr("dataset.handle: no such"));
  // Another uid is not affected; a detach frees the uid's slot.
  EXPECT_TRUE(manager_->Attach(SpecOf(third, 1001)).ok());
  ASSERT_TRUE(manager_->Detach(held[0].session_id, held[0].token, AsUid(1000)).ok());
  EXPECT_TRUE(manager_->Attach(SpecOf(third, 1000)).ok());
}

TEST_F(SessionManagerTest, AdminsAreNotCappedByTheQuotas) {
  SessionManagerOptions options;
  options.max_sessions_per_uid = 1;
  options.max_staging_bytes_per_uid = 1;  // less than any ring
  StartManager(options);
  EXPECT_EQ(manager_->Attach(SpecOf(Spec(), 1000)).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Root, the daemon's uid, admin_uids: trusted (docs/SECURITY.md section 6).
  for (int32_t rank = 0; rank < 2; ++rank) {
    AttachSpec spec = SpecOf(Spec(), 0, /*admin=*/true);
    spec.rank = rank;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    EXPECT_TRUE(a.ok()) << a.status();
  }
  EXPECT_EQ(manager_->num_sessions(), 2);
}

TEST_F(SessionManagerTest, StagingBytesPerUidAreCapped) {
  StartManager();
  absl::StatusOr<Attachment> probe = manager_->Attach(Spec());
  ASSERT_TRUE(probe.ok()) << probe.status();
  // A session's share of the quota: its ring and its sample ids (4 rows x 2 slots x 8 bytes).
  const uint64_t ring = MustFind(*probe)->ring_bytes() + 4 * 2 * 8;
  EXPECT_EQ(MustFind(*probe)->quota_bytes(), ring);
  manager_.reset();

  SessionManagerOptions options;
  options.max_staging_bytes_per_uid = 2 * ring - 1;  // room for one ring, not two
  StartManager(options);
  absl::StatusOr<Attachment> first = manager_->Attach(SpecOf(Spec(), 1000));
  ASSERT_TRUE(first.ok()) << first.status();
  AttachSpec second = SpecOf(Spec(), 1000);
  second.rank = 1;
  const absl::Status s = manager_->Attach(second).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), absl::StrCat("max_staging_bytes_per_uid: uid 1000's rings hold ", ring,
                                      " bytes of staging (with their sample ids); a ring of ", ring,
                                      " more would pass its quota of ", 2 * ring - 1,
                                      " bytes (use fewer or smaller rings, or an admin raises "
                                      "max_staging_bytes_per_uid)"));
  // The refused ring went back to the pool at once (the pool counts rings, not ids).
  EXPECT_EQ(pool_->free_bytes(), pool_->total_bytes() - MustFind(*first)->ring_bytes());
  EXPECT_EQ(manager_->num_sessions(), 1);
  EXPECT_TRUE(manager_->Attach(SpecOf(second, 1001)).ok());  // another uid's own quota
  ASSERT_TRUE(manager_->Detach(first->session_id, first->token, AsUid(1000)).ok());
  EXPECT_TRUE(manager_->Attach(SpecOf(second, 1000)).ok());  // a handle is single use
}

constexpr Admission::Step kBeforeOpen = Admission::Step::kBeforeOpen;
constexpr Admission::Step kInsert = Admission::Step::kInsert;

TEST(AdmissionTest, SessionsPerUidAreCappedAndADetachFreesOne) {
  Admission admission(AdmissionLimits{256, 2, 0});
  admission.Add(1000, 100);
  admission.Add(1000, 100);
  const absl::Status s = admission.Admit(AsUid(1000), 0, kBeforeOpen);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "max_sessions_per_uid: uid 1000 has 2 sessions attached, the most one uid may hold; "
            "detach one (or an admin raises max_sessions_per_uid)");
  EXPECT_EQ(admission.Quota(AsUid(1000), 0), s);
  EXPECT_TRUE(admission.Admit(AsUid(1001), 0, kBeforeOpen).ok());  // another uid's own
  admission.Remove(1000, 100);
  EXPECT_TRUE(admission.Admit(AsUid(1000), 0, kInsert).ok());
  EXPECT_EQ(admission.sessions(), 1);
}

TEST(AdmissionTest, StagingBytesPerUidAreCappedWithoutWrapping) {
  Admission admission(AdmissionLimits{256, 64, 1000});
  EXPECT_TRUE(admission.Quota(AsUid(1000), 1000).ok());  // exactly the quota
  const absl::Status alone = admission.Quota(AsUid(1000), 1001);
  EXPECT_EQ(alone.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(alone.message(),
            "max_staging_bytes_per_uid: uid 1000's rings hold 0 bytes of staging (with their "
            "sample ids); a ring of 1001 more would pass its quota of 1000 bytes (use fewer or "
            "smaller rings, or an admin raises max_staging_bytes_per_uid)");
  admission.Add(1000, 600);
  EXPECT_TRUE(admission.Quota(AsUid(1000), 400).ok());
  EXPECT_EQ(admission.Quota(AsUid(1000), 401).message(),
            "max_staging_bytes_per_uid: uid 1000's rings hold 600 bytes of staging (with their "
            "sample ids); a ring of 401 more would pass its quota of 1000 bytes (use fewer or "
            "smaller rings, or an admin raises max_staging_bytes_per_uid)");
  // A ring larger than any quota is refused, not wrapped around.
  EXPECT_EQ(admission.Quota(AsUid(1000), ~uint64_t{0}).code(),
            absl::StatusCode::kResourceExhausted);
  // Zero bytes (the check before the dataset is opened) passes the byte quota.
  EXPECT_TRUE(admission.Quota(AsUid(1000), 0).ok());
  // A removal gives back only what the session held, never below zero.
  admission.Remove(1000, 600);
  EXPECT_TRUE(admission.Quota(AsUid(1000), 1000).ok());
  admission.Add(1000, 10);
  admission.Remove(1000, 50);
  EXPECT_TRUE(admission.Quota(AsUid(1000), 1000).ok());
}

TEST(AdmissionTest, AdminsAreCountedButNotCapped) {
  Admission admission(AdmissionLimits{3, 1, 1});
  const Caller root = AsUid(0, /*admin=*/true);
  admission.Add(0, 1 << 20);
  EXPECT_TRUE(admission.Quota(root, uint64_t{1} << 40).ok());
  EXPECT_TRUE(admission.Admit(root, 1 << 20, kInsert).ok());
  admission.Add(0, 1 << 20);
  admission.Add(1000, 0);
  EXPECT_EQ(admission.sessions(), 3);
  // The daemon's session limit holds for admins too.
  const absl::Status full = admission.Admit(root, 0, kInsert);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(), "gpufeedd serves at most 3 sessions");
}

TEST(AdmissionTest, DrainAndShutdownRefuseNewSessions) {
  Admission admission(AdmissionLimits{});
  EXPECT_FALSE(admission.draining());
  EXPECT_TRUE(admission.BeginDrain());
  EXPECT_FALSE(admission.BeginDrain());  // already draining
  EXPECT_TRUE(admission.draining());
  absl::Status s = admission.Admit(AsUid(1000), 0, kBeforeOpen);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(),
            "gpufeedd is draining (gpufeedctl drain): attach to another daemon or retry after "
            "its restart");
  s = admission.Admit(AsUid(0, /*admin=*/true), 0, kInsert);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "gpufeedd is draining (gpufeedctl drain)");
  admission.Add(1000, 5);
  EXPECT_TRUE(admission.Shutdown());
  EXPECT_FALSE(admission.Shutdown());  // idempotent
  EXPECT_EQ(admission.sessions(), 0);
  for (const Admission::Step step : {kBeforeOpen, kInsert}) {
    s = admission.Admit(AsUid(1000), 0, step);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(s.message(), "gpufeedd is shutting down");
  }
  admission.Remove(1000, 5);  // a session forgotten by the shutdown: nothing to give back
  EXPECT_EQ(admission.sessions(), 0);
}

TEST(AdmissionTest, TheStagingRoomAndTheIdsOwnerFollowTheQuotaPolicy) {
  const Caller user = AsUid(1000);
  const Caller admin = AsUid(0, /*admin=*/true);
  Admission capped(AdmissionLimits{256, 64, 512});
  EXPECT_EQ(capped.StagingRoom(user, 1024), 512u);
  EXPECT_EQ(capped.StagingRoom(user, 256), 256u);  // the pool is smaller
  EXPECT_EQ(capped.StagingRoom(admin, 1024), 1024u);
  Admission uncapped(AdmissionLimits{256, 64, 0});
  EXPECT_EQ(uncapped.StagingRoom(user, 1024), 1024u);
  EXPECT_EQ(Admission::IdsOwner(user), std::optional<uint32_t>(1000));
  EXPECT_EQ(Admission::IdsOwner(admin), std::nullopt);
}

}  // namespace
}  // namespace gpufeed::server
