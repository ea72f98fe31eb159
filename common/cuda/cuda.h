// The CUDA runtime seen through our conventions: statuses, a device guard, GPU UUIDs, and the
// driver API entry points the VMM path needs. libcuda is never linked: driver functions come
// from cudaGetDriverEntryPointByVersion, and the static runtime loads the driver lazily, so a
// binary built with CUDA starts on a machine with no GPU and no driver.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gpufeed::cuda {

// OK for cudaSuccess; otherwise INTERNAL (UNAVAILABLE for no device/driver) with `context`.
// Whether an error that corrupts the CUDA context (illegal address, launch failure, ECC, ...)
// has been seen by Check: every later CUDA call of the process fails, so the daemon is no
// longer ready (readiness NOT_SERVING) and must be restarted.
bool StickyErrorSeen();

absl::Status Check(cudaError_t error, absl::string_view context);
absl::Status Check(CUresult result, absl::string_view context);

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it.
std::string UuidString(const cudaUUID_t& uuid);

struct Device {
  int ordinal = 0;
  std::string uuid;
  std::string name;
};
// The GPUs this process sees; empty (not an error) without driver or device.
std::vector<Device> VisibleDevices();

// Makes `ordinal` current for its lifetime and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Driver API entry points for virtual memory management, resolved once.
struct DriverApi {
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
};
// The resolved entry points; UNAVAILABLE when the driver lacks them.
absl::StatusOr<const DriverApi*> Driver();

// Whether `ordinal` supports VMM allocations exportable as POSIX fds.
bool SupportsVmmFd(int ordinal);

// Whether this process's contexts on `ordinal` are shared through MPS (an MPS control daemon
// answered when CUDA started: CU_DEVICE_ATTRIBUTE_MPS_ENABLED); an error when the driver
// cannot say (older than CUDA 12.x's attribute).
absl::StatusOr<bool> UsesMps(int ordinal);

}  // namespace gpufeed::cuda
