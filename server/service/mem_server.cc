#include "server/service/mem_server.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "gpufeed/v1/feed.pb.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

constexpr size_t kMaxRequestBytes = 1024;
// A client that connects and says nothing cannot hold the loop longer than this.
constexpr absl::Duration kClientTimeout = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<MemServer>> MemServer::Start(const std::string& path,
                                                           SessionManager* sessions) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd listen, ListenUnix(path));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<MemServer>(
      new MemServer(path, std::move(listen), std::move(wake), sessions));
}

MemServer::MemServer(std::string path, UniqueFd listen, UniqueFd wake, SessionManager* sessions)
    : path_(std::move(path)),
      listen_(std::move(listen)),
      wake_(std::move(wake)),
      sessions_(sessions) {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "memsock");
    Loop();
  });
}

MemServer::~MemServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  thread_.join();
  ::unlink(path_.c_str());
}

void MemServer::Loop() {
  while (true) {
    pollfd fds[2] = {{listen_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("memory socket: poll: {}", errno);
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents == 0) continue;
    UniqueFd connection(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection.valid()) continue;
    Serve(connection.get());
  }
}

void MemServer::Serve(int connection) {
  v1::MemResponse response;
  int pass_fd = -1;
  UniqueFd ring_fd;    // a dup of the host ring's memfd, closed once sent
  UniqueFd device_fd;  // a dup of the VMM export, closed once sent
  absl::Status status = SetSocketTimeout(connection, kClientTimeout);
  absl::StatusOr<Frame> frame =
      status.ok() ? RecvFrame(connection, kMaxRequestBytes) : absl::StatusOr<Frame>(status);
  v1::MemRequest request;
  if (frame.ok() && !request.ParseFromString(frame->bytes)) {
    frame = absl::InvalidArgumentError("memory socket: malformed request");
  }
  if (!frame.ok()) {
    response.set_code(static_cast<int32_t>(frame.status().code()));
    response.set_message(std::string(frame.status().message()));
  } else {
    absl::StatusOr<std::shared_ptr<Session>> session =
        sessions_->Find(request.session_id(), request.token());
    if (!session.ok()) {
      response.set_code(static_cast<int32_t>(session.status().code()));
      response.set_message(std::string(session.status().message()));
    } else if (!(*session)->device_delivery()) {
      // The ring's own memfd, the whole of it: nothing of another session's memory.
      absl::StatusOr<UniqueFd> ring = (*session)->ShareRingFd();
      if (!ring.ok()) {
        response.set_code(static_cast<int32_t>(ring.status().code()));
        response.set_message(std::string(ring.status().message()));
      } else {
        ring_fd = std::move(*ring);
        pass_fd = ring_fd.get();
        response.set_map_offset(0);
        response.set_map_bytes((*session)->ring_bytes());
      }
    } else if ((*session)->device_export().ipc != IpcKind::kVmm) {
      response.set_code(static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
      response.set_message("this session's device ring is shared by legacy CUDA IPC, not an fd");
    } else if (absl::StatusOr<UniqueFd> fd = (*session)->ExportDeviceFd(); !fd.ok()) {
      response.set_code(static_cast<int32_t>(fd.status().code()));
      response.set_message(std::string(fd.status().message()));
    } else {
      device_fd = std::move(*fd);
      pass_fd = device_fd.get();
      response.set_device(true);
      response.set_map_bytes((*session)->device_export().alloc_bytes);
    }
  }
  absl::Status sent = SendFrame(connection, response.SerializeAsString(), pass_fd);
  if (!sent.ok()) spdlog::warn("memory socket: {}", sent.ToString());
}

}  // namespace gpufeed::server
