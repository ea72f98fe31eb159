// The DeviceBackend on the CUDA runtime: per GPU one copy thread with its own non-blocking
// stream and a byte budget; per session a ring in device memory (a VMM allocation exported
// as a POSIX fd, or cudaMalloc shared by legacy IPC handle) with one interprocess ready
// event per slot.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/device/device_backend.h"

namespace gpufeed::server {

struct CudaBackendOptions {
  // Device bytes all rings on one GPU may hold together.
  uint64_t budget_bytes = uint64_t{4} << 30;
  // nvJPEG: the library to load ("" = libnvjpeg.so.13/.12 on the loader path or under
  // /usr/local/cuda), and chroma upsampling by interpolation as libjpeg-turbo does it (else
  // nvJPEG's own, faster and less like libjpeg-turbo's).
  std::string nvjpeg_library;
  bool nvjpeg_interpolation = true;
};

// Finds the GPUs (none is fine: the backend then serves none) and starts their copy threads.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(const CudaBackendOptions& options);

// Pins (cudaHostRegister, portable) a host range for fast, asynchronous copies; undone by
// UnpinHost. No-op statuses when no GPU is visible.
absl::Status PinHost(void* data, uint64_t bytes);
void UnpinHost(void* data);

}  // namespace gpufeed::server
