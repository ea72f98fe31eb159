// Who may consume and who is an admin, from the peer's credentials (docs/SECURITY.md §1).
#include "server/service/access_policy.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

AccessPolicy PolicyOf(uint32_t daemon_uid) {
  AccessPolicy p;
  p.daemon_uid = daemon_uid;
  return p;
}

PeerCred Cred(uint32_t uid, uint32_t gid, std::vector<uint32_t> groups = {}) {
  PeerCred c;
  c.uid = uid;
  c.gid = gid;
  c.pid = 42;
  c.groups = std::move(groups);
  return c;
}

TEST(AccessPolicyTest, AdminsAreRootTheDaemonsUidAdminUidsAndAdminGroupMembers) {
  AccessPolicy policy;
  policy.daemon_uid = 998;
  policy.admin_uids = {1500};
  policy.admin_gids = {2000};
  EXPECT_TRUE(MakeCaller(Cred(0, 0), policy).admin);
  EXPECT_TRUE(MakeCaller(Cred(998, 998), policy).admin);
  EXPECT_TRUE(MakeCaller(Cred(1500, 1500), policy).admin);
  EXPECT_TRUE(MakeCaller(Cred(1600, 2000), policy).admin);          // primary group
  EXPECT_TRUE(MakeCaller(Cred(1600, 1600, {10, 2000}), policy).admin);  // supplementary
  EXPECT_FALSE(MakeCaller(Cred(1600, 1600, {10, 2001}), policy).admin);
  EXPECT_FALSE(MakeCaller(Cred(999, 998), PolicyOf(998)).admin);
  const Caller c = MakeCaller(Cred(1600, 1601, {7}), policy);
  EXPECT_EQ(c.uid(), 1600u);
  EXPECT_EQ(c.cred.gid, 1601u);
  EXPECT_EQ(c.cred.pid, 42);
}

// The shipped Kubernetes config: a root pod reaches the hostPath socket as uid 0, and a pod
// may run as any uid, so neither root nor the daemon's uid is an admin by itself; the
// admins are the uids and groups the config names.
TEST(AccessPolicyTest, RootAndTheDaemonsUidAreAdminsOnlyAsConfigured) {
  AccessPolicy policy;
  policy.daemon_uid = 10000;
  policy.root_is_admin = false;
  policy.daemon_uid_is_admin = false;
  EXPECT_FALSE(MakeCaller(Cred(0, 0), policy).admin);
  EXPECT_FALSE(MakeCaller(Cred(10000, 10000), policy).admin);
  EXPECT_EQ(DescribeAdmins(policy), "admin_uids/admin_gids");
  policy.admin_uids = {10000};
  EXPECT_TRUE(MakeCaller(Cred(10000, 10001), policy).admin);
  EXPECT_FALSE(MakeCaller(Cred(0, 0), policy).admin);
  // Explicitly named, uid 0 is an admin again.
  policy.admin_uids = {0};
  EXPECT_TRUE(MakeCaller(Cred(0, 0), policy).admin);

  // Each switch alone.
  AccessPolicy root_only;
  root_only.daemon_uid = 998;
  root_only.daemon_uid_is_admin = false;
  EXPECT_TRUE(MakeCaller(Cred(0, 0), root_only).admin);
  EXPECT_FALSE(MakeCaller(Cred(998, 998), root_only).admin);
  EXPECT_EQ(DescribeAdmins(root_only), "root, admin_uids/admin_gids");
  AccessPolicy daemon_only;
  daemon_only.daemon_uid = 998;
  daemon_only.root_is_admin = false;
  EXPECT_FALSE(MakeCaller(Cred(0, 0), daemon_only).admin);
  EXPECT_TRUE(MakeCaller(Cred(998, 998), daemon_only).admin);
  EXPECT_EQ(DescribeAdmins(daemon_only), "uid 998, admin_uids/admin_gids");
  // A daemon running as root: uid 0 follows root_is_admin alone.
  AccessPolicy root_daemon;
  root_daemon.daemon_uid = 0;
  root_daemon.root_is_admin = false;
  EXPECT_FALSE(MakeCaller(Cred(0, 0), root_daemon).admin);
  EXPECT_EQ(DescribeAdmins(PolicyOf(998)), "root, uid 998, admin_uids/admin_gids");
}

TEST(AccessPolicyTest, EmptyAllowListsLetAnyoneConsume) {
  AccessPolicy policy;
  policy.daemon_uid = 998;
  EXPECT_TRUE(CheckMayConsume(MakeCaller(Cred(12345, 12345), policy), policy).ok());
}

TEST(AccessPolicyTest, AllowListsAdmitTheirUidsGroupMembersAndAdmins) {
  AccessPolicy policy;
  policy.daemon_uid = 998;
  policy.allow_uids = {1000};
  policy.allow_gids = {3000};
  policy.admin_gids = {4000};
  auto may = [&](const PeerCred& cred) { return CheckMayConsume(MakeCaller(cred, policy), policy); };
  EXPECT_TRUE(may(Cred(1000, 1000)).ok());
  EXPECT_TRUE(may(Cred(1001, 3000)).ok());
  EXPECT_TRUE(may(Cred(1001, 1001, {3000})).ok());
  EXPECT_TRUE(may(Cred(0, 0)).ok());              // root
  EXPECT_TRUE(may(Cred(998, 998)).ok());          // the daemon's uid
  EXPECT_TRUE(may(Cred(1003, 1003, {4000})).ok());  // an admin group's member
  const absl::Status refused = may(Cred(1002, 1002, {3001}));
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.message(),
            "uid 1002 may not use gpufeedd: its config allows only allow_uids and members of "
            "allow_gids; an admin can add uid 1002 to allow_uids (or a group of it to "
            "allow_gids)");
}

TEST(CallerResolverTest, AnUnknownConnectionIsUnauthenticated) {
  AccessPolicy policy;
  policy.allow_uids = {7};
  CallerResolver resolver(
      [](absl::string_view peer) -> std::optional<PeerCred> {
        if (peer == "fd:5") return Cred(7, 7);
        if (peer == "fd:6") return Cred(8, 8);
        return std::nullopt;
      },
      policy);
  absl::StatusOr<Caller> known = resolver.IdentifyConsumer("fd:5");
  ASSERT_TRUE(known.ok()) << known.status();
  EXPECT_EQ(known->uid(), 7u);
  EXPECT_FALSE(known->admin);
  // Identified but not allowed: still identified for GetStatus / listings, not to consume.
  EXPECT_TRUE(resolver.Identify("fd:6").ok());
  EXPECT_EQ(resolver.IdentifyConsumer("fd:6").status().code(),
            absl::StatusCode::kPermissionDenied);
  for (const char* peer : {"unix:/run/gpufeed/gpufeed.sock", "fd:9", ""}) {
    const absl::Status s = resolver.Identify(peer).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << peer;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("does not know who is at the other end"));
    EXPECT_EQ(resolver.IdentifyConsumer(peer).status().code(),
              absl::StatusCode::kUnauthenticated);
  }
}

}  // namespace
}  // namespace gpufeed::server
