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
#include "common/progress.h"
#include "server/augment/augment_pixel.h"
#include "server/augment/output.h"
#include "server/augment/staged.h"

namespace gpufeed::server {

enum class IpcKind { kUnspecified = 0, kVmm = 1, kLegacy = 2 };

// What a consumer needs to map a device ring and wait on its slots.
struct DeviceRingExport {
  IpcKind ipc = IpcKind::kVmm;
  std::string gpu_uuid;
  bool mps = false;  // the daemon's work on this GPU goes through MPS
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

// One session's ring of slots in one GPU's memory, with its own CUDA stream (and nvJPEG
// decoder state), so one session's GPU work never queues behind another's. Every method but
// the destructor runs on the GPU's copy thread, except WaitCopied (a reader thread). Nothing
// a ring enqueues ever waits on another process: a consumer's release is polled (Released)
// before its slot is written again, so the ring's stream holds only the daemon's own work and
// every host wait on it is bounded. The destructor waits for that work and frees the memory
// (a consumer's VMM mapping keeps it alive until unmapped).
class DeviceRing {
 public:
  virtual ~DeviceRing() = default;
  virtual const DeviceRingExport& exported() const = 0;
  // A new descriptor of the exported allocation, for the memory socket (kVmm only).
  virtual absl::StatusOr<UniqueFd> ExportFd() const = 0;
  // Opens the consumer's per-slot release events.
  virtual absl::Status SetReleaseEvents(const std::vector<std::string>& handles) = 0;
  // Whether the consumer's GPU work that read `slot` is done (its release event completed;
  // true when it gave none). Never blocks: the copy thread polls it before reusing a slot.
  virtual absl::StatusOr<bool> Released(int slot) = 0;
  // Enqueues the copy of `bytes` from pinned `src` into the slot, then the slot's ready event.
  // The slot must be Released. Returns without waiting for the copy.
  virtual absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes) = 0;
  // Enqueues one staged batch of `count` rows (augment/staged.h) from the pinned host slot
  // `host`: the labels and kFinal rows copied into the slot; kRaw pixels copied to the ring's
  // scratch and kJpeg files decoded there by nvJPEG; the kernel into the slot for both. Writes
  // the kernel's tasks into the host slot's task area. The slot must be Released.
  // Returns the rows nvJPEG refused (a corrupt file it cannot say which of): empty, and the
  // slot's ready event is recorded; otherwise the caller finishes those rows on the CPU (on a
  // worker, never on the copy thread) and hands them to FinishRows, which records it.
  virtual absl::StatusOr<std::vector<int>> StageIn(int slot, std::byte* host,
                                                   const StagedLayout& layout, int count,
                                                   const StagedOutput& output) {
    return absl::UnimplementedError("this device backend has no GPU augmentation");
  }
  // Copies finished image rows (rows.size() x output.image_row_bytes, in `images`) and their
  // labels over the rows StageIn left, then records the slot's ready event.
  virtual absl::Status FinishRows(int slot, const StagedOutput& output,
                                  const std::vector<int>& rows,
                                  const std::vector<std::byte>& images,
                                  const std::vector<int64_t>& labels) {
    return absl::UnimplementedError("this device backend has no GPU augmentation");
  }
  // Blocks until the last copy into `slot` has read its source (before the source is
  // refilled). Bounded: the ring's stream never waits on a consumer.
  virtual absl::Status WaitCopied(int slot) = 0;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  // UUIDs ("GPU-...") of the GPUs this daemon serves; empty without GPU or driver.
  virtual std::vector<std::string> gpu_uuids() const = 0;
  // The GPUs whose contexts this process shares through MPS (docs/ARCHITECTURE.md, "MPS").
  virtual std::vector<std::string> mps_gpu_uuids() const { return {}; }
  // A ring of `slots` x `stride` bytes on the GPU `gpu_uuid`, plus private device memory for
  // StageIn (the CUDA backend keeps two buffers of `scratch_bytes`, used in turn). FAILED_PRECONDITION without GPUs, NOT_FOUND for an
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
  // Runs `work` on that GPU's copy thread after a short poll interval (about 100 us), after
  // the work posted before it: how the copy thread waits for a consumer's release without
  // blocking the other sessions on its GPU. Never drops it.
  virtual void PostLater(const std::string& gpu_uuid, std::function<void()> work) = 0;
  // The copy threads' progress marks, for the liveness check (common/progress.h).
  virtual std::vector<const BusyMark*> busy_marks() const { return {}; }
};

// The message of a device Attach on a daemon that sees no GPU.
inline constexpr char kNoGpuMessage[] = "no CUDA device visible to gpufeedd";

}  // namespace gpufeed::server
