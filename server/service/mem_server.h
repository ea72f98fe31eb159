// The memory socket: hands a session's ring to its consumer as a file descriptor
// (SCM_RIGHTS), after the consumer shows the session token: a host ring's own memfd (never
// the daemon's slabs) or a device ring's VMM export; and it takes a client's dataset
// descriptor in exchange for a dataset handle (open_dataset). gRPC cannot carry fds.
//
// Connections are served concurrently, each on a thread of its own ("mem/conn"), at most
// max_connections at a time (beyond, a connection gets a RESOURCE_EXHAUSTED frame at once),
// each within request_timeout for the whole request however slowly it trickles in
// (docs/SECURITY.md section 4). The peer is identified by SO_PEERCRED. Out of descriptors
// (EMFILE, ENFILE), the accept thread waits 100 ms before it accepts again.
#pragma once

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/os/fd.h"
#include "common/os/peer_cred.h"
#include "server/session/session_manager.h"

namespace gpufeed::server {

struct MemServerOptions {
  absl::Duration request_timeout = absl::Seconds(2);  // mem_request_timeout
  int max_connections = 64;
  // At most this many of them from one uid (root and the daemon's own uid excepted), so that
  // one user trickling requests cannot hold every slot (docs/SECURITY.md section 4).
  int max_connections_per_uid = 8;
  bool exempt_root_and_daemon = true;  // false: tests, where the test process is both
};

class MemServer {
 public:
  // Binds `path` (ALREADY_EXISTS when another daemon serves it) and starts the accept thread.
  static absl::StatusOr<std::unique_ptr<MemServer>> Start(const std::string& path,
                                                          SessionManager* sessions,
                                                          MemServerOptions options = {});
  // Stops accepting, cuts off the connections in progress, joins every thread, removes the
  // socket file.
  ~MemServer();

  const std::string& path() const { return path_; }
  // Connections being served now.
  int active() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  MemServer(std::string path, UniqueFd listen, UniqueFd wake, SessionManager* sessions,
            MemServerOptions options);
  void Loop();
  // Serves one connection on its own thread, then hands that thread over to be joined.
  void RunConnection(uint64_t id, uint32_t uid, UniqueFd connection) ABSL_LOCKS_EXCLUDED(mu_);
  void Serve(int connection);
  // Joins the threads of connections that ended.
  void JoinFinished() ABSL_LOCKS_EXCLUDED(mu_);

  const std::string path_;
  const UniqueFd listen_;
  const UniqueFd wake_;  // eventfd: written once to stop everything; stays readable
  SessionManager* const sessions_;
  const MemServerOptions options_;

  mutable absl::Mutex mu_;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, std::thread> running_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, int> per_uid_ ABSL_GUARDED_BY(mu_);  // connections being served

  std::thread thread_;
};

}  // namespace gpufeed::server
