// server/service/feed_service.cc over an in-process gRPC server: an exception escaping the
// core on an attach thread is that Attach's error (docs/SECURITY.md §4), and the daemon's
// service goes on.
#include "server/service/feed_service.h"

#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <memory>
#include <new>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/service/access_policy.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

// One GPU whose ring allocation throws std::bad_alloc: an exception from deep in Attach.
class ThrowingDevices final : public DeviceBackend {
 public:
  std::vector<std::string> gpu_uuids() const override { return {"GPU-throws"}; }
  absl::StatusOr<std::unique_ptr<DeviceRing>> AllocateRing(const std::string&, int, uint64_t,
                                                           IpcKind, uint64_t) override {
    throw std::bad_alloc();
  }
  void Post(const std::string&, std::function<void()> work) override { work(); }
  void PostLater(const std::string&, std::function<void()> work) override { work(); }
};

TEST(FeedServiceTest, AnExceptionOnAnAttachThreadFailsThatAttachOnly) {
  gpufeed::testing::TempDir dir;
  const std::string path = dir.WriteFile("tokens.bin", std::string(2 * 1001, '\x01'));
  absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(4 << 20, 4 << 20);
  ASSERT_TRUE(pool.ok()) << pool.status();
  ThrowingDevices devices;
  SessionManagerOptions options;
  options.threads = 2;
  SessionManager manager(options, pool->get(), PosixFileSystem(), &devices);
  // Every in-process call is the daemon's own uid: an admin, who may attach by path.
  AccessPolicy policy;
  policy.daemon_uid = static_cast<uint32_t>(::geteuid());
  CallerResolver callers(
      [](absl::string_view) {
        PeerCred self;
        self.uid = static_cast<uint32_t>(::geteuid());
        return std::optional<PeerCred>(self);
      },
      policy);
  auto service = std::make_unique<FeedService>(&manager, &callers, "/run/test.mem.sock", 1);
  grpc::ServerBuilder builder;
  builder.RegisterService(service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<v1::Feed::Stub> stub =
      v1::Feed::NewStub(server->InProcessChannel(grpc::ChannelArguments()));

  v1::AttachRequest request;
  request.set_job("train");
  request.set_world_size(1);
  request.set_batch_size(4);
  request.set_ring_slots(2);
  request.mutable_dataset()->set_kind(v1::DATASET_KIND_TOKENS);
  request.mutable_dataset()->set_path(path);
  request.mutable_dataset()->set_token_dtype(v1::DTYPE_UINT16);
  request.mutable_dataset()->set_seq_len(10);
  request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_DEVICE);
  request.mutable_delivery()->set_gpu_uuid("GPU-throws");
  const uint64_t free_before = (*pool)->free_bytes();
  for (int attempt = 0; attempt < 2; ++attempt) {  // the one attach thread survives the first
    grpc::ClientContext ctx;
    v1::AttachResponse response;
    const grpc::Status s = stub->Attach(&ctx, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << attempt;
    EXPECT_EQ(s.error_message(),
              "attach: out of memory (std::bad_alloc): the request needs more memory than "
              "gpufeedd can allocate")
        << attempt;
  }
  // Nothing is left behind: the host ring went back, no session, the job rank is free.
  EXPECT_EQ((*pool)->free_bytes(), free_before);
  EXPECT_EQ(manager.num_sessions(), 0);
  EXPECT_EQ(manager.ids_bytes_in_use(), 0u);
  request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_HOST);
  grpc::ClientContext ctx;
  v1::AttachResponse response;
  const grpc::Status host = stub->Attach(&ctx, request, &response);
  EXPECT_TRUE(host.ok()) << host.error_message();
  EXPECT_EQ(manager.num_sessions(), 1);

  server->Shutdown();
  manager.Shutdown(absl::UnavailableError("test over"));
  service.reset();
}

}  // namespace
}  // namespace gpufeed::server
