#include "server/service/peer_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
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

void PeerListener::Start(std::function<void(int fd)> hand_over, PeerListenerOptions options) {
  if (thread_.joinable()) return;
  hand_over_ = std::move(hand_over);
  exempt_ = std::move(options.exempt);
  table_ =
      std::make_unique<ConnectionTable>(options.max_connections_per_uid, options.max_connections);
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
  if (table_ == nullptr) return std::nullopt;
  return table_->Lookup(fd);
}

namespace {

// An HTTP/2 frame header: 24-bit length, type, flags, stream id 0.
void AppendFrameHeader(std::string* out, uint32_t length, uint8_t type) {
  const char header[9] = {static_cast<char>(length >> 16),
                          static_cast<char>(length >> 8),
                          static_cast<char>(length),
                          static_cast<char>(type),
                          0,
                          0,
                          0,
                          0,
                          0};
  out->append(header, sizeof(header));
}

// The server's preface (an empty SETTINGS frame) and a GOAWAY with ENHANCE_YOUR_CALM and
// `message` as its debug text: what gRPC's own server sends a connection it will not serve.
std::string GoAway(absl::string_view message) {
  std::string out;
  AppendFrameHeader(&out, 0, /*SETTINGS=*/0x4);
  AppendFrameHeader(&out, static_cast<uint32_t>(8 + message.size()), /*GOAWAY=*/0x7);
  const char payload[8] = {0, 0, 0, 0, 0, 0, 0, /*ENHANCE_YOUR_CALM=*/0xb};
  out.append(payload, sizeof(payload));
  out.append(message.data(), message.size());
  return out;
}

}  // namespace

void PeerListener::Refuse(int connection, const PeerCred& cred, const absl::Status& why) {
  const std::string goaway = GoAway(why.message().substr(0, 512));
  [[maybe_unused]] ssize_t sent =
      ::send(connection, goaway.data(), goaway.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  // Whatever the client sent already is read and dropped: closing a Unix socket with unread
  // bytes makes the peer's next read fail (ECONNRESET) before it reads the GOAWAY.
  char sink[4096];
  for (int i = 0; i < 16 && ::recv(connection, sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
  }
  const absl::Time now = absl::Now();
  if (now - last_refusal_log_ < absl::Seconds(1)) {
    ++refusals_not_logged_;
    return;
  }
  spdlog::warn("gRPC socket {}: a connection of {} refused: {}{}", path_, cred.ToString(),
               std::string(why.message()),
               refusals_not_logged_ == 0
                   ? std::string()
                   : absl::StrCat(" (and ", refusals_not_logged_, " more refused since)"));
  last_refusal_log_ = now;
  refusals_not_logged_ = 0;
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
        // Out of descriptors: the pending connection stays queued, the listening socket
        // readable; wait instead of spinning on it (logged once a minute at most).
        const absl::Time now = absl::Now();
        if (now - last_emfile_log_ >= absl::Minutes(1)) {
          spdlog::warn("gRPC socket {}: accept: {}; retrying every 100 ms", path_,
                       std::strerror(errno));
          last_emfile_log_ = now;
        }
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
    struct stat st {};
    if (::fstat(connection.get(), &st) != 0) continue;
    const bool exempt = exempt_ != nullptr && exempt_(*cred);
    if (absl::Status admitted = table_->Admit(connection.get(), st.st_ino, *cred, exempt);
        !admitted.ok()) {
      Refuse(connection.get(), *cred, admitted);
      continue;  // closed
    }
    hand_over_(connection.Release());
  }
}

}  // namespace gpufeed::server
