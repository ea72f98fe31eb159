// The memory socket: hands a session's ring to its consumer as a file descriptor
// (SCM_RIGHTS), after the consumer shows the session token: a host ring's own memfd (never
// the daemon's slabs) or a device ring's VMM export. gRPC cannot carry fds.
#pragma once

#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/os/fd.h"
#include "server/session/session_manager.h"

namespace gpufeed::server {

class MemServer {
 public:
  // Binds `path` (ALREADY_EXISTS when another daemon serves it) and starts the accept thread.
  static absl::StatusOr<std::unique_ptr<MemServer>> Start(const std::string& path,
                                                          SessionManager* sessions);
  ~MemServer();  // stops the thread, removes the socket file

  const std::string& path() const { return path_; }

 private:
  MemServer(std::string path, UniqueFd listen, UniqueFd wake, SessionManager* sessions);
  void Loop();
  void Serve(int connection);

  const std::string path_;
  const UniqueFd listen_;
  const UniqueFd wake_;  // eventfd: written to stop the loop
  SessionManager* const sessions_;
  std::thread thread_;
};

}  // namespace gpufeed::server
