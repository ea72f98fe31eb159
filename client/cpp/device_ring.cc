#include "client/cpp/device_ring.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

#ifdef GPUFEED_WITH_CUDA
#include "common/cuda/cuda.h"
#include "common/cuda/owners.h"
#endif

namespace gpufeed::client::internal {

#ifndef GPUFEED_WITH_CUDA

namespace {
absl::Status NoCuda() {
  return absl::FailedPreconditionError(
      "device delivery: this gpufeed client was built without CUDA support");
}
}  // namespace

absl::StatusOr<GpuTarget> ResolveGpu(const std::string&) { return NoCuda(); }
absl::StatusOr<bool> UsesMps(int) { return NoCuda(); }
absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapVmm(
    int, UniqueFd, uint64_t, const std::vector<std::string>&) {
  return NoCuda();
}
absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapLegacy(
    int, const std::string&, const std::vector<std::string>&) {
  return NoCuda();
}
struct DeviceRingMapping::Owned {};
DeviceRingMapping::~DeviceRingMapping() = default;
absl::Status DeviceRingMapping::WaitReady(int, void*) const { return NoCuda(); }
absl::Status DeviceRingMapping::RecordRelease(int, void*) const { return NoCuda(); }

#else

// Destroyed in reverse order: the events first, then the mapping they guard.
struct DeviceRingMapping::Owned {
  cuda::VmmMapping vmm;
  cuda::IpcMemory legacy;
  std::vector<cuda::Event> ready;    // opened from the daemon's handles
  std::vector<cuda::Event> release;  // ours, exported to the daemon
};

absl::StatusOr<bool> UsesMps(int ordinal) { return cuda::UsesMps(ordinal); }

absl::StatusOr<GpuTarget> ResolveGpu(const std::string& spec) {
  const std::vector<cuda::Device> devices = cuda::VisibleDevices();
  if (devices.empty()) {
    return absl::FailedPreconditionError("device delivery: this process sees no CUDA device");
  }
  int ordinal = -1;
  if (spec.empty()) {
    GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaGetDevice(&ordinal), "cudaGetDevice"));
  } else if (absl::StartsWith(spec, "cuda:")) {
    if (!absl::SimpleAtoi(spec.substr(5), &ordinal)) ordinal = -1;
  } else {
    for (const cuda::Device& d : devices) {
      if (d.uuid == spec) ordinal = d.ordinal;
    }
  }
  for (const cuda::Device& d : devices) {
    if (d.ordinal == ordinal) return GpuTarget{d.ordinal, d.uuid};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "gpu: '", spec, "' names no CUDA device of this process (want cuda:0..cuda:",
      devices.size() - 1, " or a GPU-... UUID)"));
}

absl::Status DeviceRingMapping::OpenEvents(const std::vector<std::string>& ready_events) {
  for (size_t i = 0; i < ready_events.size(); ++i) {
    if (ready_events[i].size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InternalError("daemon sent a malformed ready event handle");
    }
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ready_events[i].data(), sizeof(handle));
    cuda::DeviceGuard guard(ordinal_);
    cudaEvent_t event = nullptr;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(cudaIpcOpenEventHandle(&event, handle),
                                        absl::StrCat("opening ready event of slot ", i)));
    owned_->ready.emplace_back(ordinal_, event);
    event = nullptr;
    GPUFEED_RETURN_IF_ERROR(cuda::Check(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess),
        "creating a release event"));
    owned_->release.emplace_back(ordinal_, event);
    cudaIpcEventHandle_t out;
    GPUFEED_RETURN_IF_ERROR(
        cuda::Check(cudaIpcGetEventHandle(&out, event), "cudaIpcGetEventHandle"));
    release_handles_.emplace_back(reinterpret_cast<const char*>(&out), sizeof(out));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapVmm(
    int ordinal, UniqueFd fd, uint64_t bytes, const std::vector<std::string>& ready_events) {
  std::unique_ptr<DeviceRingMapping> m(new DeviceRingMapping());
  m->ordinal_ = ordinal;
  m->owned_ = std::make_unique<Owned>();
  GPUFEED_ASSIGN_OR_RETURN(m->owned_->vmm, cuda::VmmMapping::Import(ordinal, fd.get(), bytes));
  m->base_ = static_cast<std::byte*>(m->owned_->vmm.data());
  GPUFEED_RETURN_IF_ERROR(m->OpenEvents(ready_events));
  return m;
}

absl::StatusOr<std::unique_ptr<DeviceRingMapping>> DeviceRingMapping::MapLegacy(
    int ordinal, const std::string& mem_handle, const std::vector<std::string>& ready_events) {
  if (mem_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InternalError("daemon sent a malformed legacy memory handle");
  }
  std::unique_ptr<DeviceRingMapping> m(new DeviceRingMapping());
  m->ordinal_ = ordinal;
  m->owned_ = std::make_unique<Owned>();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, mem_handle.data(), sizeof(handle));
  GPUFEED_ASSIGN_OR_RETURN(
      m->owned_->legacy,
      cuda::OpenIpcMemory(ordinal, handle, cudaIpcMemLazyEnablePeerAccess));
  m->base_ = static_cast<std::byte*>(m->owned_->legacy.get());
  GPUFEED_RETURN_IF_ERROR(m->OpenEvents(ready_events));
  return m;
}

DeviceRingMapping::~DeviceRingMapping() {
  if (owned_ == nullptr) return;
  // Work queued before a release must not lose its event: wait for it before the owners
  // destroy the events and unmap the ring.
  for (const cuda::Event& e : owned_->release) {
    cuda::DeviceGuard guard(e.device());
    cudaEventSynchronize(e.get());
  }
}

absl::Status DeviceRingMapping::WaitReady(int slot, void* stream) const {
  cuda::DeviceGuard guard(ordinal_);
  cudaEvent_t ready = owned_->ready[static_cast<size_t>(slot)].get();
  // A stream wait on an interprocess event costs far more than a query of it, even when the
  // event completed long ago (measured: docs/benchmarks.md, section Device delivery). In
  // training the ring runs ahead, so the copy is usually done: ask first, and only make the
  // stream wait when it is not.
  const cudaError_t done = cudaEventQuery(ready);
  if (done == cudaSuccess) return absl::OkStatus();
  if (done != cudaErrorNotReady) return cuda::Check(done, "querying a batch's ready event");
  return cuda::Check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), ready, 0),
                     "waiting for a batch's ready event");
}

absl::Status DeviceRingMapping::RecordRelease(int slot, void* stream) const {
  cuda::DeviceGuard guard(ordinal_);
  return cuda::Check(cudaEventRecord(owned_->release[static_cast<size_t>(slot)].get(),
                                     static_cast<cudaStream_t>(stream)),
                     "recording a release event");
}

#endif

}  // namespace gpufeed::client::internal
