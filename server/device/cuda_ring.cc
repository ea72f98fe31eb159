#include "server/device/cuda_ring.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda/cuda.h"
#include "common/cuda/owners.h"
#include "common/os/fd.h"
#include "common/status.h"
#include "server/device/augment_kernel.h"
#include "server/device/staged_records.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {

absl::Status Gpu::InitNvjpeg() {
    absl::MutexLock lock(&nvjpeg_mu);
    if (nvjpeg_tried) return nvjpeg_status;
    nvjpeg_tried = true;
    absl::StatusOr<nvjpeg::Api> loaded = nvjpeg::Load(options->nvjpeg_library);
    if (!loaded.ok()) return nvjpeg_status = loaded.status();
    nvjpeg_api = *loaded;
    const nvjpeg::Api* api = &nvjpeg_api;
    cuda::DeviceGuard guard(ordinal);
    // Chroma upsampling by interpolation, as libjpeg-turbo's default ("fancy") upsampling
    // does, where the library takes the flag; the hardware backend where the GPU has JPEG
    // engines, else the GPU-hybrid one.
    struct Choice {
      nvjpeg::Backend backend;
      unsigned flags;
      const char* name;
    };
    const Choice choices[] = {
        {nvjpeg::kHardware, nvjpeg::kFlagUpsamplingWithInterpolation, "hardware"},
        {nvjpeg::kHardware, 0, "hardware"},
        {nvjpeg::kGpuHybrid, nvjpeg::kFlagUpsamplingWithInterpolation, "GPU-hybrid"},
        {nvjpeg::kGpuHybrid, 0, "GPU-hybrid"}};
    const bool interpolate = options->nvjpeg_interpolation;
    const char* backend = "";
    int rc = -1;
    for (const Choice& c : choices) {
      if (!interpolate && c.flags != 0) continue;
      rc = api->CreateEx(c.backend, nullptr, nullptr, c.flags, &nvjpeg_handle);
      if (rc == 0) {
        backend = c.name;
        nvjpeg_flags = c.flags;
        break;
      }
    }
    if (rc != 0) {
      if (nvjpeg_handle != nullptr) api->Destroy(nvjpeg_handle);
      nvjpeg_handle = nullptr;
      return nvjpeg_status = absl::FailedPreconditionError(absl::StrCat(
          "decode: nvJPEG (", api->library, ") on ", uuid, ": ", nvjpeg::StatusName(rc)));
    }
    absl::StatusOr<cuda::Event> done = cuda::CreateEvent(ordinal, cudaEventDisableTiming);
    if (!done.ok()) {
      api->Destroy(std::exchange(nvjpeg_handle, nullptr));
      return nvjpeg_status = done.status();
    }
    nvjpeg_done = *std::move(done);
    nvjpeg = api;
    spdlog::info("GPU {} {}: nvJPEG {} backend from {}{}", ordinal, uuid, backend, nvjpeg->library,
                 nvjpeg_flags != 0 ? ", chroma upsampling by interpolation" : "");
    return nvjpeg_status = absl::OkStatus();
  }

namespace {

class CudaRing final : public DeviceRing {
 public:
  explicit CudaRing(Gpu* gpu) : gpu_(gpu) {}

  ~CudaRing() override {
    // Work this ring enqueued must be done before its memory goes (an error path of StageIn
    // can leave a kernel or copy queued without a ready event after it). Bounded: the ring's
    // stream holds only the daemon's own copies, decodes and kernels. The owners below then
    // free the rest, whatever the member order.
    if (stream_) {
      cuda::DeviceGuard guard(gpu_->ordinal);
      cudaStreamSynchronize(stream_.get());
    }
    if (charged_ > 0) {
      absl::MutexLock lock(&gpu_->mu);
      gpu_->used -= charged_;
    }
  }

  absl::Status Allocate(int slots, uint64_t stride, IpcKind ipc, uint64_t scratch_bytes) {
    const int device = gpu_->ordinal;
    export_.gpu_uuid = gpu_->uuid;
    export_.mps = gpu_->mps;
    export_.ipc = ipc == IpcKind::kUnspecified ? (gpu_->vmm ? IpcKind::kVmm : IpcKind::kLegacy)
                                               : ipc;
    if (export_.ipc == IpcKind::kVmm && !gpu_->vmm) {
      return absl::FailedPreconditionError(absl::StrCat(
          "delivery.ipc: ", gpu_->uuid, " does not export VMM memory as POSIX fds; use legacy"));
    }
    stride_ = stride;
    uint64_t bytes = stride * static_cast<uint64_t>(slots);
    if (export_.ipc == IpcKind::kVmm) {
      GPUFEED_ASSIGN_OR_RETURN(bytes, cuda::VmmAllocation::RoundUp(device, bytes));
    }
    // Two scratch buffers, used in turn: a batch's decode waits (on the host) only for the
    // kernel of the batch before last, long done, instead of the one just launched.
    const uint64_t all_scratch = 2 * scratch_bytes;
    {
      absl::MutexLock lock(&gpu_->mu);
      if (gpu_->used + bytes + all_scratch > gpu_->budget) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "device ring of ", bytes, " bytes", all_scratch > 0 ? " and scratch of " : "",
            all_scratch > 0 ? absl::StrCat(all_scratch, " bytes") : "", " on ", gpu_->uuid,
            ": ", gpu_->budget - gpu_->used, " of the GPU's --device_bytes budget of ",
            gpu_->budget, " bytes are free"));
      }
      gpu_->used += bytes + all_scratch;
      charged_ = bytes + all_scratch;
    }
    GPUFEED_ASSIGN_OR_RETURN(stream_, cuda::CreateStream(device, cudaStreamNonBlocking,
                                                         gpu_->lowest_priority));
    for (Scratch& sc : scratch_) {
      GPUFEED_ASSIGN_OR_RETURN(sc.free, cuda::CreateEvent(device, cudaEventDisableTiming));
      if (scratch_bytes > 0) {
        GPUFEED_ASSIGN_OR_RETURN(sc.data, cuda::Malloc(device, scratch_bytes));
      }
    }
    export_.alloc_bytes = bytes;
    if (export_.ipc == IpcKind::kVmm) {
      GPUFEED_ASSIGN_OR_RETURN(vmm_, cuda::VmmAllocation::Create(device, bytes));
      GPUFEED_ASSIGN_OR_RETURN(const int fd, vmm_.ExportFd());
      export_fd_.Reset(fd);
      base_ = static_cast<std::byte*>(vmm_.data());
    } else {
      GPUFEED_ASSIGN_OR_RETURN(legacy_, cuda::Malloc(device, bytes));
      cuda::DeviceGuard guard(device);
      cudaIpcMemHandle_t handle;
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaIpcGetMemHandle(&handle, legacy_.get()), "cudaIpcGetMemHandle"));
      export_.legacy_mem_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      base_ = static_cast<std::byte*>(legacy_.get());
    }
    release_.resize(static_cast<size_t>(slots));
    for (int i = 0; i < slots; ++i) {
      GPUFEED_ASSIGN_OR_RETURN(
          cuda::Event e,
          cuda::CreateEvent(device, cudaEventDisableTiming | cudaEventInterprocess));
      cuda::DeviceGuard guard(device);
      cudaIpcEventHandle_t handle;
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaIpcGetEventHandle(&handle, e.get()), "cudaIpcGetEventHandle"));
      export_.ready_event_handles.emplace_back(reinterpret_cast<const char*>(&handle),
                                               sizeof(handle));
      ready_.push_back(std::move(e));
    }
    return absl::OkStatus();
  }

  const DeviceRingExport& exported() const override { return export_; }

  absl::StatusOr<UniqueFd> ExportFd() const override {
    if (!export_fd_.valid()) return absl::FailedPreconditionError("ring is not a VMM export");
    UniqueFd fd(::dup(export_fd_.get()));
    if (!fd.valid()) return ErrnoToStatus(errno, "dup of the ring's export");
    return fd;
  }

  absl::Status SetReleaseEvents(const std::vector<std::string>& handles) override {
    for (size_t i = 0; i < handles.size() && i < release_.size(); ++i) {
      if (handles[i].size() != sizeof(cudaIpcEventHandle_t)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "release_event_handles[", i, "]: want ", sizeof(cudaIpcEventHandle_t), " bytes, got ",
            handles[i].size()));
      }
      cudaIpcEventHandle_t handle;
      std::memcpy(&handle, handles[i].data(), sizeof(handle));
      absl::StatusOr<cuda::Event> e = cuda::OpenIpcEvent(gpu_->ordinal, handle);
      if (!e.ok()) return Annotate(e.status(), absl::StrCat("opening release event of slot ", i));
      release_[i] = *std::move(e);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Released(int slot) override {
    const cuda::Event& e = release_[static_cast<size_t>(slot)];
    if (!e) return true;
    cuda::DeviceGuard guard(gpu_->ordinal);
    const cudaError_t done = cudaEventQuery(e.get());
    if (done == cudaErrorNotReady) return false;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(done, "querying the consumer's release event"));
    return true;
  }

  absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    const size_t k = static_cast<size_t>(slot);
    GPUFEED_RETURN_IF_ERROR(Upload(base_ + k * stride_, src, bytes));
    return cuda::Check(cudaEventRecord(ready_[k].get(), stream_.get()), "recording the ready event");
  }

  absl::StatusOr<std::vector<int>> StageIn(int slot, std::byte* host, const StagedLayout& layout,
                                           int count, const StagedOutput& output) override {
    // Records copied out of the slot and bounds-checked before anything acts on them; only
    // the checked copy is used below (docs/SECURITY.md section 3).
    GPUFEED_ASSIGN_OR_RETURN(const std::vector<StagedRecord> records,
                             ReadStagedRecords(host, layout, count, output));
    cuda::DeviceGuard guard(gpu_->ordinal);
    const size_t k = static_cast<size_t>(slot);
    std::byte* dst = base_ + k * stride_;
    GPUFEED_RETURN_IF_ERROR(Upload(dst + output.label_offset, host + layout.labels_offset,
                                   static_cast<uint64_t>(count) * sizeof(int64_t)));
    // At most `count` <= batch tasks: within the slot's task area.
    auto* tasks = reinterpret_cast<AugmentTask*>(host + layout.tasks_offset);
    const std::byte* arena = host + layout.arena_offset;
    Scratch& sc = scratch_[next_scratch_];
    next_scratch_ ^= 1;
    auto* scratch = static_cast<std::byte*>(sc.data.get());
    int n = 0;
    std::vector<int> jpeg_rows;
    // kRaw pixels: one copy per run of records adjacent on both sides.
    uint64_t run_host = 0, run_device = 0, run_bytes = 0;
    auto flush = [&]() -> absl::Status {
      if (run_bytes == 0) return absl::OkStatus();
      absl::Status s = Upload(scratch + run_device, arena + run_host, run_bytes);
      run_bytes = 0;
      return s;
    };
    for (int i = 0; i < count; ++i) {
      const StagedRecord& r = records[static_cast<size_t>(i)];
      if (r.kind == StagedKind::kFinal) {
        GPUFEED_RETURN_IF_ERROR(Upload(dst + output.image_offset + i * output.image_row_bytes,
                                       arena + r.host_offset, output.image_row_bytes));
        continue;
      }
      if (r.kind == StagedKind::kRaw) {
        if (run_bytes > 0 && run_host + run_bytes == r.host_offset &&
            run_device + run_bytes == r.device_offset) {
          run_bytes += r.host_bytes;
        } else {
          GPUFEED_RETURN_IF_ERROR(flush());
          run_host = r.host_offset;
          run_device = r.device_offset;
          run_bytes = r.host_bytes;
        }
      } else {
        jpeg_rows.push_back(i);
      }
      AugmentTask& t = tasks[n++];
      t.src_offset = r.device_offset;
      t.src_pitch = r.geometry.src_width * 3;
      t.row = i;
      t.geometry = r.geometry;
    }
    GPUFEED_RETURN_IF_ERROR(flush());
    std::vector<int> refused;
    if (!jpeg_rows.empty() && !DecodeJpegs(sc, records.data(), arena, jpeg_rows).ok()) {
      // nvJPEG refused the batch (a corrupt file it cannot say which of): a worker redoes its
      // JPEG rows on the CPU and FinishRows writes them over what the kernel left there.
      refused = jpeg_rows;
    }
    if (n > 0) {
      GPUFEED_RETURN_IF_ERROR(
          Upload(scratch, tasks, static_cast<uint64_t>(n) * sizeof(AugmentTask)));
      const AugmentOutput out = ToAugmentOutput(layout, output);
      GPUFEED_RETURN_IF_ERROR(cuda::Check(
          LaunchAugment(reinterpret_cast<const AugmentTask*>(scratch), n, out,
                        reinterpret_cast<const uint8_t*>(scratch), reinterpret_cast<uint8_t*>(dst),
                        stream_.get()),
          "launching the augment kernel"));
      // The next decode into the scratch waits (on the host) for this kernel's reads.
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaEventRecord(sc.free.get(), stream_.get()), "recording the scratch's event"));
    }
    if (!refused.empty()) return refused;
    GPUFEED_RETURN_IF_ERROR(
        cuda::Check(cudaEventRecord(ready_[k].get(), stream_.get()), "recording the ready event"));
    return refused;
  }

  absl::Status FinishRows(int slot, const StagedOutput& output, const std::vector<int>& rows,
                          const std::vector<std::byte>& images,
                          const std::vector<int64_t>& labels) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    const size_t k = static_cast<size_t>(slot);
    std::byte* dst = base_ + k * stride_;
    if (images.size() != rows.size() * output.image_row_bytes || labels.size() != rows.size()) {
      return absl::InternalError("FinishRows: rows, images and labels disagree in size");
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      // From pageable memory: cudaMemcpyAsync returns once it has taken the bytes.
      GPUFEED_RETURN_IF_ERROR(Upload(dst + output.image_offset + rows[i] * output.image_row_bytes,
                                     images.data() + i * output.image_row_bytes,
                                     output.image_row_bytes));
      GPUFEED_RETURN_IF_ERROR(Upload(dst + output.label_offset + rows[i] * sizeof(int64_t),
                                     &labels[i], sizeof(int64_t)));
    }
    return cuda::Check(cudaEventRecord(ready_[k].get(), stream_.get()), "recording the ready event");
  }

  absl::Status WaitCopied(int slot) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    return cuda::Check(cudaEventSynchronize(ready_[static_cast<size_t>(slot)].get()),
                       "waiting for the copy to the GPU");
  }

 private:
  struct Scratch {
    cuda::DeviceBuffer data;
    cuda::Event free;  // recorded after each kernel that reads it
  };

  Gpu* const gpu_;
  uint64_t charged_ = 0;
  uint64_t stride_ = 0;
  DeviceRingExport export_;
  UniqueFd export_fd_;
  std::byte* base_ = nullptr;
  // Owners, released in reverse order after the destructor's stream synchronisation.
  cuda::Stream stream_;
  cuda::VmmAllocation vmm_;
  cuda::DeviceBuffer legacy_;
  std::vector<cuda::Event> ready_;
  std::vector<cuda::Event> release_;  // opened from the consumer's IPC handles
  Scratch scratch_[2];
  int next_scratch_ = 0;
  nvjpeg::UniqueState nvjpeg_state_;
  int nvjpeg_batch_ = 0;  // the batch size nvjpegDecodeBatchedInitialize was last given

  absl::Status Upload(void* to, const void* from, uint64_t bytes) {
    return cuda::Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream_.get()),
                       "copy to the GPU");
  }

  // nvJPEG's batched decode of the JPEG records `rows` into their places in the scratch.
  absl::Status DecodeJpegs(const Scratch& sc, const StagedRecord* records, const std::byte* arena,
                           const std::vector<int>& rows) {
    GPUFEED_RETURN_IF_ERROR(gpu_->InitNvjpeg());
    const nvjpeg::Api* api = gpu_->nvjpeg;
    const int n = static_cast<int>(rows.size());
    std::vector<const unsigned char*> data(rows.size());
    std::vector<size_t> lengths(rows.size());
    std::vector<nvjpeg::Image> images(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const StagedRecord& r = records[rows[i]];
      data[i] = reinterpret_cast<const unsigned char*>(arena + r.host_offset);
      lengths[i] = r.host_bytes;
      images[i] = {};
      images[i].channel[0] = static_cast<unsigned char*>(sc.data.get()) + r.device_offset;
      images[i].pitch[0] = static_cast<size_t>(r.geometry.src_width) * 3;
    }
    int rc = 0;
    if (!nvjpeg_state_) {
      absl::StatusOr<nvjpeg::UniqueState> state = nvjpeg::UniqueState::Create(api, gpu_->nvjpeg_handle, gpu_->ordinal);
      if (state.ok()) nvjpeg_state_ = *std::move(state);
      rc = state.ok() ? 0 : -1;
    }
    // nvJPEG's hardware backend writes its output when nvjpegDecodeBatched is called, not in
    // the order of the work already queued on the stream it is given (public reports against
    // nvJPEG 12.3-13.2; a stream-side wait does not help). The last kernel on this buffer may
    // still be reading this scratch: wait for it here, on the host. Bounded: the ring's stream
    // holds only our own work, never a wait on a consumer.
    if (rc == 0) {
      rc = cudaEventSynchronize(sc.free.get()) == cudaSuccess ? 0 : -1;
    }
    // Nor may a call start before the stream work of the one before it is done, on any ring
    // of this GPU: nvJPEG 13.0's back-to-back batched calls of some sizes make
    // nvjpegDecodeBatched spin for ever (the engines idle), where the same calls with a stream
    // synchronisation after each never do (measured: docs/benchmarks.md, section nvJPEG's
    // back-to-back stall). Bounded as above: our own stream work.
    if (rc == 0) {
      rc = cudaEventSynchronize(gpu_->nvjpeg_done.get()) == cudaSuccess ? 0 : -1;
    }
    if (rc == 0 && nvjpeg_batch_ != n) {
      rc = api->DecodeBatchedInitialize(gpu_->nvjpeg_handle, nvjpeg_state_.get(), n, 1,
                                        nvjpeg::kRgbInterleaved);
      nvjpeg_batch_ = rc == 0 ? n : 0;
    }
    if (rc == 0) {
      rc = api->DecodeBatched(gpu_->nvjpeg_handle, nvjpeg_state_.get(), data.data(),
                              lengths.data(), images.data(), stream_.get());
      // Whatever it returned (a corrupt file fails the call): what it queued is waited for.
      const int recorded =
          cudaEventRecord(gpu_->nvjpeg_done.get(), stream_.get()) == cudaSuccess ? 0 : -1;
      if (rc == 0) rc = recorded;
    }
    if (rc != 0) {
      spdlog::warn("nvJPEG batch of {} on {}: {}; decoding those on the CPU", n, gpu_->uuid,
                   nvjpeg::StatusName(rc));
      nvjpeg_batch_ = 0;  // re-initialise next time
      return absl::DataLossError(nvjpeg::StatusName(rc));
    }
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRing>> AllocateCudaRing(Gpu* gpu, int slots,
                                                             uint64_t stride, IpcKind ipc,
                                                             uint64_t scratch_bytes) {
  auto ring = std::make_unique<CudaRing>(gpu);
  GPUFEED_RETURN_IF_ERROR(ring->Allocate(slots, stride, ipc, scratch_bytes));
  return std::unique_ptr<DeviceRing>(std::move(ring));
}

}  // namespace gpufeed::server
