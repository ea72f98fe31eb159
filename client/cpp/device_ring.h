// Internal to the client: a session's device ring as this process maps it, with the slots'
// ready events (opened from the daemon's handles) and release events (created here).
// Without CUDA support built in, every entry point says so with FAILED_PRECONDITION.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/os/fd.h"

namespace gpufeed::client::internal {

struct GpuTarget {
  int ordinal = 0;
  std::string uuid;
};
// "" (the current device), "cuda:N" or "GPU-..." → ordinal and UUID in this process.
absl::StatusOr<GpuTarget> ResolveGpu(const std::string& spec);
// Whether this process's contexts on `ordinal` go through MPS; an error when unknown.
absl::StatusOr<bool> UsesMps(int ordinal);

class DeviceRingMapping {
 public:
  // Imports a VMM allocation exported as an fd and maps it on `ordinal`.
  static absl::StatusOr<std::unique_ptr<DeviceRingMapping>> MapVmm(
      int ordinal, UniqueFd fd, uint64_t bytes, const std::vector<std::string>& ready_events);
  // Opens a legacy cudaIpcMemHandle_t.
  static absl::StatusOr<std::unique_ptr<DeviceRingMapping>> MapLegacy(
      int ordinal, const std::string& mem_handle, const std::vector<std::string>& ready_events);
  ~DeviceRingMapping();

  std::byte* base() const { return base_; }
  int ordinal() const { return ordinal_; }
  // cudaIpcEventHandle_t bytes of this process's release events, one per slot.
  const std::vector<std::string>& release_event_handles() const { return release_handles_; }
  absl::Status WaitReady(int slot, void* stream) const;
  absl::Status RecordRelease(int slot, void* stream) const;

 private:
  DeviceRingMapping() = default;
  absl::Status OpenEvents(const std::vector<std::string>& ready_events);

  // The mapping and the events, in common/cuda/owners.h's types (defined where CUDA is).
  struct Owned;

  int ordinal_ = 0;
  std::byte* base_ = nullptr;  // the mapping's, for base()
  std::unique_ptr<Owned> owned_;
  std::vector<std::string> release_handles_;
};

}  // namespace gpufeed::client::internal
