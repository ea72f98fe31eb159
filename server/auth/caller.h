// Who makes a request, as the core sees it: the peer's credentials (from the socket, never
// from the request) and what the daemon's policy lets that peer do (docs/SECURITY.md).
#pragma once

#include "common/os/peer_cred.h"

namespace gpufeed::server {

struct Caller {
  PeerCred cred;
  // Root, the daemon's own uid, admin_uids or a member of admin_gids: may drain, see every
  // session and feed, detach any session, and attach by path.
  bool admin = false;

  uint32_t uid() const { return cred.uid; }
};

}  // namespace gpufeed::server
