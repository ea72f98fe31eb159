// One owner type per CUDA handle (as DALI's UniqueHandle): a stream, an event, a device
// buffer, a host registration. Only the destructor (or reset) releases the handle, with the
// handle's device made current for the call, so an owner can be destroyed on any thread and
// in any member order. Move-only.
#pragma once

#include <cuda_runtime_api.h>

#include <utility>

#include "absl/status/statusor.h"
#include "common/cuda/cuda.h"

namespace gpufeed::cuda {

// `Traits` gives: using Handle; static void Destroy(Handle); static constexpr Handle kNull.
template <typename Traits>
class UniqueHandle {
 public:
  using Handle = typename Traits::Handle;
  UniqueHandle() = default;
  UniqueHandle(int device, Handle handle) : device_(device), handle_(handle) {}
  ~UniqueHandle() { reset(); }
  UniqueHandle(UniqueHandle&& other) noexcept
      : device_(other.device_), handle_(std::exchange(other.handle_, Traits::kNull)) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = other.device_;
      handle_ = std::exchange(other.handle_, Traits::kNull);
    }
    return *this;
  }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;

  Handle get() const { return handle_; }
  int device() const { return device_; }
  explicit operator bool() const { return handle_ != Traits::kNull; }
  void reset() {
    if (handle_ == Traits::kNull) return;
    DeviceGuard guard(device_);
    Traits::Destroy(std::exchange(handle_, Traits::kNull));
  }

 private:
  int device_ = 0;
  Handle handle_ = Traits::kNull;
};

struct StreamTraits {
  using Handle = cudaStream_t;
  static constexpr Handle kNull = nullptr;
  static void Destroy(Handle h) { cudaStreamDestroy(h); }
};
struct EventTraits {
  using Handle = cudaEvent_t;
  static constexpr Handle kNull = nullptr;
  static void Destroy(Handle h) { cudaEventDestroy(h); }
};
struct DeviceMemoryTraits {
  using Handle = void*;
  static constexpr Handle kNull = nullptr;
  static void Destroy(Handle h) { cudaFree(h); }
};
struct HostRegistrationTraits {
  using Handle = void*;
  static constexpr Handle kNull = nullptr;
  static void Destroy(Handle h) { cudaHostUnregister(h); }
};

// Another process's allocation opened from its cudaIpcMemHandle_t.
struct IpcMemoryTraits {
  using Handle = void*;
  static constexpr Handle kNull = nullptr;
  static void Destroy(Handle h) { cudaIpcCloseMemHandle(h); }
};

using Stream = UniqueHandle<StreamTraits>;
// An event we created, or one opened from another process's IPC handle (same release call).
using Event = UniqueHandle<EventTraits>;
using DeviceBuffer = UniqueHandle<DeviceMemoryTraits>;
using HostRegistration = UniqueHandle<HostRegistrationTraits>;
using IpcMemory = UniqueHandle<IpcMemoryTraits>;

// Factories on `device`, errors with the call's name.
absl::StatusOr<Stream> CreateStream(int device, unsigned flags, int priority);
absl::StatusOr<Event> CreateEvent(int device, unsigned flags);
absl::StatusOr<Event> OpenIpcEvent(int device, const cudaIpcEventHandle_t& handle);
absl::StatusOr<DeviceBuffer> Malloc(int device, size_t bytes);
absl::StatusOr<HostRegistration> RegisterHost(int device, void* data, size_t bytes,
                                              unsigned flags);
absl::StatusOr<IpcMemory> OpenIpcMemory(int device, const cudaIpcMemHandle_t& handle,
                                        unsigned flags);

// A VMM allocation exportable as a POSIX fd: created, reserved, mapped and made accessible
// on `device`; the destructor unmaps, frees the address range and releases it (a consumer's
// own mapping of the exported fd keeps the memory alive until it unmaps).
class VmmAllocation {
 public:
  // `bytes` is rounded up to the device's allocation granularity (see size()).
  static absl::StatusOr<VmmAllocation> Create(int device, size_t bytes);
  // `bytes` rounded up as Create rounds it.
  static absl::StatusOr<size_t> RoundUp(int device, size_t bytes);
  VmmAllocation() = default;
  ~VmmAllocation() { reset(); }
  VmmAllocation(VmmAllocation&& other) noexcept { *this = std::move(other); }
  VmmAllocation& operator=(VmmAllocation&& other) noexcept;
  VmmAllocation(const VmmAllocation&) = delete;
  VmmAllocation& operator=(const VmmAllocation&) = delete;

  void* data() const { return reinterpret_cast<void*>(ptr_); }  // NOLINT(performance-no-int-to-ptr)
  size_t size() const { return size_; }
  // A new POSIX fd of the allocation (the caller owns it).
  absl::StatusOr<int> ExportFd() const;
  void reset();

 private:
  int device_ = 0;
  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr ptr_ = 0;
  size_t size_ = 0;
  bool created_ = false;
};

// Another process's VMM allocation, imported from the POSIX fd it exported, mapped and made
// accessible on `device` (VmmAllocation's other side); the destructor unmaps it and frees the
// address range. The mapping alone holds the memory: the imported handle is released at once.
class VmmMapping {
 public:
  static absl::StatusOr<VmmMapping> Import(int device, int fd, size_t bytes);
  VmmMapping() = default;
  ~VmmMapping() { reset(); }
  VmmMapping(VmmMapping&& other) noexcept { *this = std::move(other); }
  VmmMapping& operator=(VmmMapping&& other) noexcept;
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;

  void* data() const { return reinterpret_cast<void*>(ptr_); }  // NOLINT(performance-no-int-to-ptr)
  void reset();

 private:
  int device_ = 0;
  CUdeviceptr ptr_ = 0;  // reserved (and, once Import returns, mapped)
  size_t size_ = 0;
};

}  // namespace gpufeed::cuda
