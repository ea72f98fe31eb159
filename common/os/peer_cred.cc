#include "common/os/peer_cred.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed {

bool PeerCred::InGroup(uint32_t g) const {
  return g == gid || std::find(groups.begin(), groups.end(), g) != groups.end();
}

std::string PeerCred::ToString() const { return absl::StrCat("uid ", uid, " (pid ", pid, ")"); }

absl::StatusOr<PeerCred> GetPeerCred(int socket) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoToStatus(errno, "getsockopt(SO_PEERCRED)");
  }
  PeerCred out;
  out.uid = cred.uid;
  out.gid = cred.gid;
  out.pid = cred.pid;
  // SO_PEERGROUPS (Linux 4.13): ERANGE tells the size needed.
  std::vector<gid_t> groups(16);
  while (true) {
    socklen_t bytes = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(socket, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &bytes) == 0) {
      groups.resize(bytes / sizeof(gid_t));
      break;
    }
    if (errno == ERANGE && bytes > groups.size() * sizeof(gid_t) && bytes < (1u << 20)) {
      groups.resize(bytes / sizeof(gid_t));
      continue;
    }
    if (errno == ENOPROTOOPT) {  // an old kernel: the primary group only
      groups.clear();
      break;
    }
    return ErrnoToStatus(errno, "getsockopt(SO_PEERGROUPS)");
  }
  out.groups.assign(groups.begin(), groups.end());
  return out;
}

}  // namespace gpufeed
