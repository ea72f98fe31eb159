// The GPU image paths without a GPU: sessions stage batches (raw crop pixels, JPEG bytes or
// finished rows) and the fake backend runs the kernel's own per-pixel arithmetic on the CPU,
// decoding JPEG records with libjpeg-turbo in nvJPEG's place. Every staged batch must equal
// the CPU path's batch for the same (seed, epoch, id), byte for byte.
#include <fcntl.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/session/decode_share.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/fake_device_backend.h"
#include "tests/testing/image_files.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/wrapping_file_system.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::EncodePng;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::WriteFileBytes;
using ::testing::HasSubstr;


std::vector<PipelineStep> TrainPipeline(DType dtype, Layout layout) {
  std::vector<PipelineStep> p = {RandomResizedCropStep{24, {}}, FlipStep{0.5}};
  if (dtype != DType::kUInt8) {
    p.push_back(NormalizeStep{{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}});
  }
  p.push_back(CastStep{dtype});
  p.push_back(LayoutStep{layout});
  return p;
}

class StagedSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.path() + "/images";
    // JPEGs nvJPEG takes (4:2:0 and 4:4:4 baseline), and files it does not: grayscale and
    // PNG, decoded on the CPU and staged raw.
    WriteFileBytes(root_ + "/a/0.jpg", EncodeJpeg(Picture(48, 64, 3, 1), 48, 64, TJPF_RGB, TJSAMP_420, 90));
    WriteFileBytes(root_ + "/a/1.jpg", EncodeJpeg(Picture(80, 50, 3, 2), 80, 50, TJPF_RGB, TJSAMP_444, 95));
    WriteFileBytes(root_ + "/a/2.png", EncodePng(Picture(30, 20, 3, 3), 30, 20));
    WriteFileBytes(root_ + "/b/3.jpg", EncodeJpeg(Picture(40, 40, 1, 4), 40, 40, TJPF_GRAY, TJSAMP_GRAY));
    WriteFileBytes(root_ + "/b/4.jpg", EncodeJpeg(Picture(90, 120, 3, 5), 90, 120, TJPF_RGB, TJSAMP_420, 85));
    WriteFileBytes(root_ + "/b/5.jpg", EncodeJpeg(Picture(33, 77, 3, 6), 33, 77, TJPF_RGB, TJSAMP_422, 90));
    auto pool = StagingPool::Create(64 << 20, 64 << 20);
    ASSERT_TRUE(pool.ok());
    pool_ = std::move(*pool);
    StartManager(PosixFileSystem());
  }

  // (Re)starts manager_ reading through `fs`.
  void StartManager(FileSystem* fs) {
    manager_.reset();
    SessionManagerOptions options;
    options.threads = 2;
    // decode auto's adaptive CPU share (session/decode_share.h) on, paced by the test's clock:
    // fills take no time on it, and the consumer's pace is what the tests advance it by.
    options.adaptive_decode = true;
    options.clock = clock_.AsClock();
    options.feed_limits.counters = counters_;
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), fs, &devices_);
  }

  AttachSpec Spec(std::vector<PipelineStep> pipeline) {
    AttachSpec spec;
    spec.caller.admin = true;  // attach by path, as an admin (docs/SECURITY.md 2)
    spec.job = "img";
    spec.feed.dataset.kind = DatasetKind::kImageFolder;
    spec.feed.dataset.path = root_;
    spec.feed.dataset.pipeline = std::move(pipeline);
    spec.feed.batch_size = 3;
    spec.feed.world_size = 1;
    spec.feed.seed = 7;
    spec.ring_slots = 2;
    spec.stop_epoch = 2;
    spec.delivery = DeliveryKind::kDevice;
    spec.gpu_uuid = "GPU-fake";
    return spec;
  }

  StreamEvent Next(Session& s) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      StreamEvent e = s.NextEvent();
      if (e.kind != StreamEvent::kNothing) return e;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return {};
  }

  // Waits (up to 10 s) until both slots of the session's ring hold batches.
  static void WaitForFullRing(Session& s) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (s.Snapshot().slots_ready < 2 && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(200));
    }
  }

  // Consumes the whole stream of `spec` and checks every row of every batch against the CPU
  // path (ReadSampleAt) of the same sample and epoch; returns the batches seen.
  int ConsumeAndCompare(const AttachSpec& spec, const Attachment& a) {
    absl::StatusOr<std::unique_ptr<Dataset>> cpu = OpenDataset(spec.feed.dataset, PosixFileSystem());
    EXPECT_TRUE(cpu.ok()) << cpu.status();
    auto session = manager_->Find(a.session_id, a.token);
    EXPECT_TRUE(session.ok());
    EXPECT_TRUE((*session)->BindStream([] {}).ok());
    const TensorLayout& image = a.layout.tensors[0];
    const TensorLayout& label = a.layout.tensors[1];
    int batches = 0;
    while (true) {
      StreamEvent e = Next(**session);
      if (e.kind != StreamEvent::kBatch) {
        EXPECT_EQ(e.kind, StreamEvent::kEnd) << e.status;
        break;
      }
      ++batches;
      const std::byte* slot = devices_.last->slot_data(e.batch.slot);
      for (size_t i = 0; i < e.batch.ids.size(); ++i) {
        std::vector<std::byte> want(image.row_bytes);
        int64_t want_label = -1;
        const std::span<std::byte> rows[] = {
            want, {reinterpret_cast<std::byte*>(&want_label), sizeof(want_label)}};
        absl::StatusOr<uint64_t> used = (*cpu)->ReadSampleAt(
            static_cast<uint64_t>(e.batch.ids[i]), {spec.feed.seed, e.batch.position.epoch}, rows);
        EXPECT_TRUE(used.ok()) << used.status();
        EXPECT_EQ(static_cast<int64_t>(*used), e.batch.ids[i]);
        EXPECT_EQ(std::memcmp(slot + image.byte_offset + i * image.row_bytes, want.data(),
                              want.size()),
                  0)
            << "epoch " << e.batch.position.epoch << " step " << e.batch.position.step
            << " row " << i << " (sample " << e.batch.ids[i] << ")";
        int64_t got_label;
        std::memcpy(&got_label, slot + label.byte_offset + i * 8, 8);
        EXPECT_EQ(got_label, want_label) << "sample " << e.batch.ids[i];
      }
      EXPECT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
    }
    return batches;
  }

  testing::TempDir dir_;
  std::string root_;
  std::unique_ptr<StagingPool> pool_;
  // After the pool, before the manager: work still queued on its copy thread at teardown
  // returns rings to the pool.
  testing::FakeDeviceBackend devices_{uint64_t{1} << 30};
  testing::FakeClock clock_;  // outlives the manager
  // Where SetUp's manager's feeds record, as a daemon's do (a test's own manager records apart).
  const std::shared_ptr<metrics::Counters> counters_ = std::make_shared<metrics::Counters>();
  std::unique_ptr<SessionManager> manager_;
};

TEST_F(StagedSessionTest, CpuDecodeGpuAugmentEqualsTheCpuPathByteForByte) {
  for (const auto& [dtype, layout] : std::vector<std::pair<DType, Layout>>{
           {DType::kUInt8, Layout::kNHWC}, {DType::kFloat16, Layout::kNCHW},
           {DType::kBFloat16, Layout::kNHWC}, {DType::kFloat32, Layout::kNCHW}}) {
    AttachSpec spec = Spec(TrainPipeline(dtype, layout));
    spec.job = absl::StrCat("cpu-decode-", static_cast<int>(dtype));
    spec.decode = DecodeChoice::kCpu;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->stage, StageMode::kCpuDecode);
    EXPECT_EQ(ConsumeAndCompare(spec, *a), 4);  // 6 images, batch 3, 2 epochs
    EXPECT_EQ(devices_.last->raws.load(), 12);
    EXPECT_EQ(devices_.last->jpegs.load(), 0);
  }
}

TEST_F(StagedSessionTest, DctScaledCpuDecodeStagesTheScaledCrop) {
  // 240x320 JPEGs, crops resized to 24: most crops decode at 1/2 to 1/8 scale.
  std::filesystem::remove_all(root_);
  for (int i = 0; i < 6; ++i) {
    WriteFileBytes(absl::StrCat(root_, "/c", i % 2, "/", i, ".jpg"),
          EncodeJpeg(Picture(240, 320, 3, i), 240, 320, TJPF_RGB, TJSAMP_420, 90));
  }
  std::vector<PipelineStep> pipeline = TrainPipeline(DType::kFloat16, Layout::kNCHW);
  pipeline.insert(pipeline.begin(), DecodeStep{true});
  AttachSpec spec = Spec(pipeline);
  spec.decode = DecodeChoice::kCpu;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(ConsumeAndCompare(spec, *a), 4);
  EXPECT_EQ(devices_.last->raws.load(), 12);
}

TEST_F(StagedSessionTest, NvjpegPathStagesFilesItTakesAndDecodesTheRestOnTheCpu) {
  AttachSpec spec = Spec(TrainPipeline(DType::kFloat16, Layout::kNCHW));
  spec.decode = DecodeChoice::kNvjpeg;  // no adaptive share: every row nvJPEG takes
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->stage, StageMode::kNvjpeg);
  EXPECT_EQ(ConsumeAndCompare(spec, *a), 4);
  // Per epoch: 4 colour baseline JPEGs go to "nvJPEG"; the grayscale JPEG and the PNG do not.
  EXPECT_EQ(devices_.last->jpegs.load(), 8);
  EXPECT_EQ(devices_.last->raws.load(), 4);
  EXPECT_EQ(devices_.last->redone.load(), 0);
}

// decode auto without MPS (session/decode_share.h): a fill that takes under half the
// consumer's pace (the time between its releases) gives the CPU 1/32 more of the rows. On the
// test's clock fills take no time and the consumer releases every 100 ms.
TEST_F(StagedSessionTest, DecodeAutoShiftsRowsToTheCpuWhileFillsKeepUpWithTheConsumer) {
  AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  spec.stop_epoch = 0;  // no end
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->stage, StageMode::kNvjpeg);
  absl::StatusOr<std::shared_ptr<Session>> session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}).ok());
  // Waits until both slots hold batches, then takes one and releases it `pace` later.
  auto release_after = [&](absl::Duration pace) {
    WaitForFullRing(**session);
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
    clock_.Advance(pace);
    ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
  };
  // The pace is known from the second release on: the fills after releases 2..9 add 1/32 each.
  for (int i = 0; i < 9; ++i) release_after(absl::Milliseconds(100));
  WaitForFullRing(**session);
  EXPECT_DOUBLE_EQ((*session)->Snapshot().cpu_decode_share, 8.0 / 32);
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
}

TEST_F(StagedSessionTest, AnAutoDeviceRingOfStagedBatchesIs4DeepUnlessThatDoesNotFitNow) {
  // A device budget of 31 final slots (the fake charges slots x the final row layout's
  // stride, 8192 here).
  testing::FakeDeviceBackend thirty_one_slots{31 * 8192};
  DeviceBackend* in_use = &devices_;
  auto restart = [&](uint64_t slab_bytes, DeviceBackend* devices) {
    manager_.reset();
    // What the old sessions left queued on the copy thread runs before their pool goes.
    absl::Notification drained;
    in_use->Post("GPU-fake", [&drained] { drained.Notify(); });
    drained.WaitForNotification();
    in_use = devices;
    auto pool = StagingPool::Create(64 << 20, slab_bytes);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    SessionManagerOptions options;
    options.threads = 2;
    options.auto_ring_bytes = 1;  // the byte rule alone gives its floor, 2
    options.clock = clock_.AsClock();
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem(), devices);
  };
  restart(64 << 20, &devices_);
  AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  spec.ring_slots = 0;
  absl::StatusOr<Attachment> deep = manager_->Attach(spec);
  ASSERT_TRUE(deep.ok()) << deep.status();
  EXPECT_EQ(deep->ring_slots, 4);  // 4 x ~1.9 MiB for the one GPU: under half of 64 MiB
  auto deep_session = manager_->Find(deep->session_id, deep->token);
  ASSERT_TRUE(deep_session.ok());
  const uint64_t stride = (*deep_session)->ring_bytes() / 4;  // the staged slot, not the row's
  AttachSpec host = spec;  // host delivery stages nothing: the byte rule
  host.job = "host";
  host.delivery = DeliveryKind::kHost;
  host.gpu_uuid.clear();
  absl::StatusOr<Attachment> h = manager_->Attach(host);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->ring_slots, 2);
  ASSERT_EQ(h->layout.stride_bytes, 8192u);  // the final slot the fake's budget counts
  // Another session holds 28 slots of the pool and of the GPU's 31: the 4-slot try gets its
  // host ring but not its device ring, and 3 slots fit only once that host ring is back
  // (4 + 3 slots are more than the pool has left).
  restart(64 << 20, &thirty_one_slots);
  AttachSpec occupy = spec;
  occupy.job = "occupy";
  occupy.ring_slots = 28;
  absl::StatusOr<Attachment> occupied = manager_->Attach(occupy);
  ASSERT_TRUE(occupied.ok()) << occupied.status();
  const uint64_t left = pool_->free_bytes();
  ASSERT_GE(left, 4 * stride);
  ASSERT_LT(left, 7 * stride);
  absl::StatusOr<Attachment> three = manager_->Attach(spec);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->ring_slots, 3);
  EXPECT_EQ(pool_->free_bytes(), left - 3 * stride);
  ASSERT_TRUE(manager_->Detach(three->session_id, three->token).ok());
  ASSERT_TRUE(manager_->Detach(occupied->session_id, occupied->token).ok());
  // Slabs of 5 MiB: 4 and 3 slots (~7.5 and ~5.6 MiB) fit none, so the deep ring falls back
  // to the byte rule's 2...
  restart(5 << 20, &devices_);
  ASSERT_GT(3 * stride, uint64_t{5} << 20);
  ASSERT_LE(2 * stride, uint64_t{5} << 20);
  absl::StatusOr<Attachment> shallow = manager_->Attach(spec);
  ASSERT_TRUE(shallow.ok()) << shallow.status();
  EXPECT_EQ(shallow->ring_slots, 2);
  EXPECT_EQ(pool_->free_bytes(), pool_->total_bytes() - 2 * stride);
  ASSERT_TRUE(manager_->Find(shallow->session_id, shallow->token).ok());
  // ...and the rows it stages still equal the CPU path.
  AttachSpec check = spec;
  check.job = "check";
  absl::StatusOr<Attachment> c = manager_->Attach(check);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ring_slots, 2);
  EXPECT_EQ(ConsumeAndCompare(check, *c), 4);
  // An explicit depth is never changed: it is refused, naming the ring.
  AttachSpec explicit_four = spec;
  explicit_four.job = "explicit";
  explicit_four.ring_slots = 4;
  absl::StatusOr<Attachment> refused = manager_->Attach(explicit_four);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("ring of 4 slots x"));
}

TEST_F(StagedSessionTest, AUidsQuotaBoundsTheDeepAutoRingAndADeepTryPastItFallsBack) {
  // The staged slot's size, from an admin's ring of 2.
  absl::StatusOr<Attachment> probe =
      manager_->Attach(Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC)));
  ASSERT_TRUE(probe.ok()) << probe.status();
  auto probed = manager_->Find(probe->session_id, probe->token);
  ASSERT_TRUE(probed.ok());
  const uint64_t stride = (*probed)->ring_bytes() / 2;
  ASSERT_TRUE(manager_->Detach(probe->session_id, probe->token).ok());
  manager_.reset();
  absl::Notification drained;  // the probe's queued copy-thread work runs first
  devices_.Post("GPU-fake", [&drained] { drained.Notify(); });
  drained.WaitForNotification();
  // uid 1000 holds a ring of 6 slots; its quota leaves room for 4 more slots' staging, 40
  // bytes short of their sample ids (4 slots x 3 rows x 8 bytes = 96).
  const uint64_t ids = 3 * sizeof(int64_t);
  const uint64_t held = 6 * (stride + ids);
  SessionManagerOptions options;
  options.threads = 2;
  options.auto_ring_bytes = 1;  // the byte rule alone: 2 slots
  options.max_staging_bytes_per_uid = held + 4 * stride + 56;
  options.clock = clock_.AsClock();
  manager_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem(), &devices_);
  auto as_user = [&](const std::string& job, int32_t slots) {
    AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
    spec.job = job;
    spec.ring_slots = slots;
    spec.caller = Caller{};
    spec.caller.cred.uid = spec.caller.cred.gid = 1000;
    spec.caller.admin = false;
    UniqueFd fd(::open(root_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    absl::StatusOr<std::string> handle =
        manager_->AddDatasetHandle(std::move(fd), spec.caller.cred);
    EXPECT_TRUE(handle.ok()) << handle.status();
    if (handle.ok()) spec.feed.dataset.handle = *handle;
    return spec;
  };
  absl::StatusOr<Attachment> first = manager_->Attach(as_user("held", 6));
  ASSERT_TRUE(first.ok()) << first.status();
  auto first_session = manager_->Find(first->session_id, first->token);
  ASSERT_TRUE(first_session.ok());
  ASSERT_EQ((*first_session)->quota_bytes(), held);
  // 4 slots fit half the quota, so the room picks them; what is left of it holds their
  // staging but not with their ids, so the try falls back to 3 (checked where the ring is
  // allocated, not only where the session is inserted, which would refuse the Attach).
  absl::StatusOr<Attachment> deep = manager_->Attach(as_user("deep", 0));
  ASSERT_TRUE(deep.ok()) << deep.status();
  EXPECT_EQ(deep->ring_slots, 3);
  // Now even the byte rule's 2 slots pass the quota: refused, naming it.
  absl::StatusOr<Attachment> third = manager_->Attach(as_user("third", 0));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("max_staging_bytes_per_uid"));
}

TEST(DecodeShareTest, FillTimeAgainstThePaceMovesTheShareWithinItsBounds) {
  // A ring of 2: room under 0.5 of the pace, full over 0.8.
  DecodeShare share(2);
  share.Filled(absl::Milliseconds(1), absl::ZeroDuration());  // the pace not known yet
  EXPECT_EQ(share.share(), 0);
  share.Filled(absl::Milliseconds(90), absl::Milliseconds(100));  // busy: never below 0
  EXPECT_EQ(share.share(), 0);
  for (int i = 0; i < 40; ++i) share.Filled(absl::Milliseconds(49), absl::Milliseconds(100));
  EXPECT_EQ(share.share(), 1);                                    // never above 1
  share.Filled(absl::Milliseconds(50), absl::Milliseconds(100));  // between 0.5 and 0.8: hold
  share.Filled(absl::Milliseconds(80), absl::Milliseconds(100));
  EXPECT_EQ(share.share(), 1);
  share.Filled(absl::Milliseconds(81), absl::Milliseconds(100));
  EXPECT_DOUBLE_EQ(share.share(), 7.0 / 8);
  // A ring of 3 or more runs fills that far ahead: room under 0.85, full over 0.97.
  for (const int slots : {3, 4, 16}) {
    DecodeShare deep(slots);
    deep.Filled(absl::Milliseconds(84), absl::Milliseconds(100));  // would shrink with 2 slots
    EXPECT_DOUBLE_EQ(deep.share(), 1.0 / 32) << slots;
    deep.Filled(absl::Milliseconds(85), absl::Milliseconds(100));  // between: hold
    deep.Filled(absl::Milliseconds(97), absl::Milliseconds(100));  // would shrink with 2 slots
    EXPECT_DOUBLE_EQ(deep.share(), 1.0 / 32) << slots;
    deep.Filled(absl::Milliseconds(98), absl::Milliseconds(100));
    EXPECT_EQ(deep.share(), 0) << slots;
  }
  ReleasePace pace;
  EXPECT_EQ(pace.period(), absl::ZeroDuration());
  const absl::Time t = absl::FromUnixSeconds(1000);
  pace.Released(t);
  EXPECT_EQ(pace.period(), absl::ZeroDuration());  // one release: no gap yet
  pace.Released(t + absl::Milliseconds(100));
  EXPECT_EQ(pace.period(), absl::Milliseconds(100));
  pace.Released(t + absl::Milliseconds(150));  // a 50 ms gap weighs 1/5
  EXPECT_EQ(pace.period(), absl::Milliseconds(90));
}

TEST_F(StagedSessionTest, AFullShareDecodesEveryRowOnTheCpuAndEqualsTheCpuPath) {
  AttachSpec spec = Spec(TrainPipeline(DType::kFloat16, Layout::kNCHW));
  spec.stop_epoch = 60;  // 120 batches: the share reaches 1 after 33 releases
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  auto session = manager_->Find(a->session_id, a->token);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE((*session)->BindStream([] {}).ok());
  int64_t jpegs_at_full = -1, raws_at_full = -1;
  for (int b = 0; b < 120; ++b) {
    if (b < 119) WaitForFullRing(**session);
    if (jpegs_at_full < 0 && (*session)->Snapshot().cpu_decode_share == 1.0) {
      jpegs_at_full = devices_.last->jpegs.load();
      raws_at_full = devices_.last->raws.load();
    }
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
    clock_.Advance(absl::Milliseconds(100));
    ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
  }
  ASSERT_GE(jpegs_at_full, 0) << "the share never reached 1";
  // The two batches in the ring then (33 and 34) were staged, and counted, at lower shares;
  // the 85 after them have no JPEG record: the CPU decoded all their rows.
  EXPECT_EQ(devices_.last->jpegs.load() - jpegs_at_full, 0);
  EXPECT_EQ(devices_.last->raws.load() - raws_at_full, 85 * 3);
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  // Whichever decoder made a row, it equals the CPU path (a fresh job, shares from 0 up).
  AttachSpec check = Spec(TrainPipeline(DType::kFloat16, Layout::kNCHW));
  check.job = "check";
  absl::StatusOr<Attachment> c = manager_->Attach(check);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(ConsumeAndCompare(check, *c), 4);
}

TEST_F(StagedSessionTest, AnAdaptiveShareUnderMpsTooButNoneForAnExplicitNvjpeg) {
  for (const bool mps : {true, false}) {
    devices_.mps = mps;
    AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
    spec.job = absl::StrCat("fixed-", mps);
    // Under MPS decode auto adapts as without it (the CPU decoder costs training less than
    // nvJPEG there too: docs/benchmarks.md, Adaptive decode); an explicit nvjpeg never does.
    spec.decode = mps ? DecodeChoice::kAuto : DecodeChoice::kNvjpeg;
    spec.stop_epoch = 20;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    ASSERT_TRUE(a.ok()) << a.status();
    auto session = manager_->Find(a->session_id, a->token);
    ASSERT_TRUE((*session)->BindStream([] {}).ok());
    for (int b = 0; b < 40; ++b) {
      if (b < 39) WaitForFullRing(**session);
      StreamEvent e = Next(**session);
      ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
      clock_.Advance(absl::Milliseconds(100));  // a pace the adaptive share acts on
      ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
    }
    if (mps) {
      // Fills take no time on the test's clock: 1/32 more after each of releases 2..39's fills.
      EXPECT_GT((*session)->Snapshot().cpu_decode_share, 0.5) << "MPS";
      // Some of the 80 nvJPEG-able rows (4 of 6 images a batch, 20 epochs) went to the CPU.
      EXPECT_LT(devices_.last->jpegs.load(), 80) << "MPS";
    } else {
      EXPECT_EQ((*session)->Snapshot().cpu_decode_share, 0.0) << "decode nvjpeg";
      // 4 colour baseline JPEGs of the 6 images per epoch, 20 epochs: all to "nvJPEG".
      EXPECT_EQ(devices_.last->jpegs.load(), 80) << "decode nvjpeg";
    }
    ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  }
  devices_.mps = false;
}

// --nocheapest_cpu_rows: in every batch decode auto's CPU rows are those CpuDecodesRow picks
// at the fill's share, by index. With the default, once the session has recorded 64 rows'
// estimates, some batches' CPU rows differ from that rule: they follow the crop boxes' costs.
TEST_F(StagedSessionTest, CheapestCpuRowsOffSpreadsTheCpuRowsByIndex) {
  const std::string root = dir_.path() + "/many";
  for (int i = 0; i < 32; ++i) {  // colour baseline JPEGs of varied sizes: nvJPEG takes any
    const int h = 40 + (i * 7) % 50, w = 40 + (i * 11) % 60;
    WriteFileBytes(absl::StrCat(root, "/c/", i, ".jpg"),
                   EncodeJpeg(Picture(h, w, 3, 100 + i), h, w, TJPF_RGB, TJSAMP_420, 90));
  }
  for (const bool cheapest : {false, true}) {
    SCOPED_TRACE(cheapest ? "cheapest_cpu_rows" : "nocheapest_cpu_rows");
    SessionManagerOptions options;
    options.threads = 2;
    options.adaptive_decode = true;
    options.cheapest_cpu_rows = cheapest;
    options.clock = clock_.AsClock();
    manager_.reset();
    manager_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem(), &devices_);
    absl::Mutex mu;
    std::vector<std::vector<StagedKind>> fills;  // each staged batch's rows' kinds, in order
    devices_.before_stage = [&](std::byte* host, const StagedLayout& layout) {
      const auto* records = reinterpret_cast<const StagedRecord*>(host + layout.records_offset);
      std::vector<StagedKind> kinds;
      for (int64_t r = 0; r < layout.batch; ++r) kinds.push_back(records[r].kind);
      absl::MutexLock lock(&mu);
      fills.push_back(std::move(kinds));
    };
    AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
    spec.job = absl::StrCat("rows-", cheapest);
    spec.feed.dataset.path = root;
    spec.feed.batch_size = 8;
    spec.stop_epoch = 0;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(a->stage, StageMode::kNvjpeg);
    auto session = manager_->Find(a->session_id, a->token);
    ASSERT_TRUE(session.ok());
    ASSERT_TRUE((*session)->BindStream([] {}).ok());
    int by_index = 0, by_cost = 0;
    for (int b = 0; b < 30; ++b) {
      // With both slots full no fill runs: the share now is the one the fill this release
      // starts reads (DecodeShare moves when a fill ends, before its slot is ready).
      WaitForFullRing(**session);
      const double share = (*session)->Snapshot().cpu_decode_share;
      size_t seen;
      {
        absl::MutexLock lock(&mu);
        seen = fills.size();
      }
      StreamEvent e = Next(**session);
      ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
      clock_.Advance(absl::Milliseconds(100));  // a pace the share grows at (fills take 0)
      ASSERT_TRUE((*session)->Release(e.batch.slot, e.batch.generation).ok());
      WaitForFullRing(**session);
      std::vector<StagedKind> kinds;
      {
        absl::MutexLock lock(&mu);
        ASSERT_EQ(fills.size(), seen + 1);
        kinds = fills.back();
      }
      if (share <= 0 || share >= 1) continue;
      bool index_rule = true;
      for (size_t r = 0; r < kinds.size(); ++r) {
        ASSERT_NE(kinds[r], StagedKind::kFinal) << "row " << r << " did not fit the arena";
        index_rule &=
            (kinds[r] == StagedKind::kRaw) == CpuDecodesRow(static_cast<int64_t>(r), share);
      }
      ++(index_rule ? by_index : by_cost);
    }
    if (cheapest) {
      EXPECT_GT(by_cost, 0) << "the CPU's rows never followed the estimated costs";
    } else {
      EXPECT_EQ(by_cost, 0);
      EXPECT_GE(by_index, 20);  // the share is in (0, 1) from the third release on
    }
    ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
    manager_.reset();  // its rings go while `fills` and `mu` are alive
    devices_.before_stage = nullptr;
  }
}

TEST(DecodeShareTest, CpuRowsSpreadEvenlyOverTheBatch) {
  auto cpu_rows = [](double share, int batch) {
    std::vector<int> rows;
    for (int r = 0; r < batch; ++r) {
      if (CpuDecodesRow(r, share)) rows.push_back(r);
    }
    return rows;
  };
  EXPECT_TRUE(cpu_rows(0, 8).empty());
  EXPECT_EQ(cpu_rows(1, 4), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(cpu_rows(0.25, 8), (std::vector<int>{3, 7}));
  EXPECT_EQ(cpu_rows(0.5, 6), (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(cpu_rows(0.75, 4), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(cpu_rows(0.3, 256).size(), 76u);  // floor(256 * 0.3)
}

TEST_F(StagedSessionTest, ResizeThenCentreCropAndPaddedCentreCropOnTheGpuPath) {
  AttachSpec spec = Spec({ResizeStep{20}, CenterCropStep{18}, FlipStep{0.5},
                          CastStep{DType::kUInt8}, LayoutStep{Layout::kNCHW}});
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(ConsumeAndCompare(spec, *a), 4);
  // A centre crop of 36 without a resize: the 30x20 and 33x77 images are zero-padded.
  AttachSpec pad = Spec({CenterCropStep{36}, FlipStep{0.5}, CastStep{DType::kFloat32}});
  pad.job = "pad";
  a = manager_->Attach(pad);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(ConsumeAndCompare(pad, *a), 4);
}

TEST_F(StagedSessionTest, ImagesBeyondTheArenaAreFinishedOnTheCpu) {
  // Two 600x600 images: staged whole (resize then crop), each 1.08 MB raw, beyond the arena
  // of 2 x 640 KiB for both: the first fits, the second is finished on the CPU.
  std::filesystem::remove_all(root_);
  WriteFileBytes(root_ + "/a/0.png", EncodePng(Picture(600, 600, 3, 1), 600, 600));
  WriteFileBytes(root_ + "/a/1.png", EncodePng(Picture(600, 600, 3, 2), 600, 600));
  AttachSpec spec = Spec({ResizeStep{40}, CenterCropStep{32}, CastStep{DType::kUInt8}});
  spec.feed.batch_size = 2;
  spec.stop_epoch = 1;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(ConsumeAndCompare(spec, *a), 1);
  EXPECT_EQ(devices_.last->raws.load(), 1);
  EXPECT_EQ(devices_.last->finals.load(), 1);
}

TEST_F(StagedSessionTest, RowsNvjpegRefusesAreRedoneOnTheCpu) {
  devices_.refuse_jpeg = true;
  AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(ConsumeAndCompare(spec, *a), 4);
  EXPECT_EQ(devices_.last->redone.load(), 8);
  // gpufeed_decodes_total counts each image once, by the decoder that made it: the 8 refused
  // rows as the CPU's, as the 4 it took from the start (the comparison's own reads are its
  // dataset's, not the manager's).
  EXPECT_EQ(counters_->decodes(metrics::Decoder::kNvjpeg), 0u);
  EXPECT_EQ(
      counters_->decodes(metrics::Decoder::kCpu) + counters_->decodes(metrics::Decoder::kCpuRegion),
      12u);
}

// Counts the reads that reach the files (any file, any thread).
class CountingFileSystem final : public testing::WrappingFileSystem {
 public:
  CountingFileSystem() : WrappingFileSystem(PosixFileSystem()) {}
  int reads() const { return reads_.load(); }

 private:
  void OnRead(const RandomAccessFile&, uint64_t, std::span<std::byte>) override { ++reads_; }
  std::atomic<int> reads_{0};
};

// A session detached while nvJPEG works on its batch: the rows it refuses are not read and
// decoded again on the CPU for nobody (CopyOne's rule for a closed session), and the
// session's rings go back to the pool.
TEST_F(StagedSessionTest, RowsRefusedAfterTheSessionClosedAreNotRedone) {
  CountingFileSystem fs;
  StartManager(&fs);
  devices_.refuse_jpeg = true;
  absl::Notification staging, detached;
  devices_.before_stage = [&](std::byte*, const StagedLayout&) {
    staging.Notify();
    detached.WaitForNotification();
  };
  const uint64_t free_before = pool_->free_bytes();
  AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  spec.feed.batch_size = 6;  // the whole folder: one batch, one fill, its 4 JPEGs refused
  spec.stop_epoch = 1;
  absl::StatusOr<Attachment> a = manager_->Attach(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->stage, StageMode::kNvjpeg);
  ASSERT_TRUE(staging.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const int reads = fs.reads();
  EXPECT_GT(reads, 0);  // the fill read its files (a redo would read the 4 JPEGs again)
  ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
  detached.Notify();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (pool_->free_bytes() != free_before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(pool_->free_bytes(), free_before);
  // The counts, not the ring: it went back with the session's rings (ASan saw it freed).
  EXPECT_EQ(devices_.last_counts->jpegs.load(), 4);
  EXPECT_EQ(fs.reads(), reads);
  EXPECT_EQ(devices_.last_counts->redone.load(), 0);
  manager_.reset();  // before fs and the hook's notifications
}

TEST_F(StagedSessionTest, ACorruptJpegFoundOnTheGpuFollowsTheBadSamplePolicy) {
  // A colour baseline JPEG whose header is fine and which ends in EOI, but whose scan is
  // garbage: only decoding finds out, on the "GPU"; the CPU redo then applies the policy.
  std::vector<uint8_t> bad = EncodeJpeg(Picture(64, 64, 3, 9), 64, 64, TJPF_RGB, TJSAMP_420, 90);
  for (size_t i = bad.size() / 2; i < bad.size() - 2; ++i) bad[i] = 0xFF;
  WriteFileBytes(root_ + "/a/0.jpg", bad);

  AttachSpec fail = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  fail.job = "fail";
  fail.feed.shuffle = false;
  fail.feed.dataset.bad_sample = BadSamplePolicy::kFail;
  absl::StatusOr<Attachment> a = manager_->Attach(fail);
  ASSERT_TRUE(a.ok()) << a.status();
  auto session = manager_->Find(a->session_id, a->token);
  (void)(*session)->BindStream([] {});  // the session may have ended already
  StreamEvent e = Next(**session);
  ASSERT_EQ(e.kind, StreamEvent::kClosed);
  EXPECT_EQ(e.status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(e.status.message(), HasSubstr(root_ + "/a/0.jpg"));

  AttachSpec skip = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  skip.job = "skip";
  skip.feed.shuffle = false;
  skip.stop_epoch = 1;
  absl::StatusOr<Attachment> b = manager_->Attach(skip);
  ASSERT_TRUE(b.ok()) << b.status();
  session = manager_->Find(b->session_id, b->token);
  ASSERT_TRUE((*session)->BindStream([] {}).ok());
  e = Next(**session);
  ASSERT_EQ(e.kind, StreamEvent::kBatch) << e.status;
  EXPECT_EQ(e.batch.ids, (std::vector<int64_t>{1, 1, 2}));  // sample 0 replaced by sample 1
  int64_t labels[3];
  std::memcpy(labels, devices_.last->slot_data(e.batch.slot) + b->layout.tensors[1].byte_offset, 24);
  EXPECT_EQ(labels[0], 0);  // sample 1's label (class a)
}

// docs/SECURITY.md section 3: a staged slot whose record points outside the slot (however
// it got there) ends the session with a clean error before the device acts on it; the ring's
// staging goes back to the pool.
TEST_F(StagedSessionTest, ACorruptedStagedSlotEndsTheSessionWithACleanError) {
  const uint64_t free_before = pool_->free_bytes();
  devices_.before_stage = [](std::byte* host, const StagedLayout& layout) {
    auto* records = reinterpret_cast<StagedRecord*>(host + layout.records_offset);
    records[1].host_offset = layout.arena_bytes - 1;  // its bytes run past the arena's end
  };
  for (StageMode mode : {StageMode::kCpuDecode, StageMode::kNvjpeg}) {
    AttachSpec spec = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
    spec.job = absl::StrCat("corrupt-", static_cast<int>(mode));
    spec.decode = mode == StageMode::kCpuDecode ? DecodeChoice::kCpu : DecodeChoice::kAuto;
    absl::StatusOr<Attachment> a = manager_->Attach(spec);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->stage, mode);
    auto session = manager_->Find(a->session_id, a->token);
    ASSERT_TRUE(session.ok());
    (void)(*session)->BindStream([] {});  // the session may have ended already
    StreamEvent e = Next(**session);
    ASSERT_EQ(e.kind, StreamEvent::kClosed) << "a batch from a corrupted slot was delivered";
    EXPECT_EQ(e.status.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(e.status.message(), HasSubstr("staged batch row 1: "));
    EXPECT_THAT(e.status.message(), HasSubstr("outside the slot's arena"));
    ASSERT_TRUE(manager_->Detach(a->session_id, a->token).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (pool_->free_bytes() != free_before && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_EQ(pool_->free_bytes(), free_before);
  }
}

TEST_F(StagedSessionTest, DecodeAndAugmentChoicesAreCheckedAtAttach) {
  AttachSpec host = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  host.delivery = DeliveryKind::kHost;
  host.augment = AugmentChoice::kGpu;
  absl::StatusOr<Attachment> a = manager_->Attach(host);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("augment: gpu"));
  host.augment = AugmentChoice::kAuto;
  host.decode = DecodeChoice::kNvjpeg;
  a = manager_->Attach(host);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("decode: nvjpeg"));
  host.decode = DecodeChoice::kAuto;
  a = manager_->Attach(host);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->stage, StageMode::kNone);

  AttachSpec mixed = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  mixed.job = "mixed";
  mixed.augment = AugmentChoice::kCpu;
  mixed.decode = DecodeChoice::kNvjpeg;
  a = manager_->Attach(mixed);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("augment gpu"));
  mixed.decode = DecodeChoice::kAuto;
  a = manager_->Attach(mixed);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->stage, StageMode::kNone);  // augment cpu: finished rows, copied

  devices_.nvjpeg = false;
  AttachSpec nv = Spec(TrainPipeline(DType::kUInt8, Layout::kNHWC));
  nv.job = "nv";
  nv.decode = DecodeChoice::kNvjpeg;
  a = manager_->Attach(nv);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(), HasSubstr("nvJPEG is not available"));
  nv.decode = DecodeChoice::kAuto;
  a = manager_->Attach(nv);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->stage, StageMode::kCpuDecode);  // auto falls back to the CPU decoder

  AttachSpec tokens = Spec({});
  tokens.job = "tokens";
  tokens.feed.dataset = {};
  tokens.feed.dataset.kind = DatasetKind::kTokens;
  tokens.feed.dataset.path = dir_.WriteFile("t.bin", std::string(200, 'x'));
  tokens.feed.dataset.token_dtype = DType::kUInt16;
  tokens.feed.dataset.seq_len = 4;
  tokens.decode = DecodeChoice::kCpu;
  a = manager_->Attach(tokens);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("only image datasets"));
}

}  // namespace
}  // namespace gpufeed::server
