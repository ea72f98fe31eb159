#include "server/service/mem_server.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "gpufeed/v1/feed.pb.h"
#include "server/auth/caller.h"
#include "server/service/convert.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// A request: a session's id and token, or open_dataset, whose object_store may carry a web
// identity token (a Kubernetes service account's JWT: up to 20,000 bytes at AWS's bound, the
// daemon's check takes 64 KiB) and an STS session token (a few KiB).
constexpr size_t kMaxRequestBytes = 96 << 10;

void SetError(const absl::Status& status, v1::MemResponse* response) {
  response->set_code(static_cast<int32_t>(status.code()));
  response->set_message(std::string(status.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MemServer>> MemServer::Start(const std::string& path,
                                                           SessionManager* sessions,
                                                           MemServerOptions options) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd listen, ListenUnix(path));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoToStatus(errno, "eventfd");
  return std::unique_ptr<MemServer>(
      new MemServer(path, std::move(listen), std::move(wake), sessions, options));
}

MemServer::MemServer(std::string path, UniqueFd listen, UniqueFd wake, SessionManager* sessions,
                     MemServerOptions options)
    : path_(std::move(path)),
      listen_(std::move(listen)),
      wake_(std::move(wake)),
      sessions_(sessions),
      options_(options) {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "memsock");
    Loop();
  });
}

MemServer::~MemServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof(one));
  thread_.join();
  // Every connection thread polls wake_ too: each ends within a poll.
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, t] : running_) threads.push_back(std::move(t));
    running_.clear();
    for (std::thread& t : finished_) threads.push_back(std::move(t));
    finished_.clear();
  }
  for (std::thread& t : threads) t.join();
  ::unlink(path_.c_str());
}

int MemServer::active() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(running_.size());
}

void MemServer::JoinFinished() {
  std::vector<std::thread> done;
  {
    absl::MutexLock lock(&mu_);
    done.swap(finished_);
  }
  for (std::thread& t : done) t.join();
}

void MemServer::Loop() {
  absl::Time last_emfile_log = absl::InfinitePast();
  while (true) {
    pollfd fds[2] = {{listen_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("memory socket: poll: {}", errno);
      return;
    }
    if (fds[1].revents != 0) return;
    JoinFinished();
    if (fds[0].revents == 0) continue;
    UniqueFd connection(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection.valid()) {
      if (errno == EMFILE || errno == ENFILE) {
        // Out of descriptors: the connection stays queued and the socket readable; wait
        // 100 ms (or for the stop) instead of spinning on it, and say so once a minute.
        const absl::Time now = absl::Now();
        if (now - last_emfile_log >= absl::Minutes(1)) {
          spdlog::warn("memory socket: accept: {}; retrying every 100 ms", std::strerror(errno));
          last_emfile_log = now;
        }
        pollfd wake = {wake_.get(), POLLIN, 0};
        if (::poll(&wake, 1, 100) > 0) return;
      }
      continue;
    }
    // The peer's uid now (the kernel's, at connect time): its share of the slots.
    absl::StatusOr<PeerCred> peer = GetPeerCred(connection.get());
    if (!peer.ok()) continue;  // no identity, no service
    const uint32_t uid = peer->uid;
    const bool exempt = options_.exempt_root_and_daemon &&
                        (uid == 0 || uid == static_cast<uint32_t>(::geteuid()));
    absl::Status refused;
    {
      absl::MutexLock lock(&mu_);
      int& mine = per_uid_[uid];
      if (static_cast<int>(running_.size()) >= options_.max_connections) {
        refused = absl::ResourceExhaustedError(absl::StrCat(
            "memory socket: ", options_.max_connections,
            " connections are being served; retry shortly"));
      } else if (!exempt && mine >= options_.max_connections_per_uid) {
        refused = absl::ResourceExhaustedError(
            absl::StrCat("memory socket: uid ", uid, " has ", mine,
                         " connections being served, the most one uid may; retry shortly"));
      } else {
        ++mine;
        const uint64_t id = next_id_++;
        // The thread's last act waits for mu_, held until the thread is in running_.
        running_[id] = std::thread(
            [this, id, uid](UniqueFd c) {
              pthread_setname_np(pthread_self(), "mem/conn");
              RunConnection(id, uid, std::move(c));
            },
            std::move(connection));
        continue;
      }
      if (mine == 0) per_uid_.erase(uid);
    }
    // Refused at once, without waiting for the request: the reply is small enough for the
    // socket buffer of a fresh connection, and MSG_DONTWAIT keeps the loop from blocking.
    v1::MemResponse busy;
    SetError(refused, &busy);
    const std::string body = busy.SerializeAsString();
    std::string wire(4, '\0');
    for (int i = 0; i < 4; ++i) wire[i] = static_cast<char>((body.size() >> (8 * i)) & 0xff);
    wire += body;
    [[maybe_unused]] ssize_t sent =
        ::send(connection.get(), wire.data(), wire.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  }
}

void MemServer::RunConnection(uint64_t id, uint32_t uid, UniqueFd connection) {
  Serve(connection.get());
  connection.Reset();
  absl::MutexLock lock(&mu_);
  if (auto n = per_uid_.find(uid); n != per_uid_.end() && --n->second <= 0) per_uid_.erase(n);
  auto it = running_.find(id);
  if (it == running_.end()) return;  // the destructor took it: it joins this thread
  finished_.push_back(std::move(it->second));
  running_.erase(it);
}

void MemServer::Serve(int connection) {
  const absl::Time deadline = absl::Now() + options_.request_timeout;
  v1::MemResponse response;
  int pass_fd = -1;
  UniqueFd ring_fd;    // a dup of the host ring's memfd, closed once sent
  UniqueFd device_fd;  // a dup of the VMM export, closed once sent
  absl::StatusOr<PeerCred> cred = GetPeerCred(connection);
  absl::StatusOr<Frame> frame =
      cred.ok() ? RecvFrame(connection, kMaxRequestBytes, deadline, wake_.get())
                : absl::StatusOr<Frame>(cred.status());
  if (absl::IsCancelled(frame.status())) return;  // shutting down: nothing to answer
  if (absl::IsDeadlineExceeded(frame.status())) {
    frame = absl::DeadlineExceededError(absl::StrCat(
        "memory socket: the request did not arrive within ",
        absl::FormatDuration(options_.request_timeout), " (mem_request_timeout)"));
  }
  v1::MemRequest request;
  if (frame.ok() && !request.ParseFromString(frame->bytes)) {
    frame = absl::InvalidArgumentError("memory socket: malformed request");
  }
  if (!frame.ok()) {
    SetError(frame.status(), &response);
  } else if (request.open_dataset()) {
    // A dataset the client opened with its own rights (docs/SECURITY.md section 2).
    // The lifeline: a second descriptor of this connection, kept by the handle and then by
    // the session attached with it, once this thread is done with the connection.
    UniqueFd lifeline;
    if (request.lifeline()) lifeline.Reset(::fcntl(connection, F_DUPFD_CLOEXEC, 0));
    absl::StatusOr<std::string> handle;
    if (request.has_object_store()) {
      // An s3:// dataset: the caller's access instead of a descriptor (never logged).
      if (frame->fd.valid()) {
        handle = absl::InvalidArgumentError(
            "open_dataset: object_store and a descriptor together; send one");
      } else {
        handle = sessions_->AddObjectStoreHandle(ToObjectStoreAccess(request.object_store()), *cred,
                                                 std::move(lifeline));
      }
    } else {
      handle = frame->fd.valid()
                   ? sessions_->AddDatasetHandle(std::move(frame->fd), *cred, std::move(lifeline))
                   : absl::InvalidArgumentError(
                         "open_dataset: no descriptor came with the request (SCM_RIGHTS)");
    }
    if (handle.ok()) {
      response.set_dataset_handle(*handle);
    } else {
      SetError(handle.status(), &response);
    }
  } else {
    Caller caller;
    caller.cred = *cred;
    absl::StatusOr<std::shared_ptr<Session>> session =
        sessions_->Find(request.session_id(), request.token(), caller);
    if (!session.ok()) {
      SetError(session.status(), &response);
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
      SetError(fd.status(), &response);
    } else {
      device_fd = std::move(*fd);
      pass_fd = device_fd.get();
      response.set_device(true);
      response.set_map_bytes((*session)->device_export().alloc_bytes);
    }
  }
  // The reply is small; a client that never reads it cannot hold this thread past the
  // deadline (and a second at least, to answer a request that came at the last moment).
  absl::Status sent = SetSocketTimeout(
      connection, std::max(deadline - absl::Now(), absl::Seconds(1)));
  if (sent.ok()) sent = SendFrame(connection, response.SerializeAsString(), pass_fd);
  if (!sent.ok()) spdlog::warn("memory socket: {}", sent.ToString());
}

}  // namespace gpufeed::server
