// The Admin service (feed_service.h): status, listings and drain. The consumers' service,
// FeedService, is feed_service.cc.

#include "server/service/feed_service.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/version.h"
#include "server/service/convert.h"

namespace gpufeed::server {

grpc::ServerUnaryReactor* AdminService::GetStatus(grpc::CallbackServerContext* ctx,
                                                  const v1::GetStatusRequest* request,
                                                  v1::GetStatusResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  response->set_version(info_.version);
  response->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - info_.started));
  response->set_serving(info_.serving ? info_.serving() : true);
  response->set_staging_total_bytes(info_.pool->total_bytes());
  response->set_staging_free_bytes(info_.pool->free_bytes());
  response->set_sessions(sessions_->num_sessions());
  response->set_feeds(static_cast<int32_t>(sessions_->ListFeeds().size()));
  response->set_draining(info_.draining ? info_.draining() : false);
  response->set_mem_socket(info_.mem_socket);
  response->set_protocol(kProtocol);
  for (const std::string& g : info_.gpus) response->add_gpus(g);
  for (const std::string& g : info_.mps_gpus) response->add_mps_gpus(g);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListFeeds(grpc::CallbackServerContext* ctx,
                                                  const v1::ListFeedsRequest* request,
                                                  v1::ListFeedsResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->Identify(ctx->peer());
  if (caller.ok()) {
    for (const FeedSnapshot& f : sessions_->ListFeeds(*caller)) ToProto(f, response->add_feeds());
  }
  reactor->Finish(ToGrpcStatus(caller.status()));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::ListSessions(grpc::CallbackServerContext* ctx,
                                                     const v1::ListSessionsRequest* request,
                                                     v1::ListSessionsResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->Identify(ctx->peer());
  if (caller.ok()) {
    for (const SessionSnapshot& s : sessions_->ListSessions(*caller)) {
      ToProto(s, response->add_sessions());
    }
  }
  reactor->Finish(ToGrpcStatus(caller.status()));
  return reactor;
}

grpc::ServerUnaryReactor* AdminService::Drain(grpc::CallbackServerContext* ctx,
                                              const v1::DrainRequest* request,
                                              v1::DrainResponse* response) {
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = callers_->Identify(ctx->peer());
  if (!caller.ok()) {
    reactor->Finish(ToGrpcStatus(caller.status()));
    return reactor;
  }
  if (!caller->admin) {
    reactor->Finish(ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
        "drain: only an admin may drain gpufeedd (", DescribeAdmins(callers_->policy()),
        ")"))));
    return reactor;
  }
  if (request->timeout_ms() < 0) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "timeout_ms: must be >= 0 (0: no limit)"));
    return reactor;
  }
  if (!info_.drain) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this daemon cannot drain"));
    return reactor;
  }
  response->set_sessions(info_.drain(absl::Milliseconds(request->timeout_ms())));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace gpufeed::server
