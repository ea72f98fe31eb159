// GPU tests (ctest label `gpu`): device delivery against the real daemon on a real GPU. Each
// test skips, saying so, where this process sees no CUDA device. Run on the GPU machine by
// .ci/device/run_on_device.sh.
#include <cuda_runtime_api.h>
#include <signal.h>

#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/cuda/cuda.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"

namespace gpufeed::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSeqLen = 64;
constexpr size_t kTokens = 1 << 20;  // (2^20 - 1) / 64 = 16383 samples

bool HaveGpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

class DeviceDeliveryTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped";
    tokens_path_ = dir_.Join("tokens.bin");
    tokens_ = WriteTokens(tokens_path_, kTokens);
    daemon_ = std::make_unique<Daemon>(dir_);
    ASSERT_TRUE(daemon_->ready()) << daemon_->process().Stderr();
  }

  std::vector<std::string> Consume(std::vector<std::string> extra) {
    std::vector<std::string> args = {"consume", "--dataset", tokens_path_, "--seq-len",
                                     absl::StrCat(kSeqLen), "--ipc", GetParam()};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  TempDir dir_;
  std::string tokens_path_;
  std::vector<uint16_t> tokens_;
  std::unique_ptr<Daemon> daemon_;
};

INSTANTIATE_TEST_SUITE_P(Ipc, DeviceDeliveryTest, ::testing::Values("vmm", "legacy"));

// 2 consumer processes x 2 epochs into GPU memory: exactly-once ids, and each rank's device
// checksum (computed after copying each batch back) equals the one computed here from the
// file, and equals host delivery's for the same feed.
TEST_P(DeviceDeliveryTest, TwoConsumersTwoEpochsByteExactInDeviceMemory) {
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<Subprocess>(
        CtlArgv(daemon_->socket(),
                Consume({"--job", "dev", "--rank", absl::StrCat(r), "--world-size", "2",
                         "--batch-size", "32", "--seed", "5", "--epochs", "2", "--device",
                         "cuda:0", "--checksum", "--ids", dir_.Join(absl::StrCat("ids", r)),
                         "-o", "json"})),
        dir_.Join(absl::StrCat("rank", r))));
  }
  std::map<int64_t, std::vector<int64_t>> by_epoch;
  uint64_t device_sum = 0;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranks[r]->Wait(absl::Seconds(120)), 0) << ranks[r]->Stderr();
    const std::vector<IdsLine> lines = ReadIdsFile(dir_.Join(absl::StrCat("ids", r)));
    ASSERT_EQ(lines.size(), 2u * (16383 / 64));
    for (const IdsLine& l : lines) {
      auto& ids = by_epoch[l.epoch];
      ids.insert(ids.end(), l.ids.begin(), l.ids.end());
    }
    const uint64_t sum = static_cast<uint64_t>(JsonInt(ranks[r]->Stdout(), "checksum"));
    EXPECT_EQ(sum, TokensChecksum(tokens_, kSeqLen, lines)) << "rank " << r;
    device_sum += sum;
  }
  for (auto& [epoch, ids] : by_epoch) {
    std::set<int64_t> unique(ids.begin(), ids.end());
    EXPECT_EQ(unique.size(), ids.size()) << "epoch " << epoch;
    EXPECT_EQ(ids.size(), static_cast<size_t>(16383 / 64 * 64));
  }
  // The same feed by host delivery.
  uint64_t host_sum = 0;
  for (int r = 0; r < 2; ++r) {
    CtlResult host = RunCtl(daemon_->socket(),
                            Consume({"--job", "host", "--rank", absl::StrCat(r), "--world-size",
                                     "2", "--batch-size", "32", "--seed", "5", "--epochs", "2",
                                     "--checksum", "-o", "json"}),
                            dir_.Join("host"));
    ASSERT_EQ(host.exit_code, 0) << host.err;
    host_sum += static_cast<uint64_t>(JsonInt(host.out, "checksum"));
  }
  EXPECT_EQ(device_sum, host_sum);
}

// The C++ client: tensors are device pointers on cuda:0 and hold the file's bytes.
TEST_P(DeviceDeliveryTest, CppClientDevicePointersHoldTheFileBytes) {
  client::AttachOptions o;
  o.socket = daemon_->socket();
  o.job = "cpp";
  o.dataset = tokens_path_;
  o.seq_len = kSeqLen;
  o.batch_size = 16;
  o.delivery = "device";
  o.gpu = "cuda:0";
  o.ipc = GetParam();
  o.stop_epoch = 1;
  auto session = client::Session::Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE((*session)->info().device);
  EXPECT_EQ((*session)->info().ipc, GetParam());
  cudaSetDevice(0);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<uint16_t> host(16 * (kSeqLen + 1));
  int batches = 0;
  while (true) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(30));
    if (absl::IsOutOfRange(batch.status())) break;
    ASSERT_TRUE(batch.ok()) << batch.status();
    const client::Tensor* t = batch->tensor("tokens");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->device, 0);
    cudaPointerAttributes attr{};
    ASSERT_EQ(cudaPointerGetAttributes(&attr, t->data), cudaSuccess);
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice);
    ASSERT_TRUE(batch->WaitReady(stream).ok());
    ASSERT_EQ(cudaMemcpyAsync(host.data(), t->data, t->byte_size, cudaMemcpyDeviceToHost, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    for (int r = 0; r < 16; ++r) {
      ASSERT_EQ(std::memcmp(&host[r * (kSeqLen + 1)], &tokens_[batch->ids()[r] * kSeqLen],
                            (kSeqLen + 1) * 2),
                0)
          << "batch " << batches << " row " << r;
    }
    batch->Release(stream);
    ++batches;
  }
  EXPECT_EQ(batches, 16383 / 16);
  cudaStreamDestroy(stream);
}

// kill -9 of a device consumer: its session goes, the GPU's free memory returns to the
// baseline within 2 MiB, and the other consumer goes on. The baseline is taken after one
// device session has come and gone, so the daemon's one-off lazy CUDA resources (its first
// stream's) are in it: what is measured is what each session leaves behind.
TEST_P(DeviceDeliveryTest, KilledConsumerFreesItsDeviceMemory) {
  cudaSetDevice(0);
  cudaFree(nullptr);
  const CtlResult warm = RunCtl(daemon_->socket(),
                                Consume({"--job", "warm", "--batch-size", "16", "--epochs", "0",
                                         "--max-batches", "2", "--device", "cuda:0"}),
                                dir_.Join("warm"));
  ASSERT_EQ(warm.exit_code, 0) << warm.err;
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  Subprocess victim(CtlArgv(daemon_->socket(),
                            Consume({"--job", "k9", "--rank", "0", "--world-size", "2",
                                     "--batch-size", "1024", "--ring-slots", "8", "--epochs",
                                     "0", "--max-batches", "100000000", "--step-ms", "20",
                                     "--device", "cuda:0"})),
                    dir_.Join("victim"));
  Subprocess survivor(CtlArgv(daemon_->socket(),
                              Consume({"--job", "k9", "--rank", "1", "--world-size", "2",
                                       "--batch-size", "1024", "--epochs", "1", "--step-ms",
                                       "30", "--device", "cuda:0", "--checksum"})),
                      dir_.Join("survivor"));
  auto sessions = [&] {
    auto admin = client::AdminClient::Connect(daemon_->socket());
    auto list = (*admin)->ListSessions();
    return list.ok() ? *list : std::vector<client::SessionSummary>{};
  };
  absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool streaming = false;
  while (!streaming && absl::Now() < deadline) {
    for (const auto& s : sessions()) streaming |= s.job == "k9" && s.rank == 0 && s.batches_delivered > 0;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(streaming) << victim.Stderr();
  size_t free1 = 0;
  cudaMemGetInfo(&free1, &total);
  EXPECT_LT(free1, free0 - (8u << 20)) << "the victim's ring (8 x 1024 x 130 B) is not on the GPU";
  victim.Kill(SIGKILL);
  ASSERT_EQ(victim.Wait(), 128 + SIGKILL);
  deadline = absl::Now() + absl::Seconds(5);
  bool gone = false;
  while (!gone && absl::Now() < deadline) {
    gone = true;
    for (const auto& s : sessions()) gone &= !(s.job == "k9" && s.rank == 0);
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(gone);
  ASSERT_EQ(survivor.Wait(absl::Seconds(120)), 0) << survivor.Stderr();
  // The survivor is done too: the GPU is back to the baseline.
  size_t free2 = 0;
  deadline = absl::Now() + absl::Seconds(5);
  do {
    cudaMemGetInfo(&free2, &total);
    if (free2 + (2u << 20) >= free0) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  EXPECT_GE(free2 + (2u << 20), free0) << "baseline " << free0 << ", now " << free2;
}

// 2 ranks of one job on 2 GPUs: each receives its slice in its own GPU's memory, the ids of
// the two together exactly once per epoch, payloads byte-exact.
TEST_P(DeviceDeliveryTest, TwoRanksOnTwoGpusEachInItsOwnGpu) {
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has " << count;
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<Subprocess>(
        CtlArgv(daemon_->socket(),
                Consume({"--job", "two-gpus", "--rank", absl::StrCat(r), "--world-size", "2",
                         "--batch-size", "64", "--seed", "9", "--epochs", "1", "--device",
                         absl::StrCat("cuda:", r), "--step-ms", "5", "--checksum", "--ids",
                         dir_.Join(absl::StrCat("ids", r)), "-o", "json"})),
        dir_.Join(absl::StrCat("gpu", r))));
  }
  // While they run: each rank's ring is on the GPU it named.
  std::string uuid[2];
  for (int r = 0; r < 2; ++r) {
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, r), cudaSuccess);
    uuid[r] = cuda::UuidString(prop.uuid);
  }
  ASSERT_NE(uuid[0], uuid[1]);
  int seen = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (seen < 2 && absl::Now() < deadline) {
    auto admin = client::AdminClient::Connect(daemon_->socket());
    auto list = (*admin)->ListSessions();
    seen = 0;
    for (const auto& s : list.ok() ? *list : std::vector<client::SessionSummary>{}) {
      if (s.job != "two-gpus") continue;
      EXPECT_EQ(s.gpu_uuid, uuid[s.rank]) << "rank " << s.rank;
      ++seen;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(seen, 2);
  std::vector<int64_t> ids;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranks[r]->Wait(absl::Seconds(120)), 0) << ranks[r]->Stderr();
    const std::vector<IdsLine> lines = ReadIdsFile(dir_.Join(absl::StrCat("ids", r)));
    ASSERT_EQ(lines.size(), 16383u / 128);
    for (const IdsLine& l : lines) ids.insert(ids.end(), l.ids.begin(), l.ids.end());
    EXPECT_EQ(static_cast<uint64_t>(JsonInt(ranks[r]->Stdout(), "checksum")),
              TokensChecksum(tokens_, kSeqLen, lines))
        << "rank " << r;
  }
  EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size());
  EXPECT_EQ(ids.size(), 16383u / 128 * 128);
}

// A device Attach that does not fit the --device_bytes budget is RESOURCE_EXHAUSTED.
TEST_P(DeviceDeliveryTest, RingBeyondTheDeviceBudgetIsRefused) {
  TempDir dir;
  Daemon small(dir, {"--device_bytes=1048576"});
  ASSERT_TRUE(small.ready());
  CtlResult r = RunCtl(small.socket(),
                       Consume({"--batch-size", "4096", "--ring-slots", "4", "--device", "cuda:0",
                                "--max-batches", "1"}),
                       dir.Join("big"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("RESOURCE_EXHAUSTED"));
  EXPECT_THAT(r.err, HasSubstr("--device_bytes"));
}

}  // namespace
}  // namespace gpufeed::testing
