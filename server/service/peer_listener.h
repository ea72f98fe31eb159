// The gRPC Unix socket's listener, ours rather than gRPC's: gRPC's auth context is empty for
// Unix sockets, so the daemon accepts each connection itself (thread `accept`), reads the
// peer's credentials (SO_PEERCRED, SO_PEERGROUPS), records them under the name gRPC gives
// the connection ("fd:N") and only then hands the fd to the server
// (grpc::AddInsecureChannelFromFd). The services look every call's identity up by
// ctx->peer(); a connection with no record is refused (docs/SECURITY.md section 1).
//
// It also caps the connections (docs/SECURITY.md section 4): at most max_connections_per_uid
// of one uid (admins exempt) and max_connections in all. A connection past a cap is closed at
// once, never handed over, after an HTTP/2 GOAWAY (ENHANCE_YOUR_CALM) whose debug text names
// the cap; the refusals are logged (at most one line a second).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/os/fd.h"
#include "common/os/peer_cred.h"
#include "server/service/conn_limits.h"

namespace gpufeed::server {

struct PeerListenerOptions {
  int max_connections_per_uid = 64;
  int max_connections = 1024;
  // Not capped per uid (admins: root, the daemon's uid, admin_uids/admin_gids); null: nobody.
  std::function<bool(const PeerCred&)> exempt;
};

class PeerListener {
 public:
  // Binds and listens on `path` with mode 0660: ALREADY_EXISTS when another process serves
  // it (or a non-socket file is there). Nothing is accepted before Start.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Bind(const std::string& path);
  ~PeerListener();  // Stop(), then removes the socket file

  // Starts the `accept` thread. Each connection is made O_NONBLOCK | O_CLOEXEC, its
  // credentials are recorded, then `hand_over` receives the fd and owns it. A connection
  // whose credentials cannot be read, or past a cap of `options`, is closed. Out of
  // descriptors (EMFILE, ENFILE), the thread waits 100 ms before it accepts again. Once only.
  void Start(std::function<void(int fd)> hand_over, PeerListenerOptions options = {});
  // No connection is accepted or handed over once this returns; joins the thread.
  // Idempotent.
  void Stop();

  // The credentials recorded for the connection gRPC names `peer` ("fd:N"); nullopt for any
  // other name or an fd never accepted here.
  std::optional<PeerCred> Lookup(absl::string_view peer) const;
  // The name gRPC gives a connection handed over from fd `fd`.
  static std::string PeerName(int fd);

  const std::string& path() const { return path_; }
  // Connections counted now (some may have been closed by gRPC since the last sweep).
  int connections() const { return table_ == nullptr ? 0 : table_->size(); }

 private:
  PeerListener(std::string path, UniqueFd listen, UniqueFd wake);
  void Loop();
  // Refuses `connection` (closed by the caller) with a GOAWAY naming `why`; logs it.
  void Refuse(int connection, const PeerCred& cred, const absl::Status& why);

  const std::string path_;
  const UniqueFd listen_;
  const UniqueFd wake_;  // eventfd: written to stop the loop
  std::function<void(int fd)> hand_over_;
  std::function<bool(const PeerCred&)> exempt_;
  std::thread thread_;
  // Created by Start: fd -> its peer, and the caps. An fd number is reused only after gRPC
  // closed the connection that had it, so the entry is replaced on the next accept that
  // returns it (ConnectionTable says how closes are found before that).
  std::unique_ptr<ConnectionTable> table_;
  // The accept thread's: when it last logged a refusal, and those not logged since.
  absl::Time last_refusal_log_ = absl::InfinitePast();
  int refusals_not_logged_ = 0;
  absl::Time last_emfile_log_ = absl::InfinitePast();
};

}  // namespace gpufeed::server
