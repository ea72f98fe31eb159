#include "common/cuda/owners.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed::cuda {

absl::StatusOr<Stream> CreateStream(int device, unsigned flags, int priority) {
  DeviceGuard guard(device);
  cudaStream_t s = nullptr;
  GPUFEED_RETURN_IF_ERROR(Check(cudaStreamCreateWithPriority(&s, flags, priority),
                                "cudaStreamCreateWithPriority"));
  return Stream(device, s);
}

absl::StatusOr<Event> CreateEvent(int device, unsigned flags) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  GPUFEED_RETURN_IF_ERROR(Check(cudaEventCreateWithFlags(&e, flags), "cudaEventCreateWithFlags"));
  return Event(device, e);
}

absl::StatusOr<Event> OpenIpcEvent(int device, const cudaIpcEventHandle_t& handle) {
  DeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  GPUFEED_RETURN_IF_ERROR(Check(cudaIpcOpenEventHandle(&e, handle), "cudaIpcOpenEventHandle"));
  return Event(device, e);
}

absl::StatusOr<DeviceBuffer> Malloc(int device, size_t bytes) {
  DeviceGuard guard(device);
  void* p = nullptr;
  GPUFEED_RETURN_IF_ERROR(Check(cudaMalloc(&p, bytes), absl::StrCat("cudaMalloc of ", bytes, " bytes")));
  return DeviceBuffer(device, p);
}

absl::StatusOr<HostRegistration> RegisterHost(int device, void* data, size_t bytes,
                                              unsigned flags) {
  DeviceGuard guard(device);
  GPUFEED_RETURN_IF_ERROR(Check(cudaHostRegister(data, bytes, flags), "cudaHostRegister"));
  return HostRegistration(device, data);
}

absl::StatusOr<IpcMemory> OpenIpcMemory(int device, const cudaIpcMemHandle_t& handle,
                                        unsigned flags) {
  DeviceGuard guard(device);
  void* p = nullptr;
  GPUFEED_RETURN_IF_ERROR(Check(cudaIpcOpenMemHandle(&p, handle, flags), "cudaIpcOpenMemHandle"));
  return IpcMemory(device, p);
}

namespace {

CUmemAllocationProp DeviceProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

}  // namespace

absl::StatusOr<size_t> VmmAllocation::RoundUp(int device, size_t bytes) {
  GPUFEED_ASSIGN_OR_RETURN(const DriverApi* api, Driver());
  const CUmemAllocationProp prop = DeviceProp(device);
  size_t granularity = 0;
  GPUFEED_RETURN_IF_ERROR(Check(
      api->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity"));
  return (bytes + granularity - 1) / granularity * granularity;
}

absl::StatusOr<VmmAllocation> VmmAllocation::Create(int device, size_t bytes) {
  GPUFEED_ASSIGN_OR_RETURN(const DriverApi* api, Driver());
  GPUFEED_ASSIGN_OR_RETURN(const size_t size, RoundUp(device, bytes));
  DeviceGuard guard(device);
  const CUmemAllocationProp prop = DeviceProp(device);
  VmmAllocation a;
  a.device_ = device;
  a.size_ = size;
  GPUFEED_RETURN_IF_ERROR(Check(api->cuMemCreate(&a.handle_, a.size_, &prop, 0), "cuMemCreate"));
  a.created_ = true;  // from here on, reset() undoes what was done
  GPUFEED_RETURN_IF_ERROR(
      Check(api->cuMemAddressReserve(&a.ptr_, a.size_, 0, 0, 0), "cuMemAddressReserve"));
  GPUFEED_RETURN_IF_ERROR(Check(api->cuMemMap(a.ptr_, a.size_, 0, a.handle_, 0), "cuMemMap"));
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  GPUFEED_RETURN_IF_ERROR(Check(api->cuMemSetAccess(a.ptr_, a.size_, &access, 1), "cuMemSetAccess"));
  return a;
}

VmmAllocation& VmmAllocation::operator=(VmmAllocation&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, 0);
    ptr_ = std::exchange(other.ptr_, 0);
    size_ = std::exchange(other.size_, 0);
    created_ = std::exchange(other.created_, false);
  }
  return *this;
}

absl::StatusOr<int> VmmAllocation::ExportFd() const {
  GPUFEED_ASSIGN_OR_RETURN(const DriverApi* api, Driver());
  int fd = -1;
  GPUFEED_RETURN_IF_ERROR(Check(api->cuMemExportToShareableHandle(
                                    &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                                "cuMemExportToShareableHandle"));
  return fd;
}

void VmmAllocation::reset() {
  if (!created_) return;
  absl::StatusOr<const DriverApi*> api = Driver();
  if (api.ok()) {
    DeviceGuard guard(device_);
    // A mapping that failed half-way: unmap fails harmlessly where nothing is mapped.
    if (ptr_ != 0) {
      (*api)->cuMemUnmap(ptr_, size_);
      (*api)->cuMemAddressFree(ptr_, size_);
    }
    (*api)->cuMemRelease(handle_);
  }
  created_ = false;
  ptr_ = 0;
  handle_ = 0;
  size_ = 0;
}

absl::StatusOr<VmmMapping> VmmMapping::Import(int device, int fd, size_t bytes) {
  GPUFEED_ASSIGN_OR_RETURN(const DriverApi* api, Driver());
  DeviceGuard guard(device);
  cudaFree(nullptr);  // make sure the primary context exists before driver calls
  CUmemGenericAllocationHandle handle = 0;
  GPUFEED_RETURN_IF_ERROR(Check(
      api->cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuMemImportFromShareableHandle"));
  VmmMapping m;
  m.device_ = device;
  absl::Status s = Check(api->cuMemAddressReserve(&m.ptr_, bytes, 0, 0, 0), "cuMemAddressReserve");
  if (s.ok()) {
    m.size_ = bytes;  // from here on, reset() frees the range
    s = Check(api->cuMemMap(m.ptr_, bytes, 0, handle, 0), "cuMemMap");
  }
  api->cuMemRelease(handle);  // the mapping holds the memory from here on
  GPUFEED_RETURN_IF_ERROR(s);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  GPUFEED_RETURN_IF_ERROR(
      Check(api->cuMemSetAccess(m.ptr_, bytes, &access, 1), "cuMemSetAccess"));
  return m;
}

VmmMapping& VmmMapping::operator=(VmmMapping&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = other.device_;
    ptr_ = std::exchange(other.ptr_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void VmmMapping::reset() {
  if (ptr_ == 0) return;
  if (absl::StatusOr<const DriverApi*> api = Driver(); api.ok()) {
    DeviceGuard guard(device_);
    // A mapping that failed half-way: unmap fails harmlessly where nothing is mapped.
    (*api)->cuMemUnmap(ptr_, size_);
    (*api)->cuMemAddressFree(ptr_, size_);
  }
  ptr_ = 0;
  size_ = 0;
}

}  // namespace gpufeed::cuda
