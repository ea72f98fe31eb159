// The CUDA side of one GPU (Gpu: copy thread, nvJPEG handle, byte budget) and of one device
// ring (CudaRing): its slots (VMM or legacy IPC memory), ready and release events, its own
// stream, nvJPEG decoder state and scratch buffers. Every handle has an owner
// (common/cuda/owners.h), so a ring frees exactly what it made, on any error path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/owners.h"
#include "server/device/copy_thread.h"
#include "server/device/cuda_backend.h"
#include "server/device/device_backend.h"
#include "server/device/nvjpeg.h"

namespace gpufeed::server {

// One GPU: its copy thread, its nvJPEG handle and the bytes its rings hold. Each ring has its
// own stream and decoder state (CudaRing).
struct Gpu {
  int ordinal = 0;
  std::string uuid;
  bool vmm = false;
  bool mps = false;         // this process's contexts on it go through MPS
  int lowest_priority = 0;  // of a stream: the daemon's work yields to training kernels
  const CudaBackendOptions* options = nullptr;  // the backend's
  std::unique_ptr<CopyThread> thread;
  absl::Mutex mu;
  uint64_t used ABSL_GUARDED_BY(mu) = 0;
  // nvJPEG, created on first demand; used by the copy thread only once created.
  absl::Mutex nvjpeg_mu;
  bool nvjpeg_tried ABSL_GUARDED_BY(nvjpeg_mu) = false;
  absl::Status nvjpeg_status ABSL_GUARDED_BY(nvjpeg_mu);
  const nvjpeg::Api* nvjpeg = nullptr;  // &nvjpeg_api once loaded
  nvjpeg::Api nvjpeg_api;
  nvjpeg::Handle nvjpeg_handle = nullptr;
  unsigned nvjpeg_flags = 0;
  // Recorded on a ring's stream after each nvjpegDecodeBatched on this GPU (copy thread
  // only): the next call, of any ring, waits on the host for it (CudaRing::DecodeJpegs; a
  // wait on an event never recorded returns at once).
  cuda::Event nvjpeg_done;

  // Creates the nvJPEG handle: the hardware backend where the GPU has JPEG engines, else the
  // GPU-hybrid one. Once; later calls return the first outcome.
  absl::Status InitNvjpeg();
  // Rings own memory on this GPU and record it here against the budget.
  uint64_t budget = 0;
};

// A ring of `slots` x `stride` bytes on `gpu`, plus `scratch_bytes` twice for staged batches.
absl::StatusOr<std::unique_ptr<DeviceRing>> AllocateCudaRing(Gpu* gpu, int slots,
                                                             uint64_t stride, IpcKind ipc,
                                                             uint64_t scratch_bytes);

}  // namespace gpufeed::server
