// The client's device ring (client/cpp/device_ring.h) where this process sees no CUDA device:
// every entry point refuses, saying why, and device delivery is refused before anything is
// sent. Where a device is visible, tests/gpu/device_ring_test.cc (label gpu) covers it.
#include "client/cpp/device_ring.h"

#include <fcntl.h>

#include <string>
#include <vector>

#include "client/cpp/options.h"
#include "gtest/gtest.h"

#ifdef GPUFEED_WITH_CUDA
#include "common/cuda/cuda.h"
#endif

namespace gpufeed::client::internal {
namespace {

#ifdef GPUFEED_WITH_CUDA
constexpr bool kWithCuda = true;
bool DeviceVisible() { return !cuda::VisibleDevices().empty(); }
#else
constexpr bool kWithCuda = false;
bool DeviceVisible() { return false; }
#endif

constexpr char kNoCuda[] = "device delivery: this gpufeed client was built without CUDA support";
constexpr char kNoDevice[] = "device delivery: this process sees no CUDA device";

class NoDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceVisible()) {
      GTEST_SKIP() << "a CUDA device is visible: tests/gpu/device_ring_test.cc tests it";
    }
  }
};

TEST_F(NoDeviceTest, NoGpuResolves) {
  for (const char* spec : {"", "cuda:0", "GPU-00000000-0000-0000-0000-000000000000"}) {
    absl::StatusOr<GpuTarget> gpu = ResolveGpu(spec);
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << spec;
    EXPECT_EQ(gpu.status().message(), kWithCuda ? kNoDevice : kNoCuda) << spec;
  }
}

TEST_F(NoDeviceTest, NothingMapsAndMpsIsUnknown) {
  EXPECT_FALSE(UsesMps(0).ok());
  UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  absl::StatusOr<std::unique_ptr<DeviceRingMapping>> vmm =
      DeviceRingMapping::MapVmm(0, std::move(fd), 1 << 21, {});
  EXPECT_FALSE(vmm.ok());
  if (!kWithCuda) {
    EXPECT_EQ(UsesMps(0).status().message(), kNoCuda);
    EXPECT_EQ(vmm.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(vmm.status().message(), kNoCuda);
  }
}

// Device delivery resolves the GPU before anything is sent: the request is never made.
TEST_F(NoDeviceTest, DeviceDeliveryIsRefusedWithTheDevicesReason) {
  AttachOptions o;  // tokens
  o.delivery = "device";
  for (const char* gpu : {"", "cuda:0"}) {
    o.gpu = gpu;
    const absl::Status refused = AttachPlanFromOptions(o).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << gpu;
    EXPECT_EQ(refused.message(), kWithCuda ? kNoDevice : kNoCuda) << gpu;
  }
}

// The handle's size is checked before any CUDA call, so this holds with or without a device.
TEST(DeviceRingMappingTest, AMalformedLegacyHandleIsRefused) {
  for (const std::string& handle : {std::string(), std::string(63, 'x'), std::string(65, 'x')}) {
    absl::StatusOr<std::unique_ptr<DeviceRingMapping>> m =
        DeviceRingMapping::MapLegacy(0, handle, {});
    if (kWithCuda) {
      EXPECT_EQ(m.status().code(), absl::StatusCode::kInternal) << handle.size();
      EXPECT_EQ(m.status().message(), "daemon sent a malformed legacy memory handle");
    } else {
      EXPECT_EQ(m.status().message(), kNoCuda);
    }
  }
}

}  // namespace
}  // namespace gpufeed::client::internal
