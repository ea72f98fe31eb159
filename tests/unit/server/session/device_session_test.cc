// The device-delivery flow of a session, without a GPU: a fake backend stands for CUDA.
#include <algorithm>
#include <cstring>

#include "absl/time/clock.h"
#include "common/os/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/fake_device_backend.h"
#include "tests/testing/npy_builder.h"
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
    spec.caller.admin = true;  // attach by path, as an admin (docs/SECURITY.md 2)
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

  // Whether the "device" slot holds the file's tokens of every row of `ids`, byte for byte:
  // token k = k, and sample n is tokens [10 n, 10 n + 11).
  static bool SlotHoldsTokensOf(const std::byte* slot, const TensorLayout& tokens,
                                const std::vector<int64_t>& ids) {
    std::vector<uint16_t> want;
    for (int64_t id : ids) {
      for (int j = 0; j < 11; ++j) want.push_back(static_cast<uint16_t>(id * 10 + j));
    }
    return want.size() * 2 == tokens.byte_size &&
           std::memcmp(slot + tokens.byte_offset, want.data(), tokens.byte_size) == 0;
  }

  testing::TempDir dir_;
  std::string path_;
  std::unique_ptr<StagingPool> pool_;
  // After the pool, before the manager: work still queued on its copy thread at teardown
  // returns rings to the pool.
  testing::FakeDeviceBackend devices_{1 << 20};
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
  // One tensor: 4 rows of seq_len + 1 = 11 uint16 tokens.
  ASSERT_EQ(a->layout.tensors.size(), 1u);
  const TensorLayout& tokens = a->layout.tensors[0];
  ASSERT_EQ(tokens.shape, (std::vector<int64_t>{4, 11}));
  ASSERT_EQ(tokens.byte_size, 4u * 11 * 2);
  for (int step = 0; step < 4; ++step) {
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << "step " << step;
    EXPECT_EQ(e.batch.position.step, step);
    EXPECT_EQ(e.batch.ids, (std::vector<int64_t>{step * 4, step * 4 + 1, step * 4 + 2, step * 4 + 3}));
    EXPECT_TRUE(SlotHoldsTokensOf(devices_.last->slot_data(e.batch.slot), tokens, e.batch.ids))
        << "step " << step;
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

// Records of several arrays: every tensor lands in the device slot at its layout's
// offset, row i of each array for sample i.
TEST_F(DeviceSessionTest, RecordsOfSeveralArraysLandAtEachTensorsOffset) {
  std::string x, y;  // x: uint16 [20, 3], value 3k + j; y: int64 [20], value 1000 + k
  for (uint16_t k = 0; k < 20; ++k) {
    for (uint16_t j = 0; j < 3; ++j) {
      const uint16_t v = static_cast<uint16_t>(3 * k + j);
      x.append(reinterpret_cast<const char*>(&v), 2);
    }
    const int64_t v = 1000 + k;
    y.append(reinterpret_cast<const char*>(&v), 8);
  }
  dir_.WriteFile("x.npy", testing::NpyFile("<u2", "(20, 3)", x));
  dir_.WriteFile("y.npy", testing::NpyFile("<i8", "(20,)", y));
  AttachSpec spec = Spec();
  spec.feed.dataset = {};
  spec.feed.dataset.kind = DatasetKind::kRecords;
  spec.feed.dataset.path = dir_.path();
  spec.feed.dataset.arrays = {{"x", "x.npy"}, {"y", "y.npy"}};
  spec.feed.shuffle = true;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->layout.tensors.size(), 2u);
  const TensorLayout& tx = a->layout.tensors[0];
  const TensorLayout& ty = a->layout.tensors[1];
  EXPECT_EQ(tx.name, "x");
  EXPECT_EQ(ty.name, "y");
  EXPECT_EQ(ty.byte_offset % 256, 0u);
  EXPECT_GE(ty.byte_offset, tx.byte_offset + tx.byte_size);
  auto session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}, {std::string(64, 'r'), std::string(64, 'r')}).ok());
  for (int step = 0; step < 5; ++step) {
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << "step " << step;
    const std::byte* slot = devices_.last->slot_data(e.batch.slot);
    for (size_t r = 0; r < e.batch.ids.size(); ++r) {
      const int64_t id = e.batch.ids[r];
      EXPECT_EQ(std::memcmp(slot + tx.byte_offset + r * 6, x.data() + id * 6, 6), 0) << id;
      EXPECT_EQ(std::memcmp(slot + ty.byte_offset + r * 8, y.data() + id * 8, 8), 0) << id;
    }
    ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
  }
}

// docs/SECURITY.md section 3: a device session stages in the daemon's private slabs (counted
// against the same budget), which are never handed out.
TEST_F(DeviceSessionTest, HostStagingOfADeviceSessionStaysInThePrivateSlabs) {
  const uint64_t free_before = pool_->free_bytes();
  absl::StatusOr<Attachment> a = manager_->Attach(Spec());
  ASSERT_TRUE(a.ok()) << a.status();
  auto session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  EXPECT_EQ(pool_->free_bytes(), free_before - (*session)->ring_bytes());
  absl::StatusOr<UniqueFd> fd = (*session)->ShareRingFd();
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fd.status().message(), HasSubstr("never handed out"));
}

// A consumer whose GPU still reads slot 0 (its release event not yet complete): the copy
// thread polls and writes the slot again only once the event completes, and meanwhile another
// session on the same GPU gets its batches. Before, the GPU's one stream waited for the
// event, and every session behind it.
TEST_F(DeviceSessionTest, AHeldSlotWaitsForItsReleaseEventWithoutStallingOtherSessions) {
  absl::StatusOr<Attachment> a = manager_->Attach(Spec());
  ASSERT_TRUE(a.ok()) << a.status();
  testing::FakeDeviceRing* ring_a = devices_.last;
  AttachSpec other = Spec();
  other.job = "dev2";
  absl::StatusOr<Attachment> b = manager_->Attach(other);
  ASSERT_TRUE(b.ok()) << b.status();
  auto session_a = manager_->Find(a->session_id, a->token);
  auto session_b = manager_->Find(b->session_id, b->token);
  ASSERT_TRUE(session_a.ok() && session_b.ok());
  const std::vector<std::string> events(2, std::string(64, 'r'));
  ASSERT_TRUE((*session_a)->BindStream([] {}, events).ok());
  ASSERT_TRUE((*session_b)->BindStream([] {}, events).ok());

  StreamEvent first = Next(**session_a);
  StreamEvent second = Next(**session_a);
  ASSERT_EQ(first.kind, StreamEvent::kBatch);
  ASSERT_EQ(second.kind, StreamEvent::kBatch);
  ring_a->Hold(first.batch.slot, true);
  ASSERT_TRUE((*session_a)->Release(first.batch.slot, first.batch.generation).ok());

  for (int step = 0; step < 10; ++step) {
    StreamEvent e = Next(**session_b);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << "step " << step;
    EXPECT_EQ(e.batch.position.step, step);
    ASSERT_TRUE((*session_b)->Release(e.batch.slot, e.batch.generation).ok());
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (ring_a->PollsWhileHeld() < 3 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_GE(ring_a->PollsWhileHeld(), 3);
  // Not rewritten while held: still batch 0's tokens, and no batch 2 yet.
  const TensorLayout& tokens = a->layout.tensors.at(0);
  EXPECT_TRUE(SlotHoldsTokensOf(ring_a->slot_data(first.batch.slot), tokens, first.batch.ids));
  EXPECT_EQ((*session_a)->NextEvent().kind, StreamEvent::kNothing);

  ring_a->Hold(first.batch.slot, false);
  StreamEvent third = Next(**session_a);
  ASSERT_EQ(third.kind, StreamEvent::kBatch);
  EXPECT_EQ(third.batch.position.step, 2);
  EXPECT_EQ(third.batch.slot, first.batch.slot);
  EXPECT_EQ(third.batch.ids, (std::vector<int64_t>{8, 9, 10, 11}));
  EXPECT_TRUE(SlotHoldsTokensOf(ring_a->slot_data(third.batch.slot), tokens, third.batch.ids));
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
  spec.caller.admin = true;  // attach by path, as an admin (docs/SECURITY.md 2)
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


// idle_lease_timeout is for host rings: a device session's GPU may legitimately hold every
// slot (docs/SECURITY.md section 4), so one holding both of its slots is never ended.
TEST_F(DeviceSessionTest, DeviceSessionsAreExemptFromTheIdleLeaseTimeout) {
  manager_.reset();
  SessionManagerOptions options;
  options.threads = 2;
  options.idle_lease_timeout = absl::Milliseconds(50);
  options.reap_interval = absl::Milliseconds(5);
  manager_ = std::make_unique<SessionManager>(options, pool_.get(), MappedFileSystem(), &devices_);
  absl::StatusOr<Attachment> a = manager_->Attach(Spec());
  ASSERT_TRUE(a.ok()) << a.status();
  auto session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}).ok());
  ASSERT_EQ(Next(**session).kind, StreamEvent::kBatch);
  ASSERT_EQ(Next(**session).kind, StreamEvent::kBatch);
  const absl::Time full_since = (*session)->all_leased_since();
  ASSERT_NE(full_since, absl::InfiniteFuture());
  // Eight timeouts and many reaper rounds later: still open.
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_FALSE((*session)->closed());
  EXPECT_TRUE(manager_->Find(a->session_id, a->token).ok());
}

}  // namespace
}  // namespace gpufeed::server
