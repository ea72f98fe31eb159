#include "server/device/cuda_backend.h"

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/cuda/cuda.h"
#include "common/status.h"
#include "server/device/copy_thread.h"
#include "server/device/cuda_ring.h"
#include "server/device/nvjpeg.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

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
      absl::StatusOr<bool> mps = cuda::UsesMps(d.ordinal);
      gpu->mps = mps.ok() && *mps;
      gpu->options = &options_;
      gpu->budget = budget_;
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
      // Under MPS the daemon's kernels run beside the consumers' instead of time-sliced
      // against them; it takes both sides (docs/howto/mps.md).
      spdlog::info("GPU {} {} ({}): copy thread started, {} IPC, MPS {}", d.ordinal, d.uuid, d.name,
                   gpu->vmm ? "VMM fd" : "legacy",
                   !mps.ok() ? "unknown (the driver does not say)"
                   : *mps    ? "on"
                             : "off");
      gpus_.push_back(std::move(gpu));
    }
    return absl::OkStatus();
  }

  std::vector<std::string> gpu_uuids() const override {
    std::vector<std::string> out;
    for (const auto& gpu : gpus_) out.push_back(gpu->uuid);
    return out;
  }
  std::vector<std::string> mps_gpu_uuids() const override {
    std::vector<std::string> out;
    for (const auto& gpu : gpus_) {
      if (gpu->mps) out.push_back(gpu->uuid);
    }
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
    return AllocateCudaRing(gpu, slots, stride, ipc, scratch_bytes);
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
