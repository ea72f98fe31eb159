// The client opens the dataset itself (docs/SECURITY.md section 2), after asking the daemon
// where its memory socket is.
#include "client/cpp/session_core.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cpp/rpc.h"
#include "common/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::client::internal {
namespace {

v1::BatchReady Ready(int64_t epoch, int64_t step, int64_t samples, bool end_of_epoch) {
  v1::BatchReady b;
  b.set_epoch(epoch);
  b.set_step(step);
  b.set_samples(samples);
  b.set_end_of_epoch(end_of_epoch);
  return b;
}

MATCHER_P3(IsPosition, epoch, step, samples, "") {
  return arg.epoch == epoch && arg.step == step && arg.samples == samples;
}

// The position after a batch is the daemon's: an epoch an elastic resume began mid-way ends
// where BatchReady says, whatever steps_per_epoch (the whole epoch's) would say.
TEST(PositionAfterTest, TheDaemonsCursorAndEndOfEpochDecide) {
  EXPECT_THAT(PositionAfter(Ready(2, 3, 160, false), 10), IsPosition(2, 4, 160));
  // Past steps_per_epoch yet not the end: the daemon's mark decides, not the count.
  EXPECT_THAT(PositionAfter(Ready(2, 10, 1100, false), 10), IsPosition(2, 11, 1100));
  // The end before steps_per_epoch: one step fewer.
  EXPECT_THAT(PositionAfter(Ready(2, 8, 990, true), 10), IsPosition(3, 0, 0));
}

// A daemon from before the global cursor sends neither field: steps_per_epoch decides.
TEST(PositionAfterTest, ADaemonWithoutTheCursorGoesBySteps) {
  EXPECT_THAT(PositionAfter(Ready(2, 3, 0, false), 10), IsPosition(2, 4, 0));
  EXPECT_THAT(PositionAfter(Ready(2, 9, 0, false), 10), IsPosition(3, 0, 0));
}

class PassDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = temp_.path(); }

  absl::Status Pass(v1::DatasetKind kind, const std::string& path, v1::AttachRequest* r) {
    // No daemon there.
    const std::string socket = dir_ + "/none.sock";
    SessionCore core(ChannelFor(socket), socket, absl::Seconds(1), absl::ZeroDuration());
    r->mutable_dataset()->set_kind(kind);
    r->mutable_dataset()->set_path(path);
    return core.PassDataset(r);
  }

  gpufeed::testing::TempDir temp_;
  std::string dir_;
};

TEST_F(PassDatasetTest, ARelativePathIsLeftForTheDaemonToRefuse) {
  v1::AttachRequest r;
  EXPECT_TRUE(Pass(v1::DATASET_KIND_TOKENS, "relative.bin", &r).ok());
  EXPECT_TRUE(r.dataset().handle().empty());
}

// The daemon is asked for its memory socket first: one that is not there is the error, not
// the dataset (the local open's errors: tests/integration, DaemonTest.TheClientOpensTheDataset).
TEST_F(PassDatasetTest, TheDaemonIsAskedFirst) {
  v1::AttachRequest r;
  // A dataset that is not there either: the missing daemon is what is reported (a stale
  // socket is named as before, not hidden behind the dataset).
  absl::Status s = Pass(v1::DATASET_KIND_TOKENS, dir_ + "/nope.bin", &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::StartsWith("attach: "));
  EXPECT_TRUE(r.dataset().handle().empty());
}

// A daemon too old for this client (no memory socket in its status: protocol 1) is refused in
// one line naming both versions and the way out, before the dataset is opened.
class OldDaemon final : public v1::Admin::Service {
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* response) override {
    response->set_version("0.0.9");
    return grpc::Status::OK;
  }
};

TEST_F(PassDatasetTest, ADaemonOfAnOlderProtocolIsRefusedNamingBothVersions) {
  const std::string socket = dir_ + "/old.sock";
  OldDaemon service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix://" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  SessionCore core(ChannelFor(socket), socket, absl::Seconds(5), absl::ZeroDuration());
  v1::AttachRequest r;
  r.mutable_dataset()->set_kind(v1::DATASET_KIND_TOKENS);
  r.mutable_dataset()->set_path(dir_ + "/nope.bin");
  absl::Status s = core.PassDataset(&r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(s.message(),
            absl::StrCat("attach: gpufeedd at ", socket,
                         " is version 0.0.9 (protocol 1); this client (version ", kVersion,
                         ") needs protocol 2 or newer: upgrade gpufeedd, "
                         "or use a client of its version"));
  server->Shutdown();
}

}  // namespace
}  // namespace gpufeed::client::internal

namespace gpufeed::client::internal {
namespace {

// docs/SECURITY.md section 2: the client hands a dataset descriptor (and a session token)
// only to root, itself, the owner of the socket's directory, or GPUFEED_DAEMON_UID's uids.
TEST(TrustDaemonUidTest, RootItselfAndTheDirectorysOwnerAreTrustedByDefault) {
  const std::string socket = "/run/gpufeed/gpufeed.mem.sock";
  EXPECT_TRUE(TrustDaemonUid(0, 1000, 998, nullptr, socket).ok());
  EXPECT_TRUE(TrustDaemonUid(1000, 1000, 998, nullptr, socket).ok());
  EXPECT_TRUE(TrustDaemonUid(998, 1000, 998, nullptr, socket).ok());
  EXPECT_TRUE(TrustDaemonUid(998, 1000, 998, "", socket).ok());  // empty: unset
  const absl::Status refused = TrustDaemonUid(10002, 1000, 0, nullptr, socket);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.message(),
            "memory socket /run/gpufeed/gpufeed.mem.sock is served by uid 10002, which this "
            "client does not trust with its dataset descriptors: it trusts root, its own uid "
            "(1000) and the owner of /run/gpufeed (uid 0); if uid 10002 runs your node's "
            "gpufeedd, set GPUFEED_DAEMON_UID=10002");
  EXPECT_EQ(TrustDaemonUid(10002, 1000, std::nullopt, nullptr, socket).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(TrustDaemonUidTest, GpufeedDaemonUidReplacesTheDirectorysOwner) {
  const std::string socket = "/run/gpufeed/gpufeed.mem.sock";
  EXPECT_TRUE(TrustDaemonUid(10000, 1000, 10001, "10000", socket).ok());
  EXPECT_TRUE(TrustDaemonUid(10000, 1000, 10001, "998,10000", socket).ok());
  EXPECT_TRUE(TrustDaemonUid(0, 1000, 10001, "998", socket).ok());
  const absl::Status refused = TrustDaemonUid(10001, 1000, 10001, "10000", socket);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(refused.message()),
              ::testing::HasSubstr("served by uid 10001, which this client does not trust with "
                                   "its dataset descriptors: it trusts root, its own uid (1000) "
                                   "and GPUFEED_DAEMON_UID (10000)"));
  for (const char* bad : {"x", "10000,", "-1", "+5", "99999999999"}) {
    const absl::Status s = TrustDaemonUid(10000, 1000, 0, bad, socket);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("GPUFEED_DAEMON_UID")) << bad;
  }
}

}  // namespace
}  // namespace gpufeed::client::internal
