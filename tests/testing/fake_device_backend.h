// A DeviceBackend without a GPU, for testing the device-delivery flow of sessions: "device
// memory" is host memory, the copy thread is a real thread, and every call is recorded.
#pragma once

#include <atomic>
#include <cstring>
#include <span>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/container/flat_hash_set.h"
#include "server/decode/image_decoder.h"
#include "server/device/copy_thread.h"
#include "server/device/device_backend.h"
#include "server/device/staged_records.h"

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
  FakeDeviceRing(std::shared_ptr<FakeDeviceLog> log, int slots, uint64_t stride,
                 uint64_t scratch_bytes = 0)
      : log_(std::move(log)),
        memory_(static_cast<size_t>(slots) * stride),
        stride_(stride),
        scratch_(scratch_bytes) {
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
  void SetMps(bool mps) { exported_.mps = mps; }
  absl::StatusOr<UniqueFd> ExportFd() const override {
    return absl::FailedPreconditionError("fake ring has no fd");
  }
  absl::Status SetReleaseEvents(const std::vector<std::string>& handles) override {
    log_->Add(absl::StrCat("release-events ", handles.size()));
    return absl::OkStatus();
  }
  // A test holds a slot as a consumer whose GPU still reads it: Released says false.
  void Hold(int slot, bool held) {
    absl::MutexLock lock(&mu_);
    if (held) {
      held_.insert(slot);
    } else {
      held_.erase(slot);
    }
  }
  absl::StatusOr<bool> Released(int slot) override {
    absl::MutexLock lock(&mu_);
    const bool released = !held_.contains(slot);
    if (!released) ++polls_while_held;
    return released;
  }
  int polls_while_held ABSL_GUARDED_BY(mu_) = 0;
  int PollsWhileHeld() {
    absl::MutexLock lock(&mu_);
    return polls_while_held;
  }
  absl::Status CopyIn(int slot, const std::byte* src, uint64_t bytes) override {
    std::memcpy(memory_.data() + static_cast<uint64_t>(slot) * stride_, src, bytes);
    log_->Add(absl::StrCat("copy ", slot, Reused(slot) ? " reused" : " first"));
    return absl::OkStatus();
  }
  // The CPU emulation of the CUDA ring's StageIn: the kernel's own per-pixel arithmetic
  // (augment_pixel.h), JPEG records decoded by libjpeg-turbo in nvJPEG's place. With
  // `refuse_jpeg` set, "nvJPEG" refuses every batch that has JPEG records, as it does a batch
  // with a corrupt file, and returns its JPEG rows for the CPU.
  absl::StatusOr<std::vector<int>> StageIn(int slot, std::byte* host,
                                           const server::StagedLayout& layout, int count,
                                           const server::StagedOutput& output) override {
    log_->Add(absl::StrCat("stage ", slot, Reused(slot) ? " reused" : " first"));
    if (before_stage) before_stage(host, layout);
    // As the CUDA ring: the records are copied out of the slot and checked before use.
    absl::StatusOr<std::vector<server::StagedRecord>> checked =
        server::ReadStagedRecords(host, layout, count, output);
    if (!checked.ok()) return checked.status();
    const std::vector<server::StagedRecord>& records = *checked;
    std::byte* dst = memory_.data() + static_cast<uint64_t>(slot) * stride_;
    std::memcpy(dst + output.label_offset, host + layout.labels_offset,
                static_cast<size_t>(count) * sizeof(int64_t));
    const std::byte* arena = host + layout.arena_offset;
    std::vector<server::AugmentTask> tasks;
    std::vector<int> jpeg_rows;
    bool jpeg_ok = !refuse_jpeg;
    for (int i = 0; i < count; ++i) {
      const server::StagedRecord& r = records[static_cast<size_t>(i)];
      if (r.kind == server::StagedKind::kFinal) {
        std::memcpy(dst + output.image_offset + i * output.image_row_bytes, arena + r.host_offset,
                    output.image_row_bytes);
        ++finals;
        continue;
      }
      if (r.device_offset + r.device_bytes > scratch_.size()) {
        return absl::InternalError(absl::StrCat("row ", i, " lies outside the scratch"));
      }
      if (r.kind == server::StagedKind::kRaw) {
        std::memcpy(scratch_.data() + r.device_offset, arena + r.host_offset, r.host_bytes);
        ++raws;
      } else {
        jpeg_rows.push_back(i);
        ++jpegs;
        const auto* bytes = reinterpret_cast<const uint8_t*>(arena + r.host_offset);
        absl::StatusOr<server::Image> image =
            server::DecodeImage(std::span<const uint8_t>(bytes, r.host_bytes));
        // nvJPEG writes the file's own size: one that is not the record's is refused.
        if (!image.ok() || image->height != r.geometry.src_height ||
            image->width != r.geometry.src_width || image->rgb.size() != r.device_bytes) {
          jpeg_ok = false;
        } else {
          std::memcpy(scratch_.data() + r.device_offset, image->rgb.data(), image->rgb.size());
        }
      }
      server::AugmentTask t;
      t.src_offset = r.device_offset;
      t.src_pitch = r.geometry.src_width * 3;
      t.row = i;
      t.geometry = r.geometry;
      tasks.push_back(t);
    }
    const server::AugmentOutput out = server::ToAugmentOutput(layout, output);
    for (const server::AugmentTask& t : tasks) {
      for (int y = 0; y < out.height; ++y) {
        for (int x = 0; x < out.width; ++x) {
          server::AugmentPixel(t, out, reinterpret_cast<const uint8_t*>(scratch_.data()),
                               reinterpret_cast<uint8_t*>(dst), y, x);
        }
      }
    }
    if (!jpeg_ok) return jpeg_rows;
    return std::vector<int>{};
  }
  absl::Status FinishRows(int slot, const server::StagedOutput& output,
                          const std::vector<int>& rows, const std::vector<std::byte>& images,
                          const std::vector<int64_t>& labels) override {
    std::byte* dst = memory_.data() + static_cast<uint64_t>(slot) * stride_;
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(dst + output.image_offset + rows[i] * output.image_row_bytes,
                  images.data() + i * output.image_row_bytes, output.image_row_bytes);
      std::memcpy(dst + output.label_offset + rows[i] * sizeof(int64_t), &labels[i],
                  sizeof(int64_t));
      ++redone;
    }
    log_->Add(absl::StrCat("finish-rows ", slot, " ", rows.size()));
    return absl::OkStatus();
  }
  // Rows staged so far, by kind, and rows redone on the CPU: kept in `counts`, which the
  // backend keeps past the ring (a test reads them after its session's rings went back).
  struct Counts {
    std::atomic<int> finals{0}, raws{0}, jpegs{0}, redone{0};
  };
  const std::shared_ptr<Counts> counts = std::make_shared<Counts>();
  std::atomic<int>& finals = counts->finals;
  std::atomic<int>& raws = counts->raws;
  std::atomic<int>& jpegs = counts->jpegs;
  std::atomic<int>& redone = counts->redone;
  bool refuse_jpeg = false;  // set before the session starts
  // Runs on the host slot before StageIn reads it: how a test corrupts a staged slot.
  std::function<void(std::byte* host, const server::StagedLayout& layout)> before_stage;

  absl::Status WaitCopied(int slot) override {
    log_->Add(absl::StrCat("wait-copied ", slot));
    return absl::OkStatus();
  }
  const std::byte* slot_data(int slot) const { return memory_.data() + slot * stride_; }

 private:
  // Whether the slot was written before (the log says "reused" then).
  bool Reused(int slot) {
    absl::MutexLock lock(&mu_);
    return !written_.insert(slot).second;
  }

  absl::Mutex mu_;
  absl::flat_hash_set<int> held_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<int> written_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<FakeDeviceLog> log_;
  server::DeviceRingExport exported_;
  std::vector<std::byte> memory_;
  uint64_t stride_;
  std::vector<std::byte> scratch_;
};

class FakeDeviceBackend final : public server::DeviceBackend {
 public:
  explicit FakeDeviceBackend(uint64_t budget) : budget_(budget), thread_("h2d/fake") {}
  ~FakeDeviceBackend() override { thread_.Stop(); }
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
    auto ring = std::make_unique<FakeDeviceRing>(log, slots, stride, scratch_bytes);
    ring->refuse_jpeg = refuse_jpeg;
    ring->SetMps(mps);
    ring->before_stage = before_stage;
    last = ring.get();
    last_counts = ring->counts;
    return std::unique_ptr<server::DeviceRing>(std::move(ring));
  }
  absl::Status NvjpegStatus(const std::string&) override {
    if (nvjpeg) return absl::OkStatus();
    return absl::FailedPreconditionError("decode: nvJPEG is not available to gpufeedd (fake)");
  }
  bool can_stage() const override { return stage; }
  bool stage = true;          // StageIn works
  bool nvjpeg = true;         // NvjpegStatus is OK
  bool refuse_jpeg = false;   // given to new rings
  bool mps = false;           // new rings' GPU runs under MPS
  std::function<void(std::byte*, const server::StagedLayout&)> before_stage;  // given to new rings

  void Post(const std::string&, std::function<void()> work) override {
    thread_.Post(std::move(work));
  }
  void PostLater(const std::string&, std::function<void()> work) override {
    thread_.PostLater(std::move(work));
  }
  std::vector<const BusyMark*> busy_marks() const override { return {&thread_.busy()}; }

  std::shared_ptr<FakeDeviceLog> log = std::make_shared<FakeDeviceLog>();
  FakeDeviceRing* last = nullptr;  // the newest ring (alive while its session is)
  std::shared_ptr<FakeDeviceRing::Counts> last_counts;  // its counts, kept past it

 private:
  const uint64_t budget_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  server::CopyThread thread_;
};

}  // namespace gpufeed::testing
