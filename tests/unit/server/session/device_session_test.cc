// The device-delivery flow of a session, without a GPU: a fake backend stands for CUDA.
#include <algorithm>
#include <cstring>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/os/file.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/fake_device_backend.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

class DeviceSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string bytes;
    for (uint16_t t = 0; t < 4001; ++t) {
      bytes += static_cast<char>(t & 0xff);
      bytes += static_cast<char>(t >> 8);
    }
    path_ = dir_.WriteFile("t.bin", bytes);
    auto pool = StagingPool::Create(8 << 20, 8 << 20);
    ASSERT_TRUE(pool.ok());
    pool_ = std::move(*pool);
    SessionManagerOptions options;
    options.threads = 2;
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), MappedFileSystem(), &devices_);
  }

  AttachSpec Spec() {
    AttachSpec spec;
    spec.job = "dev";
    spec.feed.dataset.kind = DatasetKind::kTokens;
    spec.feed.dataset.path = path_;
    spec.feed.dataset.token_dtype = DType::kUInt16;
    spec.feed.dataset.seq_len = 10;
    spec.feed.batch_size = 4;
    spec.feed.world_size = 1;
    spec.feed.shuffle = false;
    spec.ring_slots = 2;
    spec.delivery = DeliveryKind::kDevice;
    spec.gpu_uuid = "GPU-fake";
    return spec;
  }

  // Polls NextEvent until a batch, the end or `timeout`.
  StreamEvent Next(Session& s) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (absl::Now() < deadline) {
      StreamEvent e = s.NextEvent();
      if (e.kind != StreamEvent::kNothing) return e;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return {};
  }

  testing::TempDir dir_;
  std::string path_;
  testing::FakeDeviceBackend devices_{1 << 20};
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> manager_;
};

TEST_F(DeviceSessionTest, BatchesAreCopiedToTheDeviceRingAndReusedSlotsWaitForRelease) {
  absl::StatusOr<Attachment> a = manager_->Attach(Spec());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->device);
  EXPECT_EQ(a->device_ring.ready_event_handles.size(), 2u);
  auto session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}, {std::string(64, 'r'), std::string(64, 'r')}).ok());
  for (int step = 0; step < 4; ++step) {
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << "step " << step;
    EXPECT_EQ(e.batch.position.step, step);
    EXPECT_EQ(e.batch.ids, (std::vector<int64_t>{step * 4, step * 4 + 1, step * 4 + 2, step * 4 + 3}));
    // The "device" slot holds the file's tokens of the first row: token k = k.
    uint16_t first;
    std::memcpy(&first, devices_.last->slot_data(e.batch.slot), 2);
    EXPECT_EQ(first, step * 4 * 10);
    ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
  }
  const std::vector<std::string> calls = devices_.log->Calls();
  // The release events are opened on the copy thread before any copy that reuses a slot
  // (first copies may come earlier: filling starts at Attach).
  const auto opened = std::find(calls.begin(), calls.end(), "release-events 2");
  const auto reuse = std::find_if(calls.begin(), calls.end(), [](const std::string& c) {
    return c.find("reused") != std::string::npos;
  });
  ASSERT_NE(opened, calls.end());
  ASSERT_NE(reuse, calls.end());
  EXPECT_LT(opened - calls.begin(), reuse - calls.begin());
  EXPECT_THAT(calls, Contains("copy 0 first"));
  EXPECT_THAT(calls, Contains("copy 0 reused"));
  EXPECT_THAT(calls, Contains("wait-copied 0"));  // the host slot is refilled only after its copy
}

TEST_F(DeviceSessionTest, BudgetUnknownGpuAndReleaseEventCountAreChecked) {
  AttachSpec big = Spec();
  big.feed.batch_size = 4000 / 10 - 1;  // 399 rows x 22 B = 8.8 KB: 3 pages a slot
  big.ring_slots = 64;                  // 64 x 12 KiB = 768 KiB: fits; twice does not
  ASSERT_TRUE(manager_->Attach(big).ok());
  big.job = "dev2";
  absl::StatusOr<Attachment> over = manager_->Attach(big);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("--device_bytes"));

  AttachSpec unknown = Spec();
  unknown.job = "dev3";
  unknown.gpu_uuid = "GPU-other";
  EXPECT_EQ(manager_->Attach(unknown).status().code(), absl::StatusCode::kNotFound);
  AttachSpec none = Spec();
  none.job = "dev4";
  none.gpu_uuid.clear();
  absl::StatusOr<Attachment> no_uuid = manager_->Attach(none);
  EXPECT_EQ(no_uuid.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_uuid.status().message(), HasSubstr("delivery.gpu_uuid"));

  AttachSpec ok = Spec();
  ok.job = "dev5";
  absl::StatusOr<Attachment> a = manager_->Attach(ok);
  ASSERT_TRUE(a.ok()) << a.status();
  auto session = manager_->Find(a->session_id, a->token);
  absl::Status bad = (*session)->BindStream([] {}, {std::string(64, 'r')});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("want one per slot (2), got 1"));
}

TEST_F(DeviceSessionTest, EndingTheSessionFreesTheDeviceRing) {
  absl::StatusOr<Attachment> a = manager_->Attach(Spec());
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(devices_.log->RingsAlive(), 1);
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  while (devices_.log->RingsAlive() != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(devices_.log->RingsAlive(), 0);
}

TEST(DeviceSessionNoGpuTest, DeviceAttachWithoutGpuIsFailedPrecondition) {
  testing::TempDir dir;
  const std::string path = dir.WriteFile("t.bin", std::string(4002, '\1'));
  auto pool = StagingPool::Create(1 << 20, 1 << 20);
  ASSERT_TRUE(pool.ok());
  SessionManager manager(SessionManagerOptions{}, pool->get(), MappedFileSystem(), nullptr);
  AttachSpec spec;
  spec.job = "j";
  spec.feed.dataset.kind = DatasetKind::kTokens;
  spec.feed.dataset.path = path;
  spec.feed.dataset.token_dtype = DType::kUInt16;
  spec.feed.dataset.seq_len = 10;
  spec.feed.batch_size = 4;
  spec.feed.world_size = 1;
  spec.delivery = DeliveryKind::kDevice;
  spec.gpu_uuid = "GPU-x";
  absl::StatusOr<Attachment> a = manager.Attach(spec);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(), HasSubstr("no CUDA device visible to gpufeedd"));
}

}  // namespace
}  // namespace gpufeed::server
