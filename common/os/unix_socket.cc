#include "common/os/unix_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed {
namespace {

absl::StatusOr<sockaddr_un> MakeAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path '", path, "' is empty or longer than ", sizeof(addr.sun_path) - 1,
        " bytes"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

absl::StatusOr<UniqueFd> NewSocket() {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "socket");
  return fd;
}

}  // namespace

bool UnixSocketInUse(const std::string& path) { return ConnectUnix(path).ok(); }

absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, unsigned mode) {
  GPUFEED_ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddress(path));
  if (UnixSocketInUse(path)) {
    return absl::AlreadyExistsError(
        absl::StrCat("socket ", path, " is in use by another process"));
  }
  // A stale socket from a crashed daemon is replaced; anything else at the path is kept (a
  // typo in --listen must never delete a file).
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::AlreadyExistsError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    ::unlink(path.c_str());
  }
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd, NewSocket());
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("binding ", path));
  }
  if (::chmod(path.c_str(), mode) != 0) return ErrnoToStatus(errno, absl::StrCat("chmod ", path));
  if (::listen(fd.get(), 128) != 0) return ErrnoToStatus(errno, absl::StrCat("listen ", path));
  return fd;
}

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path) {
  GPUFEED_ASSIGN_OR_RETURN(sockaddr_un addr, MakeAddress(path));
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd, NewSocket());
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(errno, absl::StrCat("connecting to ", path));
  }
  return fd;
}

absl::Status SetSocketTimeout(int fd, absl::Duration timeout) {
  const timeval tv = absl::ToTimeval(timeout);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) != 0) {
    return ErrnoToStatus(errno, "setting socket timeout");
  }
  return absl::OkStatus();
}

absl::Status SendFrame(int socket, const std::string& bytes, int pass_fd) {
  const uint32_t len = static_cast<uint32_t>(bytes.size());
  unsigned char header[4] = {static_cast<unsigned char>(len), static_cast<unsigned char>(len >> 8),
                             static_cast<unsigned char>(len >> 16),
                             static_cast<unsigned char>(len >> 24)};
  std::string wire(reinterpret_cast<char*>(header), 4);
  wire += bytes;
  size_t sent = 0;
  while (sent < wire.size()) {
    iovec iov{wire.data() + sent, wire.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    if (sent == 0 && pass_fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &pass_fd, sizeof(int));
    }
    const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "sending on memory socket");
    }
    sent += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

namespace {

// Waits until `socket` is readable, `deadline` passes (DEADLINE_EXCEEDED) or `wake_fd`
// (when >= 0) is readable (CANCELLED).
absl::Status AwaitReadable(int socket, absl::Time deadline, int wake_fd) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError("memory socket: the request did not arrive in time");
    }
    pollfd fds[2] = {{socket, POLLIN, 0}, {wake_fd, POLLIN, 0}};
    // Rounded up: a deadline 0.3 ms away must not spin with a timeout of 0.
    const int ms = static_cast<int>(
        std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60'000));
    const int n = ::poll(fds, wake_fd >= 0 ? 2 : 1, ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "polling the memory socket");
    }
    if (wake_fd >= 0 && fds[1].revents != 0) {
      return absl::CancelledError("memory socket: gpufeedd is shutting down");
    }
    if (fds[0].revents != 0) return absl::OkStatus();  // data, hang-up or error: recv tells
  }
}

absl::StatusOr<Frame> Recv(int socket, size_t max_bytes, const absl::Time* deadline,
                           int wake_fd) {
  Frame frame;
  std::string buffer;
  size_t want = 4;
  bool have_header = false;
  while (buffer.size() < want) {
    char chunk[4096];
    iovec iov{chunk, std::min(sizeof(chunk), want - buffer.size())};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    if (deadline != nullptr) GPUFEED_RETURN_IF_ERROR(AwaitReadable(socket, *deadline, wake_fd));
    const ssize_t n =
        ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | (deadline != nullptr ? MSG_DONTWAIT : 0));
    if (n < 0) {
      if (errno == EINTR || (deadline != nullptr && (errno == EAGAIN || errno == EWOULDBLOCK))) {
        continue;
      }
      return ErrnoToStatus(errno, "reading from memory socket");
    }
    for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
      if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
        if (!frame.fd.valid()) {
          frame.fd.Reset(fd);
        } else {
          ::close(fd);  // more than we asked for: never leak it
        }
      }
    }
    if (n == 0) return absl::UnavailableError("memory socket closed mid-message");
    buffer.append(chunk, static_cast<size_t>(n));
    if (!have_header && buffer.size() >= 4) {
      const auto* h = reinterpret_cast<const unsigned char*>(buffer.data());
      const size_t len = h[0] | (h[1] << 8) | (h[2] << 16) | (static_cast<size_t>(h[3]) << 24);
      if (len > max_bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("memory socket frame of ", len, " bytes exceeds ", max_bytes));
      }
      want = 4 + len;
      have_header = true;
    }
  }
  frame.bytes = buffer.substr(4);
  return frame;
}

}  // namespace

absl::StatusOr<Frame> RecvFrame(int socket, size_t max_bytes) {
  return Recv(socket, max_bytes, nullptr, -1);
}

absl::StatusOr<Frame> RecvFrame(int socket, size_t max_bytes, absl::Time deadline, int wake_fd) {
  return Recv(socket, max_bytes, &deadline, wake_fd);
}

}  // namespace gpufeed
