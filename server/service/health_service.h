// grpc.health.v1.Health for the TCP health port (--health_listen), over the callback API:
// gRPC's built-in health service serves the Unix socket, but a server with no service of
// its own does not start, so the TCP server carries this one. Same semantics: service "" is
// liveness, "gpufeed.v1.Feed" readiness (not while draining); Watch is not offered
// (Kubernetes' probes call Check).
#pragma once

#include <functional>

#include "grpc/health/v1/health.grpc.pb.h"

namespace gpufeed::server {

class TcpHealthService final : public ::grpc::health::v1::Health::CallbackService {
 public:
  TcpHealthService(std::function<bool()> live, std::function<bool()> ready)
      : live_(std::move(live)), ready_(std::move(ready)) {}

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const ::grpc::health::v1::HealthCheckRequest* request,
                                  ::grpc::health::v1::HealthCheckResponse* response) override {
    auto* reactor = ctx->DefaultReactor();
    using Response = ::grpc::health::v1::HealthCheckResponse;
    if (request->service().empty() || request->service() == "gpufeed.v1.Feed") {
      const bool up = request->service().empty() ? live_() : ready_();
      response->set_status(up ? Response::SERVING : Response::NOT_SERVING);
      reactor->Finish(grpc::Status::OK);
    } else {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND,
                                   "unknown service (want \"\" or \"gpufeed.v1.Feed\")"));
    }
    return reactor;
  }

 private:
  const std::function<bool()> live_;
  const std::function<bool()> ready_;
};

}  // namespace gpufeed::server
