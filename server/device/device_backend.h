// GPUs as the daemon sees them: device rings (one per device-delivery session), one copy
// thread and stream per GPU, and a byte budget per GPU. An interface, so the session logic
// is tested on machines without a GPU (tests/testing/fake_device_backend.h) and the CUDA
// implementation (cuda_backend.cc) is the only code that touches the driver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/os/fd.h"
#include "server/augment/output.h"
#include "server/augment/staged.h"
#include "server/device/augment_pixel.h"

namespace gpufeed::server {

enum class IpcKind { kUnspecified = 0, kVmm = 1, kLegacy = 2 };

// What a consumer needs to map a device ring and wait on its slots.
struct DeviceRingExport {
  IpcKind ipc = IpcKind::kVmm;
  std::string gpu_uuid;
  uint64_t alloc_bytes = 0;
  std::string legacy_mem_handle;                 // kLegacy: cudaIpcMemHandle_t bytes
  std::vector<std::string> ready_event_handles;  // per slot: cudaIpcEventHandle_t bytes
};

// Where a staged batch's results go in a device slot (their form is in the StagedLayout).
struct StagedOutput {
  uint64_t image_offset = 0;     // the image tensor, from the slot's start
  uint64_t image_row_bytes = 0;  // one image
  uint64_t label_offset = 0;     // the label tensor (int64 per row)
};

// The kernel's view of a staged batch's output.
inline AugmentOutput ToAugmentOutput(const StagedLayout& layout, const StagedOutput& output) {
  AugmentOutput out;
  out.height = layout.out_height;
  out.width = layout.out_width;
  switch (layout.output.dtype) {
    case DType::kFloat16: out.dtype = AugmentDType::kFloat16; break;
    case DType::kBFloat16: out.dtype = AugmentDType::kBFloat16; break;
    case DType::kFloat32: out.dtype = AugmentDType::kFloat32; break;
    default: out.dtype = AugmentDType::kUInt8; break;
  }
  out.nchw = layout.output.layout == Layout::kNCHW;
  const ChannelAffine affine = OutputAffine(layout.output);
  for (int c = 0; c < 3; ++c) {
    out.scale[c] = affine.scale[c];
    out.bias[c] = affine.bias[c];
  }
  out.image_offset = output.image_offset;
  out.row_bytes = output.image_row_bytes;
  return out;
}

// Rewrites the finished image row `row` into `image` (image_row_bytes) and its `label` when
// the GPU could not decode its file: the CPU path, with the feed's bad-image policy (a
// replacement sample has its own label). Runs on the copy thread.
using RedoRow = std::function<absl::Status(int row, std::byte* image, int64_t* label)>;

// One session's ring of slots in one GPU's memory. CopyIn, SetReleaseEvents and WaitCopied
// run on that GPU's copy thread or a reader thread; the destructor waits for copies in
// flight and frees the device memory (a consumer's VMM mapping keeps it alive until unmapped).
class DeviceRing {
 public:
  virtual ~DeviceRing() = default;
  virtual const DeviceRingExport& exported() const = 0;
  // A new descriptor of the exported allocation, for the memory socket (kVmm only).
  virtual absl::StatusOr<UniqueFd> ExportFd() const = 0;
  // Opens the consumer's per-slot release events.
  virtual absl::Status SetReleaseEvents(const std::vector<std::string>& handles) = 0;
  // Enqueues on the GPU's copy stream: when `reused`, a wait for the consumer's release event
  // of `slot`; the copy of `bytes` from pinned `src` into the slot; the slot's ready event.
  // Returns without waiting for the copy.
  virtual absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes, bool reused) = 0;
  // Enqueues one staged batch of `count` rows (augment/staged.h) from the pinned host slot
  // `host` on the GPU's copy stream: when `reused`, the wait for the consumer's release of
  // `slot`; the labels and kFinal rows copied into the slot; kRaw pixels copied to the ring's
  // scratch and kJpeg files decoded there by nvJPEG; the kernel into the slot for both; the
  // rows nvJPEG could not decode rewritten through `redo`; the slot's ready event. Writes the
  // kernel's tasks into the host slot's task area. Returns without waiting for the GPU.
  virtual absl::Status StageIn(int slot, std::byte* host, const StagedLayout& layout, int count,
                               const StagedOutput& output, bool reused, const RedoRow& redo) {
    return absl::UnimplementedError("this device backend has no GPU augmentation");
  }
  // Blocks until the last copy into `slot` has read its source (before the source is refilled).
  virtual absl::Status WaitCopied(int slot) = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // UUIDs ("GPU-...") of the GPUs this daemon serves; empty without GPU or driver.
  virtual std::vector<std::string> gpu_uuids() const = 0;
  // A ring of `slots` x `stride` bytes on the GPU `gpu_uuid`, plus `scratch_bytes` of
  // private device memory for StageIn. FAILED_PRECONDITION without GPUs, NOT_FOUND for an
  // unknown UUID, RESOURCE_EXHAUSTED beyond the GPU's byte budget.
  virtual absl::StatusOr<std::unique_ptr<DeviceRing>> AllocateRing(const std::string& gpu_uuid,
                                                                   int slots, uint64_t stride,
                                                                   IpcKind ipc,
                                                                   uint64_t scratch_bytes) = 0;
  // OK when StageIn can decode JPEGs with nvJPEG on `gpu_uuid`; FAILED_PRECONDITION saying
  // why not (no library, no GPU).
  virtual absl::Status NvjpegStatus(const std::string& gpu_uuid) {
    return absl::FailedPreconditionError("decode: this device backend has no nvJPEG");
  }
  // False after an error that broke a GPU's CUDA context for good (readiness goes NOT_SERVING).
  virtual bool healthy() const { return true; }
  // Whether StageIn works at all (the fused kernel is built in).
  virtual bool can_stage() const { return false; }
  // Per GPU: the bytes its rings and scratch hold, and the --device_bytes budget.
  struct GpuMemory {
    std::string uuid;
    uint64_t used = 0;
    uint64_t budget = 0;
  };
  virtual std::vector<GpuMemory> memory() const { return {}; }
  // Runs `work` on that GPU's copy thread, in order; never drops it (runs it inline once the
  // thread is gone).
  virtual void Post(const std::string& gpu_uuid, std::function<void()> work) = 0;
};

// The message of a device Attach on a daemon that sees no GPU.
inline constexpr char kNoGpuMessage[] = "no CUDA device visible to gpufeedd";

}  // namespace gpufeed::server
