// The DeviceBackend on the CUDA runtime: per GPU one copy thread with its own non-blocking
// stream and a byte budget; per session a ring in device memory (a VMM allocation exported
// as a POSIX fd, or cudaMalloc shared by legacy IPC handle) with one interprocess ready
// event per slot.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/device/device_backend.h"

namespace gpufeed::server {

// Finds the GPUs (none is fine: the backend then serves none) and starts their copy threads.
// `budget_bytes`: device bytes all rings on one GPU may hold together.
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(uint64_t budget_bytes);

// Pins (cudaHostRegister, portable) a host range for fast, asynchronous copies; undone by
// UnpinHost. No-op statuses when no GPU is visible.
absl::Status PinHost(void* data, uint64_t bytes);
void UnpinHost(void* data);

}  // namespace gpufeed::server
