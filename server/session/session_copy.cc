// The device half of a session's slot trip: once a worker has filled the host slot, the GPU's
// copy thread copies it (or stages it: nvJPEG + the fused kernel) into the consumer's device
// slot, after polling the consumer's release; rows nvJPEG refuses go back to a worker.
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/progress.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "server/session/session.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// Where a staged batch's results go: the finished tensors' image, then label.
StagedOutput StagedOutputOf(const SlotLayout& layout) {
  StagedOutput output;
  output.image_offset = layout.tensors[0].byte_offset;
  output.image_row_bytes = layout.tensors[0].row_bytes;
  output.label_offset = layout.tensors[1].byte_offset;
  return output;
}

}  // namespace

void Session::CopyOne(Slot* slot) {
  bool closed;
  {
    absl::MutexLock lock(&mu_);
    closed = !closed_.ok();
  }
  if (closed) return FinishCopy(slot, absl::OkStatus(), true);
  const int k = slot->batch.slot;
  if (slot->generation > 1) {
    // The consumer's GPU may still read the slot's previous batch: ask, and come back after
    // a poll interval while it does. Never a stream wait on the consumer's event: that would
    // stall everything queued behind it (and nvJPEG's hardware decode ignores such waits).
    absl::StatusOr<bool> released = device_ring_->Released(k);
    if (!released.ok()) return FinishCopy(slot, released.status(), false);
    if (!*released) {
      std::shared_ptr<Session> self = shared_from_this();
      backend_->PostLater(params_.gpu_uuid, [self, slot] { self->CopyOne(slot); });
      return;
    }
  }
  metrics::StageTimer timer(feed_->counters(), metrics::Stage::kDevice);
  std::byte* src = ring_data_ + static_cast<uint64_t>(k) * stride_;
  if (params_.stage == StageMode::kNone) {
    return FinishCopy(slot, device_ring_->CopyIn(k, src, feed_->layout().used_bytes), false);
  }
  absl::StatusOr<std::vector<int>> refused =
      device_ring_->StageIn(k, src, *feed_->staged_layout(),
                       static_cast<int>(slot->batch.ids.size()), StagedOutputOf(feed_->layout()));
  if (!refused.ok() || refused->empty()) return FinishCopy(slot, refused.status(), false);
  // CPU work goes back to a worker: the copy thread serves every session on its GPU.
  std::shared_ptr<Session> self = shared_from_this();
  scheduler_->Submit([self, slot, rows = *std::move(refused)]() mutable {
    self->RedoRows(slot, std::move(rows));
  });
}

void Session::RedoRows(Slot* slot, std::vector<int> rows) {
  // A row the GPU could not decode: the CPU path, which applies the bad-image policy (a
  // replacement sample has its own label and id). Every such row was counted as staged for
  // nvJPEG; the CPU's decode counts it again, so gpufeed_decodes_total counts each image once.
  feed_->counters()
      .decodes(metrics::Decoder::kNvjpeg)
      .fetch_sub(rows.size(), std::memory_order_relaxed);
  const StagedOutput output = StagedOutputOf(feed_->layout());
  auto images = std::make_shared<std::vector<std::byte>>(rows.size() * output.image_row_bytes);
  auto labels = std::make_shared<std::vector<int64_t>>(rows.size());
  absl::Status s;
  for (size_t i = 0; i < rows.size() && s.ok(); ++i) {
    // A session closed meanwhile (detached, expired, failed) reads no more, as CopyOne: its
    // rings go back once this returns, not after a batch's reads.
    if (closed()) return FinishCopy(slot, absl::OkStatus(), true);
    const size_t k = static_cast<size_t>(rows[i]);
    const std::span<std::byte> out[] = {
        {images->data() + i * output.image_row_bytes, output.image_row_bytes},
        {reinterpret_cast<std::byte*>(&(*labels)[i]), sizeof(int64_t)}};
    absl::StatusOr<uint64_t> used = CallCatching("reading it", [&] {  // never the daemon's end
      return feed_->dataset().ReadSampleAt(static_cast<uint64_t>(slot->batch.ids[k]),
                                           {feed_->spec().seed, slot->batch.position.epoch}, out);
    });
    BusyMark::Progress();  // one sample done: liveness (common/progress.h)
    if (!used.ok()) {
      s = Annotate(used.status(), absl::StrCat("sample ", slot->batch.ids[k], " of epoch ",
                                               slot->batch.position.epoch, " step ",
                                               slot->batch.position.step));
    } else {
      slot->batch.ids[k] = static_cast<int64_t>(*used);
    }
  }
  std::shared_ptr<Session> self = shared_from_this();
  backend_->Post(params_.gpu_uuid, [self, slot, s, rows = std::move(rows), images, labels] {
    absl::Status done = s;
    if (done.ok()) {
      done = self->device_ring_->FinishRows(slot->batch.slot, StagedOutputOf(self->feed_->layout()),
                                       rows, *images, *labels);
    }
    self->FinishCopy(slot, done, false);
  });
}

void Session::FinishCopy(Slot* slot, absl::Status s, bool closed) {
  TakenRings rings;
  {
    absl::MutexLock lock(&mu_);
    --fills_in_flight_;
    if (s.ok() && !closed) {
      slot->state = SlotState::kReady;
      UpdateBlockedLocked();
    } else {
      slot->state = SlotState::kFree;
      if (closed_.ok()) closed_ = s;
    }
    TakeRingsIfIdleLocked(&rings);
  }
  if (!s.ok()) {
    spdlog::error("session {} (job {} rank {}) copy to GPU failed: {}", params_.id, params_.job,
                  params_.rank, EscapeForLog(s.ToString()));
  }
  Notify();
}

}  // namespace gpufeed::server
