// Internal to the client: the gRPC plumbing that sessions and the admin client share (the
// socket check, the channel, a unary call with a deadline, grpc::Status -> absl::Status).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace gpufeed::client::internal {

// The daemon's status with `context` prepended to its message, keeping its code.
absl::Status FromGrpc(const grpc::Status& status, absl::string_view context);

// UNAVAILABLE "no gpufeedd listening at SOCKET: no socket there (...)" (kNoDaemonListening)
// when no Unix socket is there (no daemon to talk to).
absl::Status CheckSocket(const std::string& socket);

// CheckSocket, then one connection attempt, so that the usual ways of not reaching a daemon
// get a one-line message in our words rather than gRPC's: UNAVAILABLE "no gpufeedd listening
// at SOCKET: a stale socket file ..." (the daemon stopped or crashed), PERMISSION_DENIED naming the
// socket's mode, owner and group when this process may not connect. For a first Attach and the
// admin client; a re-attach retries through CheckSocket alone.
absl::Status ProbeSocket(const std::string& socket);

// Whether the server at the other end of a connected memory socket is one this client hands
// its dataset descriptors and session tokens to (docs/SECURITY.md section 2): its uid
// (SO_PEERCRED) is root, this process's own, or the owner of the socket's directory (the
// daemon owns its socket directory: systemd's RuntimeDirectory, the DaemonSet's init
// container). GPUFEED_DAEMON_UID (`env`, uids separated by commas) replaces the directory's
// owner. PERMISSION_DENIED naming the uid seen and how to trust it; INVALID_ARGUMENT for a
// malformed GPUFEED_DAEMON_UID. `dir_owner`: nullopt when the directory cannot be stat'ed.
absl::Status TrustDaemonUid(uint32_t peer_uid, uint32_t self_uid, std::optional<uint32_t> dir_owner,
                            const char* env, const std::string& socket);

// TrustDaemonUid for the peer of `fd`, connected to `socket`, and this process.
absl::Status CheckDaemonPeer(int fd, const std::string& socket);

// A channel to gpufeedd's gRPC socket at `socket`. `fresh`: with its own connection (a
// re-attach's: gRPC's shared one may sit in its reconnect backoff, seconds after the daemon
// is back).
// `keepalive` > 0: the channel pings the daemon that often when the connection is quiet and
// gives the connection up (UNAVAILABLE) when a ping is not answered within as long again, so
// a daemon that stopped answering (SIGSTOP, a frozen process) ends a stream instead of hanging it.
std::shared_ptr<grpc::Channel> ChannelFor(const std::string& socket, bool fresh = false,
                                          absl::Duration keepalive = absl::ZeroDuration());

// One line to stderr when GPUFEED_DEBUG is set (to anything but "" or "0"): the raw gRPC
// text our messages leave out.
void DebugLog(absl::string_view line);

// Why a call to the daemon at `socket` failed, in our words: gRPC's transport errors
// (connection refused, reset, keepalive timeout, deadline) become one phrase; a status the
// daemon itself sent keeps its message. The raw text goes to DebugLog.
std::string InOurWords(const absl::Status& status, const std::string& socket);

// One unary call with a deadline; a failure carries `what` as context.
template <typename Stub, typename Request, typename Response>
absl::Status Call(Stub* stub,
                  grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response, absl::Duration timeout,
                  absl::string_view what) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
  return FromGrpc((stub->*method)(&ctx, request, response), what);
}

}  // namespace gpufeed::client::internal
