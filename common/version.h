// gpufeed's version and its wire protocol's number, shared by the daemon and the clients.
#pragma once

#include <cstdint>

namespace gpufeed {

inline constexpr char kVersion[] = "0.1.0";

// Bumped when one side needs something of the other that an older one lacks; each side sends
// its own (GetStatusResponse.protocol, AttachRequest.protocol), 0 meaning "from before the
// number was sent". 1: round 1. 2: datasets opened by the client (dataset handles; the memory
// socket named in GetStatus). 3: lifelines, resume gaps and these numbers (re-attach).
inline constexpr uint32_t kProtocol = 3;
// The oldest daemon a client of this version works with: one that takes the datasets its
// clients open (a daemon of protocol 2 ignores a lifeline: no fast reclaim, nothing else lost).
inline constexpr uint32_t kMinDaemonProtocol = 2;

}  // namespace gpufeed
