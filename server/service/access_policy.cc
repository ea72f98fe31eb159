#include "server/service/access_policy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

bool Contains(const std::vector<uint32_t>& list, uint32_t value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

bool InAnyGroup(const PeerCred& cred, const std::vector<uint32_t>& gids) {
  return std::any_of(gids.begin(), gids.end(), [&](uint32_t g) { return cred.InGroup(g); });
}

}  // namespace

Caller MakeCaller(const PeerCred& cred, const AccessPolicy& policy) {
  Caller caller;
  caller.cred = cred;
  const bool implicit = cred.uid == 0 ? policy.root_is_admin
                                      : policy.daemon_uid_is_admin && cred.uid == policy.daemon_uid;
  caller.admin =
      implicit || Contains(policy.admin_uids, cred.uid) || InAnyGroup(cred, policy.admin_gids);
  return caller;
}

std::string DescribeAdmins(const AccessPolicy& policy) {
  std::string out;
  if (policy.root_is_admin) out = "root, ";
  if (policy.daemon_uid_is_admin && policy.daemon_uid != 0) {
    absl::StrAppend(&out, "uid ", policy.daemon_uid, ", ");
  }
  return absl::StrCat(out, "admin_uids/admin_gids");
}

absl::Status CheckMayConsume(const Caller& caller, const AccessPolicy& policy) {
  if (caller.admin) return absl::OkStatus();
  if (policy.allow_uids.empty() && policy.allow_gids.empty()) return absl::OkStatus();
  if (Contains(policy.allow_uids, caller.uid()) || InAnyGroup(caller.cred, policy.allow_gids)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("uid ", caller.uid(),
                   " may not use gpufeedd: its config allows only allow_uids and "
                   "members of allow_gids; an admin can add uid ",
                   caller.uid(),
                   " to allow_uids (or a group "
                   "of it to allow_gids)"));
}

absl::StatusOr<Caller> CallerResolver::Identify(absl::string_view peer) const {
  std::optional<PeerCred> cred = lookup_ ? lookup_(peer) : std::nullopt;
  if (!cred.has_value()) {
    return absl::UnauthenticatedError(
        "gpufeedd does not know who is at the other end of this connection; connect to its "
        "Unix socket directly (the credentials are the kernel's, read when it accepts)");
  }
  return MakeCaller(*cred, policy_);
}

absl::StatusOr<Caller> CallerResolver::IdentifyConsumer(absl::string_view peer) const {
  absl::StatusOr<Caller> caller = Identify(peer);
  if (!caller.ok()) return caller;
  if (absl::Status s = CheckMayConsume(*caller, policy_); !s.ok()) return s;
  return caller;
}

}  // namespace gpufeed::server
