// gpufeed.v1.Feed and gpufeed.v1.Admin over the callback API: thin adapters over the
// SessionManager. Handlers only convert, call the core and convert back; nothing blocks.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "server/service/attach_queue.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "server/service/access_policy.h"
#include "server/service/conn_limits.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"

namespace gpufeed::server {

// Test seams of the stream reactor (tests/unit/server/daemon_test.cc), empty in the daemon.
// Set them before a stream opens and clear them after it ended: they are read unlocked.
struct StreamTestHooks {
  // A session notification's Kick calls it holding its claim on the reactor, just before it
  // steps it: a test that blocks here holds a Kick inside the race with OnDone.
  std::function<void()> kick_before_step;
  // OnDone calls it once it has decided who deletes the reactor.
  std::function<void()> on_done;
};
StreamTestHooks& TestHooksOfStreams();

// Stream calls whose open message has not come yet (docs/SECURITY.md section 4): at most
// this many of one uid (admins exempt) and in all, each ended with DEADLINE_EXCEEDED past
// open_timeout. The caps are the connections' (max_connections_per_uid, max_connections).
struct UnopenedStreamLimits {
  int max_per_uid = 64;
  int max_total = 1024;
  absl::Duration open_timeout = absl::Seconds(10);  // stream_open_timeout
};

class FeedService final : public v1::Feed::CallbackService {
 public:
  // Attach opens datasets (an ImageFolder index walks the whole tree) and allocates device
  // memory: it runs on `attach_threads` threads of its own, never on gRPC's callback threads.
  // Every call is identified by `callers` (its connection's peer credentials) and refused
  // unless that peer may consume.
  FeedService(SessionManager* sessions, const CallerResolver* callers, std::string mem_socket,
              int attach_threads = 2, UnopenedStreamLimits unopened = {});
  ~FeedService() override;  // finishes the attaches queued, then joins

  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* ctx,
                                   const v1::AttachRequest* request,
                                   v1::AttachResponse* response) override;
  grpc::ServerBidiReactor<v1::StreamRequest, v1::StreamResponse>* Stream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* GetPosition(grpc::CallbackServerContext* ctx,
                                        const v1::GetPositionRequest* request,
                                        v1::GetPositionResponse* response) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* ctx,
                                   const v1::DetachRequest* request,
                                   v1::DetachResponse* response) override;

 private:
  SessionManager* const sessions_;
  const CallerResolver* const callers_;
  const std::string mem_socket_;
  UnopenedStreams unopened_;
  AttachQueue attach_work_;
  std::vector<std::thread> attach_threads_;
};

struct DaemonInfo {
  std::string version;
  absl::Time started;
  const StagingPool* pool = nullptr;
  std::function<bool()> serving;
  std::function<bool()> draining;
  // Starts a drain (Admin.Drain); returns the sessions attached.
  std::function<int(absl::Duration timeout)> drain;
  std::string mem_socket;  // GetStatusResponse.mem_socket: clients pass datasets there
  std::vector<std::string> gpus, mps_gpus;  // UUIDs: every GPU, and those under MPS
};

class AdminService final : public v1::Admin::CallbackService {
 public:
  // GetStatus is for everyone who can connect (aggregate numbers); ListSessions and ListFeeds
  // show a non-admin only its own; Drain is for admins.
  AdminService(SessionManager* sessions, const CallerResolver* callers, DaemonInfo info)
      : sessions_(sessions), callers_(callers), info_(std::move(info)) {}

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* ListFeeds(grpc::CallbackServerContext* ctx,
                                      const v1::ListFeedsRequest* request,
                                      v1::ListFeedsResponse* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* ctx,
                                  const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;

 private:
  SessionManager* const sessions_;
  const CallerResolver* const callers_;
  const DaemonInfo info_;
};

}  // namespace gpufeed::server
