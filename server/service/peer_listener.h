// The gRPC Unix socket's listener, ours rather than gRPC's: gRPC's auth context is empty for
// Unix sockets, so the daemon accepts each connection itself (thread `accept`), reads the
// peer's credentials (SO_PEERCRED, SO_PEERGROUPS), records them under the name gRPC gives
// the connection ("fd:N") and only then hands the fd to the server
// (grpc::AddInsecureChannelFromFd). The services look every call's identity up by
// ctx->peer(); a connection with no record is refused (docs/SECURITY.md section 1).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/os/fd.h"
#include "common/os/peer_cred.h"

namespace gpufeed::server {

class PeerListener {
 public:
  // Binds and listens on `path` with mode 0660: ALREADY_EXISTS when another process serves
  // it (or a non-socket file is there). Nothing is accepted before Start.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Bind(const std::string& path);
  ~PeerListener();  // Stop(), then removes the socket file

  // Starts the `accept` thread. Each connection is made O_NONBLOCK | O_CLOEXEC, its
  // credentials are recorded, then `hand_over` receives the fd and owns it. A connection
  // whose credentials cannot be read is closed. Once only.
  void Start(std::function<void(int fd)> hand_over);
  // No connection is accepted or handed over once this returns; joins the thread.
  // Idempotent.
  void Stop();

  // The credentials recorded for the connection gRPC names `peer` ("fd:N"); nullopt for any
  // other name or an fd never accepted here.
  std::optional<PeerCred> Lookup(absl::string_view peer) const;
  // The name gRPC gives a connection handed over from fd `fd`.
  static std::string PeerName(int fd);

  const std::string& path() const { return path_; }

 private:
  PeerListener(std::string path, UniqueFd listen, UniqueFd wake);
  void Loop();

  const std::string path_;
  const UniqueFd listen_;
  const UniqueFd wake_;  // eventfd: written to stop the loop
  std::function<void(int fd)> hand_over_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  // fd -> its peer. An fd number is reused only after gRPC closed the connection that had
  // it, so the entry is replaced on the next accept that returns it.
  absl::flat_hash_map<int, PeerCred> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed::server
