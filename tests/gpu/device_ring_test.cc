// GPU tests (ctest label `gpu`) of the client's device ring (client/cpp/device_ring.h), in one
// process: naming a device, and mapping a VMM allocation exported as an fd, as a consumer maps
// the daemon's ring. Each test skips, saying so, where this process sees no CUDA device.
#include "client/cpp/device_ring.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/options.h"
#include "common/cuda/cuda.h"
#include "common/cuda/owners.h"
#include "gtest/gtest.h"

namespace gpufeed::client::internal {
namespace {

class DeviceRingGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    devices_ = cuda::VisibleDevices();
    if (devices_.empty()) GTEST_SKIP() << "no CUDA device visible: GPU test skipped";
  }
  std::vector<cuda::Device> devices_;
};

TEST_F(DeviceRingGpuTest, EachSpellingNamesTheSameDevice) {
  const cuda::Device& last = devices_.back();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (const std::string& spec : {std::string(), std::string("cuda:0"), devices_[0].uuid}) {
    absl::StatusOr<GpuTarget> gpu = ResolveGpu(spec);
    ASSERT_TRUE(gpu.ok()) << spec << ": " << gpu.status();
    EXPECT_EQ(gpu->ordinal, 0) << spec;
    EXPECT_EQ(gpu->uuid, devices_[0].uuid) << spec;
  }
  absl::StatusOr<GpuTarget> by_uuid = ResolveGpu(last.uuid);
  ASSERT_TRUE(by_uuid.ok());
  EXPECT_EQ(by_uuid->ordinal, last.ordinal);
  ASSERT_TRUE(absl::StartsWith(devices_[0].uuid, "GPU-")) << devices_[0].uuid;
}

TEST_F(DeviceRingGpuTest, ASpecNamingNoDeviceIsRefusedWithWhatIsValid) {
  const std::string valid = absl::StrCat("(want cuda:0..cuda:", devices_.size() - 1,
                                         " or a GPU-... UUID)");
  for (const std::string& spec : {absl::StrCat("cuda:", devices_.size()), std::string("cuda:x"),
                                 std::string("cuda:-1"), std::string("GPU-not-a-device"),
                                 std::string("0")}) {
    absl::StatusOr<GpuTarget> gpu = ResolveGpu(spec);
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_EQ(gpu.status().message(),
              absl::StrCat("gpu: '", spec, "' names no CUDA device of this process ", valid));
  }
}

TEST_F(DeviceRingGpuTest, MpsIsKnownForAVisibleDevice) {
  absl::StatusOr<bool> mps = UsesMps(0);
  ASSERT_TRUE(mps.ok()) << mps.status();
  // Whether MPS is on is the machine's; the answer must not change between calls.
  EXPECT_EQ(*UsesMps(0), *mps);
}

TEST_F(DeviceRingGpuTest, DeviceDeliveryPutsTheDevicesUuidInTheRequest) {
  AttachOptions o;  // tokens, on cuda:0
  o.delivery = "device";
  o.gpu = "cuda:0";
  for (const auto& [ipc, kind] : std::vector<std::pair<std::string, v1::IpcKind>>{
           {"vmm", v1::IPC_KIND_VMM}, {"legacy", v1::IPC_KIND_LEGACY},
           {"auto", v1::IPC_KIND_UNSPECIFIED}, {"", v1::IPC_KIND_UNSPECIFIED}}) {
    o.ipc = ipc;
    absl::StatusOr<AttachPlan> plan = AttachPlanFromOptions(o);
    ASSERT_TRUE(plan.ok()) << ipc << ": " << plan.status();
    EXPECT_TRUE(plan->device);
    EXPECT_EQ(plan->gpu.ordinal, 0);
    EXPECT_EQ(plan->gpu.uuid, devices_[0].uuid);
    EXPECT_EQ(plan->request.delivery().kind(), v1::DELIVERY_KIND_DEVICE);
    EXPECT_EQ(plan->request.delivery().gpu_uuid(), devices_[0].uuid);
    EXPECT_EQ(plan->request.delivery().ipc(), kind) << ipc;
  }
  o.ipc = "nvlink";
  EXPECT_EQ(AttachPlanFromOptions(o).status().message(),
            "ipc: unknown kind 'nvlink' (want auto, vmm or legacy)");
}

// A VMM allocation exported as an fd and mapped through MapVmm reads what was written to it.
TEST_F(DeviceRingGpuTest, AMappedVmmRingReadsTheExportersBytes) {
  absl::StatusOr<cuda::VmmAllocation> ring = cuda::VmmAllocation::Create(0, 1 << 20);
  ASSERT_TRUE(ring.ok()) << ring.status();
  std::vector<uint8_t> bytes(ring->size());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  ASSERT_EQ(cudaMemcpy(ring->data(), bytes.data(), bytes.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  absl::StatusOr<int> fd = ring->ExportFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  absl::StatusOr<std::unique_ptr<DeviceRingMapping>> m =
      DeviceRingMapping::MapVmm(0, UniqueFd(*fd), ring->size(), {});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->ordinal(), 0);
  ASSERT_NE((*m)->base(), nullptr);
  EXPECT_NE(static_cast<void*>((*m)->base()), ring->data());  // a mapping of its own
  EXPECT_TRUE((*m)->release_event_handles().empty());
  std::vector<uint8_t> back(bytes.size());
  ASSERT_EQ(cudaMemcpy(back.data(), (*m)->base(), back.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(back, bytes);
  // The mapping holds the memory: it stays readable after the exporter let go of it.
  ring->reset();
  std::vector<uint8_t> after(16);
  ASSERT_EQ(cudaMemcpy(after.data(), (*m)->base() + 1000, after.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(after, std::vector<uint8_t>(bytes.begin() + 1000, bytes.begin() + 1016));
}

TEST_F(DeviceRingGpuTest, AMalformedReadyEventIsRefused) {
  absl::StatusOr<cuda::VmmAllocation> ring = cuda::VmmAllocation::Create(0, 1 << 20);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<int> fd = ring->ExportFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  absl::StatusOr<std::unique_ptr<DeviceRingMapping>> m =
      DeviceRingMapping::MapVmm(0, UniqueFd(*fd), ring->size(), {std::string(10, 'e')});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(m.status().message(), "daemon sent a malformed ready event handle");
}

TEST_F(DeviceRingGpuTest, AnFdThatIsNoAllocationIsRefusedNamingTheCall) {
  UniqueFd fd(::dup(STDIN_FILENO));
  absl::StatusOr<std::unique_ptr<DeviceRingMapping>> m =
      DeviceRingMapping::MapVmm(0, std::move(fd), 1 << 21, {});
  EXPECT_FALSE(m.ok());
  EXPECT_TRUE(absl::StrContains(m.status().message(), "cuMemImportFromShareableHandle"))
      << m.status();
}

// With a ready event from the exporter: a release event is made for the slot, its handle is
// a cudaIpcEventHandle_t, and a stream can wait on the one and record the other.
TEST_F(DeviceRingGpuTest, ASlotsReadyAndReleaseEventsWorkOnAStream) {
  absl::StatusOr<cuda::VmmAllocation> ring = cuda::VmmAllocation::Create(0, 1 << 20);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<int> fd = ring->ExportFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  cudaEvent_t ready = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming | cudaEventInterprocess),
            cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ready, nullptr), cudaSuccess);
  cudaIpcEventHandle_t handle;
  ASSERT_EQ(cudaIpcGetEventHandle(&handle, ready), cudaSuccess);
  absl::StatusOr<std::unique_ptr<DeviceRingMapping>> m = DeviceRingMapping::MapVmm(
      0, UniqueFd(*fd), ring->size(),
      {std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))});
  if (!m.ok() && absl::StartsWith(m.status().message(), "opening ready event of slot 0: ")) {
    cudaEventDestroy(ready);
    GTEST_SKIP() << "this CUDA opens no IPC event in the process that made it (" << m.status()
                 << "): DeviceDeliveryTest covers the events across processes";
  }
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ((*m)->release_event_handles().size(), 1u);
  EXPECT_EQ((*m)->release_event_handles()[0].size(), sizeof(cudaIpcEventHandle_t));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  EXPECT_TRUE((*m)->WaitReady(0, stream).ok());
  EXPECT_TRUE((*m)->RecordRelease(0, stream).ok());
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  m->reset();  // waits for the release event, then unmaps
  cudaStreamDestroy(stream);
  cudaEventDestroy(ready);
}

}  // namespace
}  // namespace gpufeed::client::internal
