// AdminClient: the daemon's health, status, feeds and sessions, and drain.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "client/cpp/blend.h"
#include "client/cpp/rpc.h"
#include "common/status.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpufeed::client {

using internal::Call;

struct AdminClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::unique_ptr<::grpc::health::v1::Health::Stub> health;
  absl::Duration timeout;
};

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(const std::string& given,
                                                                  absl::Duration timeout) {
  const std::string socket = SocketPath(given);
  GPUFEED_RETURN_IF_ERROR(internal::ProbeSocket(socket));
  auto impl = std::make_unique<Impl>();
  impl->channel = internal::ChannelFor(socket);
  impl->admin = v1::Admin::NewStub(impl->channel);
  impl->health = ::grpc::health::v1::Health::NewStub(impl->channel);
  impl->timeout = timeout;
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(impl)));
}

absl::StatusOr<DaemonStatus> AdminClient::GetStatus() {
  DaemonStatus out;
  {
    ::grpc::health::v1::HealthCheckRequest request;
    request.set_service("gpufeed.v1.Feed");
    ::grpc::health::v1::HealthCheckResponse response;
    GPUFEED_RETURN_IF_ERROR(Call(impl_->health.get(), &::grpc::health::v1::Health::Stub::Check,
                                 request, &response, impl_->timeout, "health"));
    out.health = ::grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  }
  v1::GetStatusResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::GetStatus,
                               v1::GetStatusRequest(), &response, impl_->timeout, "status"));
  out.version = response.version();
  out.uptime_ms = response.uptime_ms();
  out.staging_total_bytes = response.staging_total_bytes();
  out.staging_free_bytes = response.staging_free_bytes();
  out.sessions = response.sessions();
  out.feeds = response.feeds();
  out.draining = response.draining();
  out.protocol = response.protocol();
  out.gpus.assign(response.gpus().begin(), response.gpus().end());
  out.mps_gpus.assign(response.mps_gpus().begin(), response.mps_gpus().end());
  return out;
}

absl::StatusOr<std::vector<FeedInfo>> AdminClient::ListFeeds() {
  v1::ListFeedsResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::ListFeeds,
                               v1::ListFeedsRequest(), &response, impl_->timeout, "feeds"));
  std::vector<FeedInfo> out;
  for (const v1::FeedInfo& f : response.feeds()) {
    FeedInfo info;
    info.key = f.key();
    info.kind = f.dataset().kind() == v1::DATASET_KIND_TOKENS       ? "tokens"
                : f.dataset().kind() == v1::DATASET_KIND_RECORDS    ? "records"
                : f.dataset().kind() == v1::DATASET_KIND_WEBDATASET ? "webdataset"
                                                                    : "image_folder";
    info.dataset = f.dataset().path();
    info.num_samples = f.num_samples();
    info.batch_size = f.batch_size();
    info.world_size = f.world_size();
    info.seed = f.seed();
    info.shuffle = f.shuffle();
    info.drop_last = f.drop_last();
    info.share_group = f.share_group();
    info.sessions = f.sessions();
    info.batches_produced = f.batches_produced();
    info.bytes_produced = f.bytes_produced();
    info.bad_samples.insert(f.bad_samples().begin(), f.bad_samples().end());
    for (const v1::BlendSource& source : f.dataset().sources()) {
      info.blend.emplace_back(source.name(), source.weight());
    }
    if (f.dataset().pack() != v1::PACK_MODE_NONE) {
      info.pack = internal::PackModeName(f.dataset().pack());
    }
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::vector<SessionSummary>> AdminClient::ListSessions() {
  v1::ListSessionsResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::ListSessions,
                               v1::ListSessionsRequest(), &response, impl_->timeout, "sessions"));
  std::vector<SessionSummary> out;
  for (const v1::SessionInfo& s : response.sessions()) {
    SessionSummary info;
    info.session_id = s.session_id();
    info.owner_uid = s.owner_uid();
    info.job = s.job();
    info.rank = s.rank();
    info.world_size = s.world_size();
    info.feed_key = s.feed_key();
    info.delivery = s.delivery() == v1::DELIVERY_KIND_DEVICE ? "device" : "host";
    info.gpu_uuid = s.gpu_uuid();
    info.delivered = {s.delivered().epoch(), s.delivered().step(), "", s.delivered().samples()};
    info.ring_slots = s.ring_slots();
    info.slots_leased = s.slots_leased();
    info.ring_bytes = s.ring_bytes();
    info.batches_delivered = s.batches_delivered();
    info.streaming = s.streaming();
    info.age_ms = s.age_ms();
    info.bytes_delivered = s.bytes_delivered();
    info.producer_blocked_ns = s.producer_blocked_ns();
    info.consumer_wait_ns = s.consumer_wait_ns();
    info.cpu_decode_share = s.cpu_decode_share();
    info.streaming_ns = s.streaming_ns();
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<int32_t> AdminClient::Drain(absl::Duration timeout) {
  v1::DrainRequest request;
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::DrainResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::Drain, request, &response,
                               impl_->timeout, "drain"));
  return response.sessions();
}

}  // namespace gpufeed::client
