#include "server/device/cuda_backend.h"

#include <pthread.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda.h"
#include "common/status.h"
#include "server/device/augment_kernel.h"
#include "server/device/copy_thread.h"
#include "server/device/nvjpeg.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

class CudaBackend;

// One GPU: its copy thread, its nvJPEG handle and the bytes its rings hold. Each ring has its
// own stream and decoder state (CudaRing).
struct Gpu {
  int ordinal = 0;
  std::string uuid;
  bool vmm = false;
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

  // Creates the nvJPEG handle and state: the hardware backend where the GPU has JPEG
  // engines, else the GPU-hybrid one.
  absl::Status InitNvjpeg() {
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
    nvjpeg = api;
    spdlog::info("GPU {} {}: nvJPEG {} backend from {}{}", ordinal, uuid, backend, nvjpeg->library,
                 nvjpeg_flags != 0 ? ", chroma upsampling by interpolation" : "");
    return nvjpeg_status = absl::OkStatus();
  }
};

class CudaRing final : public DeviceRing {
 public:
  CudaRing(Gpu* gpu, uint64_t budget_bytes) : gpu_(gpu), budget_(budget_bytes) {}

  ~CudaRing() override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    // Work this ring enqueued must be done before its memory goes (an error path of StageIn
    // can leave a kernel or copy queued without a ready event after it). Bounded: the ring's
    // stream holds only the daemon's own copies, decodes and kernels.
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (nvjpeg_state_ != nullptr) gpu_->nvjpeg->JpegStateDestroy(nvjpeg_state_);
    for (Scratch& sc : scratch_) {
      if (sc.free != nullptr) cudaEventDestroy(sc.free);
      if (sc.data != nullptr) cudaFree(sc.data);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    for (cudaEvent_t e : ready_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : release_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (vmm_ptr_ != 0) {
      const cuda::DriverApi* api = *cuda::Driver();
      api->cuMemUnmap(vmm_ptr_, export_.alloc_bytes);
      api->cuMemAddressFree(vmm_ptr_, export_.alloc_bytes);
      api->cuMemRelease(vmm_handle_);
    }
    if (legacy_ptr_ != nullptr) cudaFree(legacy_ptr_);
    if (charged_ > 0) {
      absl::MutexLock lock(&gpu_->mu);
      gpu_->used -= charged_;
    }
  }

  absl::Status Allocate(int slots, uint64_t stride, IpcKind ipc, uint64_t scratch_bytes) {
    cuda::DeviceGuard guard(gpu_->ordinal);
    GPUFEED_RETURN_IF_ERROR(cuda::Check(
        cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, gpu_->lowest_priority),
        absl::StrCat("creating a ring's stream on ", gpu_->uuid)));
    for (Scratch& sc : scratch_) {
      GPUFEED_RETURN_IF_ERROR(cuda::Check(
          cudaEventCreateWithFlags(&sc.free, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
    }
    // Two scratch buffers, used in turn: a batch's decode waits (on the host) only for the
    // kernel of the batch before last, long done, instead of the one just launched.
    const uint64_t all_scratch = 2 * scratch_bytes;
    export_.gpu_uuid = gpu_->uuid;
    export_.ipc = ipc == IpcKind::kUnspecified ? (gpu_->vmm ? IpcKind::kVmm : IpcKind::kLegacy)
                                               : ipc;
    if (export_.ipc == IpcKind::kVmm && !gpu_->vmm) {
      return absl::FailedPreconditionError(absl::StrCat(
          "delivery.ipc: ", gpu_->uuid, " does not export VMM memory as POSIX fds; use legacy"));
    }
    stride_ = stride;
    uint64_t bytes = stride * static_cast<uint64_t>(slots);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu_->ordinal;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    const cuda::DriverApi* api = nullptr;
    if (export_.ipc == IpcKind::kVmm) {
      GPUFEED_ASSIGN_OR_RETURN(api, cuda::Driver());
      size_t granularity = 0;
      GPUFEED_RETURN_IF_ERROR(cuda::Check(
          api->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
          "cuMemGetAllocationGranularity"));
      bytes = (bytes + granularity - 1) / granularity * granularity;
    }
    {
      absl::MutexLock lock(&gpu_->mu);
      if (gpu_->used + bytes + all_scratch > budget_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "device ring of ", bytes, " bytes", all_scratch > 0 ? " and scratch of " : "",
            all_scratch > 0 ? absl::StrCat(all_scratch, " bytes") : "", " on ", gpu_->uuid,
            ": ", budget_ - gpu_->used, " of the GPU's --device_bytes budget of ", budget_,
            " bytes are free"));
      }
      gpu_->used += bytes + all_scratch;
      charged_ = bytes + all_scratch;
    }
    for (Scratch& sc : scratch_) {
      if (scratch_bytes == 0) break;
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaMalloc(&sc.data, scratch_bytes), "cudaMalloc of the ring's scratch"));
    }
    export_.alloc_bytes = bytes;
    if (export_.ipc == IpcKind::kVmm) {
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(api->cuMemCreate(&vmm_handle_, bytes, &prop, 0), "cuMemCreate"));
      CUdeviceptr ptr = 0;
      absl::Status s = cuda::Check(api->cuMemAddressReserve(&ptr, bytes, 0, 0, 0),
                                   "cuMemAddressReserve");
      if (s.ok()) s = cuda::Check(api->cuMemMap(ptr, bytes, 0, vmm_handle_, 0), "cuMemMap");
      if (!s.ok()) {
        if (ptr != 0) api->cuMemAddressFree(ptr, bytes);
        api->cuMemRelease(vmm_handle_);
        return s;
      }
      vmm_ptr_ = ptr;
      CUmemAccessDesc access{};
      access.location = prop.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(api->cuMemSetAccess(ptr, bytes, &access, 1), "cuMemSetAccess"));
      int fd = -1;
      GPUFEED_RETURN_IF_ERROR(cuda::Check(
          api->cuMemExportToShareableHandle(&fd, vmm_handle_,
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle"));
      export_fd_.Reset(fd);
      base_ = reinterpret_cast<std::byte*>(ptr);  // NOLINT(performance-no-int-to-ptr): a CUdeviceptr
    } else {
      GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaMalloc(&legacy_ptr_, bytes), "cudaMalloc"));
      cudaIpcMemHandle_t handle;
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaIpcGetMemHandle(&handle, legacy_ptr_), "cudaIpcGetMemHandle"));
      export_.legacy_mem_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
      base_ = static_cast<std::byte*>(legacy_ptr_);
    }
    ready_.assign(static_cast<size_t>(slots), nullptr);
    release_.assign(static_cast<size_t>(slots), nullptr);
    for (cudaEvent_t& e : ready_) {
      GPUFEED_RETURN_IF_ERROR(cuda::Check(
          cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess),
          "cudaEventCreateWithFlags"));
      cudaIpcEventHandle_t handle;
      GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaIpcGetEventHandle(&handle, e), "cudaIpcGetEventHandle"));
      export_.ready_event_handles.emplace_back(reinterpret_cast<const char*>(&handle),
                                               sizeof(handle));
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
    cuda::DeviceGuard guard(gpu_->ordinal);
    for (size_t i = 0; i < handles.size() && i < release_.size(); ++i) {
      if (handles[i].size() != sizeof(cudaIpcEventHandle_t)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "release_event_handles[", i, "]: want ", sizeof(cudaIpcEventHandle_t), " bytes, got ",
            handles[i].size()));
      }
      cudaIpcEventHandle_t handle;
      std::memcpy(&handle, handles[i].data(), sizeof(handle));
      GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaIpcOpenEventHandle(&release_[i], handle),
                                          absl::StrCat("opening release event of slot ", i)));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Released(int slot) override {
    cudaEvent_t e = release_[static_cast<size_t>(slot)];
    if (e == nullptr) return true;
    cuda::DeviceGuard guard(gpu_->ordinal);
    const cudaError_t done = cudaEventQuery(e);
    if (done == cudaErrorNotReady) return false;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(done, "querying the consumer's release event"));
    return true;
  }

  absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    const size_t k = static_cast<size_t>(slot);
    GPUFEED_RETURN_IF_ERROR(cuda::Check(
        cudaMemcpyAsync(base_ + k * stride_, src, bytes, cudaMemcpyHostToDevice, stream_),
        "copy to the GPU"));
    return cuda::Check(cudaEventRecord(ready_[k], stream_), "recording the ready event");
  }

  absl::StatusOr<std::vector<int>> StageIn(int slot, std::byte* host, const StagedLayout& layout,
                                           int count, const StagedOutput& output) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    const size_t k = static_cast<size_t>(slot);
    std::byte* dst = base_ + k * stride_;
    GPUFEED_RETURN_IF_ERROR(Upload(dst + output.label_offset, host + layout.labels_offset,
                                   static_cast<uint64_t>(count) * sizeof(int64_t)));
    const auto* records = reinterpret_cast<const StagedRecord*>(host + layout.records_offset);
    auto* tasks = reinterpret_cast<AugmentTask*>(host + layout.tasks_offset);
    const std::byte* arena = host + layout.arena_offset;
    Scratch& sc = scratch_[next_scratch_];
    next_scratch_ ^= 1;
    auto* scratch = static_cast<std::byte*>(sc.data);
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
      const StagedRecord& r = records[i];
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
    if (!jpeg_rows.empty() && !DecodeJpegs(sc, records, arena, jpeg_rows).ok()) {
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
                        stream_),
          "launching the augment kernel"));
      // The next decode into the scratch waits (on the host) for this kernel's reads.
      GPUFEED_RETURN_IF_ERROR(
          cuda::Check(cudaEventRecord(sc.free, stream_), "recording the scratch's event"));
    }
    if (!refused.empty()) return refused;
    GPUFEED_RETURN_IF_ERROR(
        cuda::Check(cudaEventRecord(ready_[k], stream_), "recording the ready event"));
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
    return cuda::Check(cudaEventRecord(ready_[k], stream_), "recording the ready event");
  }

  absl::Status WaitCopied(int slot) override {
    cuda::DeviceGuard guard(gpu_->ordinal);
    return cuda::Check(cudaEventSynchronize(ready_[static_cast<size_t>(slot)]),
                       "waiting for the copy to the GPU");
  }

 private:
  Gpu* const gpu_;
  const uint64_t budget_;
  uint64_t charged_ = 0;
  uint64_t stride_ = 0;
  DeviceRingExport export_;
  UniqueFd export_fd_;
  CUmemGenericAllocationHandle vmm_handle_ = 0;
  CUdeviceptr vmm_ptr_ = 0;
  void* legacy_ptr_ = nullptr;
  std::byte* base_ = nullptr;
  std::vector<cudaEvent_t> ready_;
  std::vector<cudaEvent_t> release_;
  struct Scratch {
    void* data = nullptr;
    cudaEvent_t free = nullptr;  // recorded after each kernel that reads it
  };
  Scratch scratch_[2];
  int next_scratch_ = 0;
  cudaStream_t stream_ = nullptr;
  nvjpeg::State nvjpeg_state_ = nullptr;
  int nvjpeg_batch_ = 0;  // the batch size nvjpegDecodeBatchedInitialize was last given

  absl::Status Upload(void* to, const void* from, uint64_t bytes) {
    return cuda::Check(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream_),
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
      images[i].channel[0] = static_cast<unsigned char*>(sc.data) + r.device_offset;
      images[i].pitch[0] = static_cast<size_t>(r.geometry.src_width) * 3;
    }
    int rc = 0;
    if (nvjpeg_state_ == nullptr) {
      rc = api->JpegStateCreate(gpu_->nvjpeg_handle, &nvjpeg_state_);
      if (rc != 0) nvjpeg_state_ = nullptr;
    }
    // nvJPEG's hardware backend writes its output when nvjpegDecodeBatched is called, not in
    // the order of the work already queued on the stream it is given (public reports against
    // nvJPEG 12.3-13.2; a stream-side wait does not help). The last kernel on this buffer may
    // still be reading this scratch: wait for it here, on the host. Bounded: the ring's stream
    // holds only our own work, never a wait on a consumer.
    if (rc == 0) {
      rc = cudaEventSynchronize(sc.free) == cudaSuccess ? 0 : -1;
    }
    if (rc == 0 && nvjpeg_batch_ != n) {
      rc = api->DecodeBatchedInitialize(gpu_->nvjpeg_handle, nvjpeg_state_, n, 1,
                                        nvjpeg::kRgbInterleaved);
      nvjpeg_batch_ = rc == 0 ? n : 0;
    }
    if (rc == 0) {
      rc = api->DecodeBatched(gpu_->nvjpeg_handle, nvjpeg_state_, data.data(), lengths.data(),
                              images.data(), stream_);
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

class CudaBackend final : public DeviceBackend {
 public:
  explicit CudaBackend(CudaBackendOptions options)
      : options_(std::move(options)), budget_(options_.budget_bytes) {}

  ~CudaBackend() override {
    for (auto& gpu : gpus_) gpu->thread->Stop();
    for (auto& gpu : gpus_) {
      cuda::DeviceGuard guard(gpu->ordinal);
      if (gpu->nvjpeg_handle != nullptr) gpu->nvjpeg->Destroy(gpu->nvjpeg_handle);
    }
  }

  absl::Status Start() {
    for (const cuda::Device& d : cuda::VisibleDevices()) {
      auto gpu = std::make_unique<Gpu>();
      gpu->ordinal = d.ordinal;
      gpu->uuid = d.uuid;
      gpu->vmm = cuda::SupportsVmmFd(d.ordinal);
      gpu->options = &options_;
      {
        cuda::DeviceGuard guard(d.ordinal);
        int greatest = 0;
        GPUFEED_RETURN_IF_ERROR(
            cuda::Check(cudaDeviceGetStreamPriorityRange(&gpu->lowest_priority, &greatest),
                        absl::StrCat("stream priorities of ", d.uuid)));
      }
      const int ordinal = d.ordinal;
      gpu->thread = std::make_unique<CopyThread>(absl::StrCat("h2d/gpu", ordinal),
                                                 [ordinal] { cudaSetDevice(ordinal); });
      spdlog::info("GPU {} {} ({}): copy thread started, {} IPC", d.ordinal, d.uuid, d.name,
                   gpu->vmm ? "VMM fd" : "legacy");
      gpus_.push_back(std::move(gpu));
    }
    return absl::OkStatus();
  }

  std::vector<std::string> gpu_uuids() const override {
    std::vector<std::string> out;
    for (const auto& gpu : gpus_) out.push_back(gpu->uuid);
    return out;
  }

  absl::StatusOr<std::unique_ptr<DeviceRing>> AllocateRing(const std::string& uuid, int slots,
                                                           uint64_t stride, IpcKind ipc,
                                                           uint64_t scratch_bytes) override {
    if (gpus_.empty()) return absl::FailedPreconditionError(kNoGpuMessage);
    Gpu* gpu = Find(uuid);
    if (gpu == nullptr) {
      std::vector<std::string> seen = gpu_uuids();
      return absl::NotFoundError(absl::StrCat("delivery.gpu_uuid: no GPU ", uuid,
                                              " is visible to gpufeedd (it sees: ",
                                              absl::StrJoin(seen, ", "), ")"));
    }
    auto ring = std::make_unique<CudaRing>(gpu, budget_);
    GPUFEED_RETURN_IF_ERROR(ring->Allocate(slots, stride, ipc, scratch_bytes));
    return std::unique_ptr<DeviceRing>(std::move(ring));
  }

  absl::Status NvjpegStatus(const std::string& uuid) override {
    Gpu* gpu = Find(uuid);
    if (gpu == nullptr) return absl::NotFoundError(absl::StrCat("delivery.gpu_uuid: ", uuid));
    return gpu->InitNvjpeg();
  }

  bool can_stage() const override { return true; }
  bool healthy() const override { return !cuda::StickyErrorSeen(); }

  std::vector<GpuMemory> memory() const override {
    std::vector<GpuMemory> out;
    for (const auto& gpu : gpus_) {
      absl::MutexLock lock(&gpu->mu);
      out.push_back({gpu->uuid, gpu->used, budget_});
    }
    return out;
  }

  void Post(const std::string& uuid, std::function<void()> work) override {
    Gpu* gpu = Find(uuid);
    if (gpu != nullptr) return gpu->thread->Post(std::move(work));
    spdlog::warn("no copy thread for {}: running its work inline", uuid);
    work();
  }
  void PostLater(const std::string& uuid, std::function<void()> work) override {
    Gpu* gpu = Find(uuid);
    if (gpu != nullptr) return gpu->thread->PostLater(std::move(work));
    work();
  }
  std::vector<const BusyMark*> busy_marks() const override {
    std::vector<const BusyMark*> out;
    for (const auto& gpu : gpus_) out.push_back(&gpu->thread->busy());
    return out;
  }

 private:
  Gpu* Find(const std::string& uuid) const {
    for (const auto& gpu : gpus_) {
      if (gpu->uuid == uuid) return gpu.get();
    }
    return nullptr;
  }

  const CudaBackendOptions options_;
  const uint64_t budget_;
  std::vector<std::unique_ptr<Gpu>> gpus_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateCudaBackend(
    const CudaBackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>(options);
  GPUFEED_RETURN_IF_ERROR(backend->Start());
  return std::unique_ptr<DeviceBackend>(std::move(backend));
}

absl::Status PinHost(void* data, uint64_t bytes) {
  return cuda::Check(cudaHostRegister(data, bytes, cudaHostRegisterPortable),
                     "cudaHostRegister of the staging pool");
}

void UnpinHost(void* data) { cudaHostUnregister(data); }

}  // namespace gpufeed::server
