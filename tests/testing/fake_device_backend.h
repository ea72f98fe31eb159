// A DeviceBackend without a GPU, for testing the device-delivery flow of sessions: "device
// memory" is host memory, the copy thread is a real thread, and every call is recorded.
#pragma once

#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/bounded_queue.h"
#include "server/device/device_backend.h"

namespace gpufeed::testing {

struct FakeDeviceLog {
  absl::Mutex mu;
  std::vector<std::string> calls ABSL_GUARDED_BY(mu);  // "copy 2 reused", "release-events 4", ...
  int rings_alive ABSL_GUARDED_BY(mu) = 0;
  void Add(std::string call) {
    absl::MutexLock lock(&mu);
    calls.push_back(std::move(call));
  }
  std::vector<std::string> Calls() {
    absl::MutexLock lock(&mu);
    return calls;
  }
  int RingsAlive() {
    absl::MutexLock lock(&mu);
    return rings_alive;
  }
};

class FakeDeviceRing final : public server::DeviceRing {
 public:
  FakeDeviceRing(std::shared_ptr<FakeDeviceLog> log, int slots, uint64_t stride)
      : log_(std::move(log)), memory_(static_cast<size_t>(slots) * stride), stride_(stride) {
    exported_.ipc = server::IpcKind::kLegacy;
    exported_.gpu_uuid = "GPU-fake";
    exported_.alloc_bytes = memory_.size();
    exported_.legacy_mem_handle = std::string(64, 'm');
    exported_.ready_event_handles.assign(static_cast<size_t>(slots), std::string(64, 'e'));
    absl::MutexLock lock(&log_->mu);
    ++log_->rings_alive;
  }
  ~FakeDeviceRing() override {
    absl::MutexLock lock(&log_->mu);
    --log_->rings_alive;
  }
  const server::DeviceRingExport& exported() const override { return exported_; }
  absl::StatusOr<UniqueFd> ExportFd() const override {
    return absl::FailedPreconditionError("fake ring has no fd");
  }
  absl::Status SetReleaseEvents(const std::vector<std::string>& handles) override {
    log_->Add(absl::StrCat("release-events ", handles.size()));
    return absl::OkStatus();
  }
  absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes, bool reused) override {
    std::memcpy(memory_.data() + static_cast<uint64_t>(slot) * stride_, src, bytes);
    log_->Add(absl::StrCat("copy ", slot, reused ? " reused" : " first"));
    return absl::OkStatus();
  }
  absl::Status WaitCopied(int slot) override {
    log_->Add(absl::StrCat("wait-copied ", slot));
    return absl::OkStatus();
  }
  const std::byte* slot_data(int slot) const { return memory_.data() + slot * stride_; }

 private:
  std::shared_ptr<FakeDeviceLog> log_;
  server::DeviceRingExport exported_;
  std::vector<std::byte> memory_;
  uint64_t stride_;
};

class FakeDeviceBackend final : public server::DeviceBackend {
 public:
  explicit FakeDeviceBackend(uint64_t budget) : budget_(budget), work_(1024) {
    thread_ = std::thread([this] {
      while (true) {
        auto work = work_.Pop();
        if (!work.ok()) return;
        (*work)();
      }
    });
  }
  ~FakeDeviceBackend() override {
    work_.Close();
    thread_.join();
  }
  std::vector<std::string> gpu_uuids() const override { return {"GPU-fake"}; }
  absl::StatusOr<std::unique_ptr<server::DeviceRing>> AllocateRing(const std::string& uuid,
                                                                   int slots, uint64_t stride,
                                                                   server::IpcKind,
                                                                   uint64_t scratch_bytes) override {
    if (uuid != "GPU-fake") return absl::NotFoundError(absl::StrCat("delivery.gpu_uuid: ", uuid));
    absl::MutexLock lock(&mu_);
    const uint64_t bytes = static_cast<uint64_t>(slots) * stride;
    if (used_ + bytes > budget_) {
      return absl::ResourceExhaustedError(absl::StrCat("--device_bytes: ", bytes, " asked"));
    }
    used_ += bytes;
    auto ring = std::make_unique<FakeDeviceRing>(log, slots, stride);
    last = ring.get();
    return std::unique_ptr<server::DeviceRing>(std::move(ring));
  }
  void Post(const std::string&, std::function<void()> work) override {
    if (!work_.Push(work).ok()) work();
  }

  std::shared_ptr<FakeDeviceLog> log = std::make_shared<FakeDeviceLog>();
  FakeDeviceRing* last = nullptr;  // the newest ring (alive while its session is)

 private:
  const uint64_t budget_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  BoundedQueue<std::function<void()>> work_;
  std::thread thread_;
};

}  // namespace gpufeed::testing
