// Memory-socket frames: what a client writes to gpufeedd's memory socket, read with
// RecvFrame (common/os/unix_socket.h) as the daemon reads it, then parsed as a MemRequest.
//
// Input: byte 0 says which of the first six writes carry file descriptors (bits 0-5) and
// how many each carries (bits 6-7: 1, 3, 6 or 8; RecvFrame's control buffer holds 4); byte 1
// the size of each of those writes (1-64 bytes); the rest is the stream, the part past six
// writes sent in one more.
// The sender then shuts its side down, so a short frame ends instead of blocking.
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/status/statusor.h"
#include "common/os/fd.h"
#include "common/os/unix_socket.h"
#include "gpufeed/v1/feed.pb.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {
namespace {

// The daemon's limit (server/service/mem_server.cc, kMaxRequestBytes).
constexpr size_t kMaxRequestBytes = 1024;
// Small enough to sit in the socket's buffer whole, so one thread can write then read.
constexpr size_t kMaxStreamBytes = 32 * 1024;

int OpenFds() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n;
}

// One write of `bytes` with `fds` descriptors of /dev/null attached (SCM_RIGHTS).
bool Send(int socket, const char* bytes, size_t size, int fds) {
  iovec iov{const_cast<char*>(bytes), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  UniqueFd passed[8];
  if (fds > 0) {
    for (int i = 0; i < fds; ++i) passed[i].Reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds);
    for (int i = 0; i < fds; ++i) {
      const int fd = passed[i].get();
      std::memcpy(CMSG_DATA(cmsg) + i * sizeof(int), &fd, sizeof(int));
    }
  }
  return ::sendmsg(socket, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(size);
}

}  // namespace

int FuzzMemFrame(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t fd_bits = data[0];
  const size_t chunk = (data[1] % 64) + 1;
  const std::string stream(reinterpret_cast<const char*>(data) + 2,
                           std::min(size - 2, kMaxStreamBytes));
  const int fds_before = OpenFds();
  {
    int pair[2];
    FUZZ_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    UniqueFd daemon_end(pair[0]), client_end(pair[1]);
    size_t sent = 0;
    for (int i = 0; i < 7 && sent < stream.size(); ++i) {
      const size_t n = i < 6 ? std::min(chunk, stream.size() - sent) : stream.size() - sent;
      static constexpr int kFds[] = {1, 3, 6, 8};
      const int fds = i < 6 && (fd_bits >> i & 1) ? kFds[fd_bits >> 6] : 0;
      FUZZ_CHECK(Send(client_end.get(), stream.data() + sent, n, fds));
      sent += n;
    }
    FUZZ_CHECK(::shutdown(client_end.get(), SHUT_WR) == 0);

    absl::StatusOr<Frame> frame = RecvFrame(daemon_end.get(), kMaxRequestBytes);
    uint32_t declared = 0;
    if (stream.size() >= 4) {
      for (int i = 0; i < 4; ++i) declared |= uint32_t{static_cast<uint8_t>(stream[i])} << (8 * i);
    }
    if (stream.size() >= 4 && declared <= kMaxRequestBytes && stream.size() >= 4 + declared) {
      // A whole frame was sent: it comes back byte for byte.
      FUZZ_CHECK(frame.ok());
      FUZZ_CHECK(frame->bytes == stream.substr(4, declared));
    } else {
      FUZZ_CHECK(!frame.ok());
      FUZZ_CHECK(frame.status().code() == (stream.size() >= 4 && declared > kMaxRequestBytes
                                               ? absl::StatusCode::kInvalidArgument
                                               : absl::StatusCode::kUnavailable));
    }
    if (frame.ok()) {
      if (frame->fd.valid()) {
        // Received close-on-exec, so no child of the daemon inherits a client's descriptor.
        FUZZ_CHECK((::fcntl(frame->fd.get(), F_GETFD) & FD_CLOEXEC) != 0);
      }
      v1::MemRequest request;
      if (request.ParseFromString(frame->bytes)) {
        (void)request.session_id();
        (void)request.token().size();
      }
    }
  }
  // Every descriptor a client sent is owned and closed, whatever the frame's fate.
  FUZZ_CHECK(OpenFds() == fds_before);
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzMemFrame)
