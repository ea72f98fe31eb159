#include "server/service/peer_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Bind(const std::string& path) {
  // Owner and group may connect (systemd's Group=gpufeed, the DaemonSet's group), whatever
  // the umask.
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd listen, ListenUnix(path, 0660));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<PeerListener>(
      new PeerListener(path, std::move(listen), std::move(wake)));
}

PeerListener::PeerListener(std::string path, UniqueFd listen, UniqueFd wake)
    : path_(std::move(path)), listen_(std::move(listen)), wake_(std::move(wake)) {}

PeerListener::~PeerListener() {
  Stop();
  ::unlink(path_.c_str());
}

void PeerListener::Start(std::function<void(int fd)> hand_over) {
  if (thread_.joinable()) return;
  hand_over_ = std::move(hand_over);
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "accept");
    Loop();
  });
}

void PeerListener::Stop() {
  if (!thread_.joinable()) return;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  thread_.join();
}

std::string PeerListener::PeerName(int fd) { return absl::StrCat("fd:", fd); }

std::optional<PeerCred> PeerListener::Lookup(absl::string_view peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&peer, "fd:") || !absl::SimpleAtoi(peer, &fd) || fd < 0) {
    return std::nullopt;
  }
  absl::MutexLock lock(&mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

void PeerListener::Loop() {
  while (true) {
    pollfd fds[2] = {{listen_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("gRPC socket {}: poll: {}; no new connections are accepted", path_,
                    std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    // gRPC's endpoint wants a non-blocking descriptor; nothing may inherit it across exec.
    UniqueFd connection(
        ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!connection.valid()) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the pending connection stays queued; do not spin on it.
        spdlog::warn("gRPC socket {}: accept: {}", path_, std::strerror(errno));
        pollfd wake = {wake_.get(), POLLIN, 0};
        if (::poll(&wake, 1, 100) > 0) return;
      }
      continue;
    }
    absl::StatusOr<PeerCred> cred = GetPeerCred(connection.get());
    if (!cred.ok()) {
      spdlog::warn("gRPC socket {}: a connection refused: {}", path_, cred.status().ToString());
      continue;  // closed: no identity, no service
    }
    {
      absl::MutexLock lock(&mu_);
      peers_[connection.get()] = *std::move(cred);
    }
    hand_over_(connection.Release());
  }
}

}  // namespace gpufeed::server
