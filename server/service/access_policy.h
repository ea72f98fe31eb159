// Who may do what, from the peer's credentials (docs/SECURITY.md section 1): who may
// consume (allow_uids / allow_gids), who is an admin (root and the daemon's effective uid as
// configured, admin_uids, members of admin_gids), and the identity of a gRPC call.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/peer_cred.h"
#include "server/auth/caller.h"

namespace gpufeed::server {

struct AccessPolicy {
  // Who may consume (Attach, Stream, GetPosition, Detach); both empty: any uid that can
  // connect. Admins always may.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::vector<uint32_t> admin_uids;
  std::vector<uint32_t> admin_gids;
  // The daemon's effective uid (geteuid()).
  uint32_t daemon_uid = 0;
  // uid 0 is an admin; the daemon's uid is an admin (config root_is_admin,
  // daemon_uid_is_admin). A daemon running as root with root_is_admin false does not make
  // uid 0 an admin through daemon_uid_is_admin: uid 0 is root_is_admin's alone.
  bool root_is_admin = true;
  bool daemon_uid_is_admin = true;
};

// The caller `cred` is under `policy`: admin = uid 0 (root_is_admin), the daemon's uid
// (daemon_uid_is_admin), admin_uids, or a member (primary or supplementary group) of one of
// admin_gids.
Caller MakeCaller(const PeerCred& cred, const AccessPolicy& policy);

// Who the admins are, for refusals: "root, uid 998, admin_uids/admin_gids" (what is not
// an admin under `policy` is left out).
std::string DescribeAdmins(const AccessPolicy& policy);

// OK when `caller` may consume; PERMISSION_DENIED naming its uid and the config that would
// allow it otherwise.
absl::Status CheckMayConsume(const Caller& caller, const AccessPolicy& policy);

// The Feed and Admin services' view of a call's identity: the peer's credentials, looked up
// by the name gRPC gives the connection (ctx->peer()), under the policy.
class CallerResolver {
 public:
  using Lookup = std::function<std::optional<PeerCred>(absl::string_view peer)>;
  CallerResolver(Lookup lookup, AccessPolicy policy)
      : lookup_(std::move(lookup)), policy_(std::move(policy)) {}

  // UNAUTHENTICATED when the connection has no recorded identity (it did not come through
  // the daemon's own listener): fail closed.
  absl::StatusOr<Caller> Identify(absl::string_view peer) const;
  // As Identify, then CheckMayConsume.
  absl::StatusOr<Caller> IdentifyConsumer(absl::string_view peer) const;

  const AccessPolicy& policy() const { return policy_; }

 private:
  const Lookup lookup_;
  const AccessPolicy policy_;
};

}  // namespace gpufeed::server
