// Unix stream sockets and file-descriptor passing (SCM_RIGHTS): gRPC cannot carry file
// descriptors, so memory is handed over on a socket of our own.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/os/fd.h"

namespace gpufeed {

// True when something accepts connections on `path`.
bool UnixSocketInUse(const std::string& path);

// Binds and listens on `path`. A stale socket file (nobody listening) is replaced; a live one
// is ALREADY_EXISTS. The socket file gets mode `mode`.
absl::StatusOr<UniqueFd> ListenUnix(const std::string& path, unsigned mode = 0660);

absl::StatusOr<UniqueFd> ConnectUnix(const std::string& path);

// Sets send and receive timeouts on a socket.
absl::Status SetSocketTimeout(int fd, absl::Duration timeout);

// One framed message: a little-endian uint32 length, then the bytes; `pass_fd` (when >= 0)
// travels as SCM_RIGHTS with the first byte.
absl::Status SendFrame(int socket, const std::string& bytes, int pass_fd = -1);

struct Frame {
  std::string bytes;
  UniqueFd fd;  // invalid when none came
};
// Reads one frame of at most `max_bytes`; a longer one is INVALID_ARGUMENT.
absl::StatusOr<Frame> RecvFrame(int socket, size_t max_bytes);
// As above, all of it by `deadline` however it trickles in (DEADLINE_EXCEEDED after), and
// CANCELLED as soon as `wake_fd` (when >= 0, e.g. an eventfd) becomes readable.
absl::StatusOr<Frame> RecvFrame(int socket, size_t max_bytes, absl::Time deadline,
                                int wake_fd = -1);

}  // namespace gpufeed
