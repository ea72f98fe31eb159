#include "client/cpp/device_ring.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

#ifdef GPUFEED_WITH_CUDA
#include "common/cuda/cuda.h"
#endif

namespace gpufeed::client::internal {

#ifndef GPUFEED_WITH_CUDA

namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "device delivery: this gpufeed client was built without CUDA support");
}
}  // namespace

absl::StatusOr<GpuTarget> ResolveGpu(const std::string&) { return NoCuda(); }
absl::StatusOr<bool> UsesMps(int) { return NoCuda(); }
absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapVmm(
    int, UniqueFd, uint64_t, const std::vector<std::string>&) {
  return NoCuda();
}
absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapLegacy(
    int, const std::string&, const std::vector<std::string>&) {
  return NoCuda();
}
DeviceRingMapping::~DeviceRingMapping() = default;
absl::Status DeviceRingMapping::WaitReady(int, void*) const { return NoCuda(); }
absl::Status DeviceRingMapping::RecordRelease(int, void*) const { return NoCuda(); }

#else

absl::StatusOr<bool> UsesMps(int ordinal) { return cuda::UsesMps(ordinal); }

absl::StatusOr<GpuTarget> ResolveGpu(const std::string& spec) {
  const std::vector<cuda::Device> devices = cuda::VisibleDevices();
  if (devices.empty()) {
    return absl::FailedPreconditionError("device delivery: this process sees no CUDA device");
  }
  int ordinal = -1;
  if (spec.empty()) {
    GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaGetDevice(&ordinal), "cudaGetDevice"));
  } else if (absl::StartsWith(spec, "cuda:")) {
    if (!absl::SimpleAtoi(spec.substr(5), &ordinal)) ordinal = -1;
  } else {
    for (const cuda::Device& d : devices) {
      if (d.uuid == spec) ordinal = d.ordinal;
    }
  }
  for (const cuda::Device& d : devices) {
    if (d.ordinal == ordinal) return GpuTarget{d.ordinal, d.uuid};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "gpu: '", spec, "' names no CUDA device of this process (want cuda:0..cuda:",
      devices.size() - 1, " or a GPU-... UUID)"));
}

absl::Status DeviceRingMapping::OpenEvents(const std::vector<std::string>& ready_events) {
  cuda::DeviceGuard guard(ordinal_);
  for (size_t i = 0; i < ready_events.size(); ++i) {
    if (ready_events[i].size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InternalError("daemon sent a malformed ready event handle");
    }
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ready_events[i].data(), sizeof(handle));
    cudaEvent_t event = nullptr;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaIpcOpenEventHandle(&event, handle),
                                        absl::StrCat("opening ready event of slot ", i)));
    ready_.push_back(event);
    cudaEvent_t release = nullptr;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(
        cudaEventCreateWithFlags(&release, cudaEventDisableTiming | cudaEventInterprocess),
        "creating a release event"));
    release_.push_back(release);
    cudaIpcEventHandle_t out;
    GPUFEED_RETURN_IF_ERROR(
        cuda::Check(cudaIpcGetEventHandle(&out, release), "cudaIpcGetEventHandle"));
    release_handles_.emplace_back(reinterpret_cast<const char*>(&out), sizeof(out));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapVmm(
    int ordinal, UniqueFd fd, uint64_t bytes, const std::vector<std::string>& ready_events) {
  std::unique_ptr<DeviceRingMapping> m(new DeviceRingMapping());
  m->ordinal_ = ordinal;
  GPUFEED_ASSIGN_OR_RETURN(const cuda::DriverApi* api, cuda::Driver());
  cuda::DeviceGuard guard(ordinal);
  cudaFree(nullptr);  // make sure the primary context exists before driver calls
  CUmemGenericAllocationHandle handle = 0;
  GPUFEED_RETURN_IF_ERROR(cuda::Check(
      api->cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd.get())),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle"));
  CUdeviceptr ptr = 0;
  absl::Status s = cuda::Check(api->cuMemAddressReserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
  if (s.ok()) s = cuda::Check(api->cuMemMap(ptr, bytes, 0, handle, 0), "cuMemMap");
  api->cuMemRelease(handle);  // the mapping holds the memory from here on
  if (!s.ok()) {
    if (ptr != 0) api->cuMemAddressFree(ptr, bytes);
    return s;
  }
  m->base_ = reinterpret_cast<std::byte*>(ptr);
  m->vmm_bytes_ = bytes;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  GPUFEED_RETURN_IF_ERROR(cuda::Check(api->cuMemSetAccess(ptr, bytes, &access, 1), "cuMemSetAccess"));
  GPUFEED_RETURN_IF_ERROR(m->OpenEvents(ready_events));
  return m;
}

absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapLegacy(
    int ordinal, const std::string& mem_handle, const std::vector<std::string>& ready_events) {
  if (mem_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InternalError("daemon sent a malformed legacy memory handle");
  }
  std::unique_ptr<DeviceRingMapping> m(new DeviceRingMapping());
  m->ordinal_ = ordinal;
  m->legacy_ = true;
  cuda::DeviceGuard guard(ordinal);
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, mem_handle.data(), sizeof(handle));
  void* ptr = nullptr;
  GPUFEED_RETURN_IF_ERROR(cuda::Check(
      cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"));
  m->base_ = static_cast<std::byte*>(ptr);
  GPUFEED_RETURN_IF_ERROR(m->OpenEvents(ready_events));
  return m;
}

DeviceRingMapping::~DeviceRingMapping() {
  cuda::DeviceGuard guard(ordinal_);
  for (void* e : ready_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  for (void* e : release_) {
    // Work queued before the release must not lose its event: wait for it.
    cudaEventSynchronize(static_cast<cudaEvent_t>(e));
    cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
  if (base_ == nullptr) return;
  if (legacy_) {
    cudaIpcCloseMemHandle(base_);
  } else if (absl::StatusOr<const cuda::DriverApi*> api = cuda::Driver(); api.ok()) {
    const CUdeviceptr ptr = reinterpret_cast<CUdeviceptr>(base_);
    (*api)->cuMemUnmap(ptr, vmm_bytes_);
    (*api)->cuMemAddressFree(ptr, vmm_bytes_);
  }
}

absl::Status DeviceRingMapping::WaitReady(int slot, void* stream) const {
  cuda::DeviceGuard guard(ordinal_);
  auto* ready = static_cast<cudaEvent_t>(ready_[static_cast<size_t>(slot)]);
  // Measured on the H200: a stream wait on an interprocess event costs ~150 us even when the
  // event completed long ago, a query of it far less. In training the ring runs ahead, so the
  // copy is usually done: ask first, and only make the stream wait when it is not.
  const cudaError_t done = cudaEventQuery(ready);
  if (done == cudaSuccess) return absl::OkStatus();
  if (done != cudaErrorNotReady) return cuda::Check(done, "querying a batch's ready event");
  return cuda::Check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), ready, 0),
                     "waiting for a batch's ready event");
}

absl::Status DeviceRingMapping::RecordRelease(int slot, void* stream) const {
  cuda::DeviceGuard guard(ordinal_);
  return cuda::Check(cudaEventRecord(static_cast<cudaEvent_t>(release_[static_cast<size_t>(slot)]),
                                     static_cast<cudaStream_t>(stream)),
                     "recording a release event");
}

#endif

}  // namespace gpufeed::client::internal
