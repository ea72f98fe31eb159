#include "common/cuda/cuda.h"

#include <atomic>
#include <mutex>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace gpufeed::cuda {

namespace {
std::atomic<bool> sticky{false};
}  // namespace

bool StickyErrorSeen() { return sticky.load(std::memory_order_relaxed); }

absl::Status Check(cudaError_t error, absl::string_view context) {
  if (error == cudaSuccess) return absl::OkStatus();
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
      sticky.store(true, std::memory_order_relaxed);
      break;
    default:
      break;
  }
  // Out of GPU memory is the caller's to act on (a smaller ring, later), as --device_bytes is.
  const absl::StatusCode code = (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver)
                                    ? absl::StatusCode::kUnavailable
                                : error == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat(context, ": ", cudaGetErrorName(error), ": ",
                                         cudaGetErrorString(error)));
}

absl::Status Check(CUresult result, absl::string_view context) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  absl::StatusOr<const DriverApi*> api = Driver();
  if (api.ok() && (*api)->cuGetErrorName != nullptr) (*api)->cuGetErrorName(result, &name);
  return absl::Status(result == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted
                                                         : absl::StatusCode::kInternal,
                      absl::StrCat(context, ": ", name != nullptr ? name : "CUresult", " (",
                                   static_cast<int>(result), ")"));
}

std::string UuidString(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
      b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

std::vector<Device> VisibleDevices() {
  std::vector<Device> out;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error of a machine without GPU
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back({i, UuidString(prop.uuid), prop.name});
  }
  return out;
}

DeviceGuard::DeviceGuard(int ordinal) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != ordinal) cudaSetDevice(ordinal);
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

absl::StatusOr<const DriverApi*> Driver() {
  static DriverApi api;
  static absl::Status status;
  static std::once_flag once;
  std::call_once(once, [] {
    auto get = [](const char* name, auto* fn) -> absl::Status {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult result{};
      cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &result);
      if (e != cudaSuccess || result != cudaDriverEntryPointSuccess || p == nullptr) {
        return absl::UnavailableError(absl::StrCat("CUDA driver entry point ", name, " not found"));
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return absl::OkStatus();
    };
    for (absl::Status s :
         {get("cuMemCreate", &api.cuMemCreate), get("cuMemRelease", &api.cuMemRelease),
          get("cuMemAddressReserve", &api.cuMemAddressReserve),
          get("cuMemAddressFree", &api.cuMemAddressFree), get("cuMemMap", &api.cuMemMap),
          get("cuMemUnmap", &api.cuMemUnmap), get("cuMemSetAccess", &api.cuMemSetAccess),
          get("cuMemExportToShareableHandle", &api.cuMemExportToShareableHandle),
          get("cuMemImportFromShareableHandle", &api.cuMemImportFromShareableHandle),
          get("cuMemGetAllocationGranularity", &api.cuMemGetAllocationGranularity),
          get("cuDeviceGetAttribute", &api.cuDeviceGetAttribute),
          get("cuGetErrorName", &api.cuGetErrorName)}) {
      if (!s.ok() && status.ok()) status = s;
    }
  });
  if (!status.ok()) return status;
  return &api;
}

bool SupportsVmmFd(int ordinal) {
  absl::StatusOr<const DriverApi*> api = Driver();
  if (!api.ok()) return false;
  int vmm = 0, fd = 0;
  (*api)->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                               ordinal);
  (*api)->cuDeviceGetAttribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                               ordinal);
  return vmm != 0 && fd != 0;
}

absl::StatusOr<bool> UsesMps(int ordinal) {
  GPUFEED_ASSIGN_OR_RETURN(const DriverApi* api, Driver());
  int mps = 0;
  if (api->cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, ordinal) != CUDA_SUCCESS) {
    return absl::UnimplementedError("this driver does not say whether MPS is in use");
  }
  return mps != 0;
}

}  // namespace gpufeed::cuda
