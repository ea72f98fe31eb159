// The kernel's word on who is at the other end of a connected Unix socket: SO_PEERCRED
// (uid, gid, pid at connect time) and SO_PEERGROUPS (the supplementary groups). Used by the
// gRPC socket's accept loop and by the memory socket; see docs/SECURITY.md section 1.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gpufeed {

struct PeerCred {
  uint32_t uid = 0;
  uint32_t gid = 0;
  int32_t pid = 0;
  std::vector<uint32_t> groups;  // supplementary groups, as the kernel reports them

  // Whether `gid` is the primary group or one of the supplementary groups.
  bool InGroup(uint32_t gid) const;
  // "uid 1000 (pid 4242)", for logs and messages.
  std::string ToString() const;
};

// The credentials of `socket`'s peer; INTERNAL naming the errno when the kernel refuses.
absl::StatusOr<PeerCred> GetPeerCred(int socket);

}  // namespace gpufeed
