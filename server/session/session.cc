#include "server/session/session.h"

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {

bool Session::LifelineClosed() const {
  if (params_.lifeline == nullptr || !params_.lifeline->valid()) return false;
  // The client never writes to it: readable means end of file, as does a hang-up.
  pollfd p{params_.lifeline->get(), POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

Session::Session(SessionParams params, std::shared_ptr<Feed> feed, StagingRegion ring,
                 FillScheduler* scheduler, std::unique_ptr<DeviceRing> device,
                 DeviceBackend* backend)
    : params_(std::move(params)),
      feed_(std::move(feed)),
      scheduler_(scheduler),
      attached_at_(params_.clock()),
      stride_(params_.stage == StageMode::kNone ? feed_->layout().stride_bytes
                                                : feed_->staged_layout()->stride_bytes),
      ring_bytes_(ring.size()),
      ring_fd_(ring.TakeMemfd()),
      ring_data_(ring.data()),
      backend_(backend),
      device_export_(device != nullptr ? device->exported() : DeviceRingExport{}),
      device_ring_(device.get()),
      ring_(std::move(ring)),
      device_(std::move(device)),
      slots_(static_cast<size_t>(params_.ring_slots)),
      fill_position_(params_.start),
      delivered_(params_.start) {
  for (Slot& slot : slots_) slot.batch.ids.resize(static_cast<size_t>(feed_->spec().batch_size));
}

void Session::Start() {
  bool schedule;
  {
    absl::MutexLock lock(&mu_);
    schedule = WantScheduleLocked();
  }
  if (schedule) scheduler_->Schedule(shared_from_this());
}

bool Session::ExhaustedLocked() const {
  return params_.stop_epoch > 0 && fill_position_.epoch >= params_.stop_epoch;
}

bool Session::FillableLocked() const {
  if (!closed_.ok() || ExhaustedLocked()) return false;
  for (const Slot& slot : slots_) {
    if (slot.state == SlotState::kFree) return true;
  }
  return false;
}

bool Session::WantScheduleLocked() {
  if (queued_ || !FillableLocked()) return false;
  queued_ = true;
  return true;
}

void Session::Notify() {
  std::function<void()> notify;
  {
    absl::MutexLock lock(&mu_);
    notify = notify_;
  }
  if (notify) notify();
}

absl::Status Session::BindStream(std::function<void()> notify,
                                 const std::vector<std::string>& release_events) {
  if (!release_events.empty()) {
    if (!device_delivery()) {
      return absl::InvalidArgumentError("release_event_handles: only for device delivery");
    }
    if (release_events.size() != static_cast<size_t>(params_.ring_slots)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "release_event_handles: want one per slot (", params_.ring_slots, "), got ",
          release_events.size()));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) return closed_;
    if (streaming_) {
      return absl::FailedPreconditionError(
          absl::StrCat("session ", params_.id, " already has a stream"));
    }
    streaming_ = true;
    streaming_since_ = params_.clock();
    notify_ = std::move(notify);
  }
  if (!release_events.empty()) {
    // Opening IPC events is a driver call: on the copy thread, which also orders it before
    // any copy that waits on them (those follow the consumer's first release).
    std::shared_ptr<Session> self = shared_from_this();
    backend_->Post(params_.gpu_uuid, [self, release_events] {
      absl::Status s;
      {
        absl::MutexLock lock(&self->mu_);
        if (self->device_ == nullptr) return;
        ++self->fills_in_flight_;
      }
      s = self->device_ring_->SetReleaseEvents(release_events);
      TakenRings rings;
      {
        absl::MutexLock lock(&self->mu_);
        --self->fills_in_flight_;
        if (!s.ok() && self->closed_.ok()) self->closed_ = s;
        self->TakeRingsIfIdleLocked(&rings);
      }
      if (!s.ok()) self->Notify();
    });
  }
  Notify();  // batches may already be waiting
  return absl::OkStatus();
}

absl::StatusOr<UniqueFd> Session::ExportDeviceFd() const {
  absl::MutexLock lock(&mu_);
  if (!closed_.ok()) return closed_;
  if (device_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", params_.id, " has no device ring"));
  }
  return device_->ExportFd();
}

absl::StatusOr<UniqueFd> Session::ShareRingFd() const {
  if (device_delivery()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", params_.id, " delivers to a GPU: its host staging is never handed out"));
  }
  if (!ring_fd_.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("session ", params_.id, "'s ring has no memfd of its own"));
  }
  UniqueFd fd(::fcntl(ring_fd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "dup of the ring's memfd");
  return fd;
}

void Session::TakeRingsIfIdleLocked(TakenRings* rings) {
  if (closed_.ok() || fills_in_flight_ > 0) return;
  rings->host = std::move(ring_);
  rings->device = std::move(device_);
  rings->backend = backend_;
  rings->gpu_uuid = params_.gpu_uuid;
}

Session::TakenRings::~TakenRings() {
  if (device == nullptr) return;
  // The copy thread runs the reset, so the ring dies there, whoever drops the last copy of
  // the closure.
  auto ring = std::make_shared<std::unique_ptr<DeviceRing>>(std::move(device));
  backend->Post(gpu_uuid, [ring] { ring->reset(); });
}

bool Session::streaming() const {
  absl::MutexLock lock(&mu_);
  return streaming_;
}

StreamEvent Session::NextEvent() {
  absl::MutexLock lock(&mu_);
  StreamEvent event;
  if (!closed_.ok()) {
    event.kind = StreamEvent::kClosed;
    event.status = closed_;
    return event;
  }
  for (int32_t i = 0; i < static_cast<int32_t>(slots_.size()); ++i) {
    Slot& slot = slots_[static_cast<size_t>(i)];
    if (slot.state != SlotState::kReady || slot.seq != next_deliver_seq_) continue;
    slot.state = SlotState::kLeased;
    ++next_deliver_seq_;
    ++batches_delivered_;
    const uint64_t bytes = feed_->layout().tensor_bytes;
    bytes_delivered_ += bytes;
    feed_->counters()
        .delivered_bytes(device_delivery())
        .fetch_add(bytes, std::memory_order_relaxed);
    delivered_ = feed_->sampler().Next(slot.batch.position);
    if (std::all_of(slots_.begin(), slots_.end(),
                    [](const Slot& s) { return s.state == SlotState::kLeased; })) {
      all_leased_since_ = params_.clock();
    }
    event.kind = StreamEvent::kBatch;
    event.batch = slot.batch;
    return event;
  }
  if (ExhaustedLocked() && next_deliver_seq_ == next_fill_seq_ && !end_sent_) {
    end_sent_ = true;
    event.kind = StreamEvent::kEnd;
    event.end_position = delivered_;
  }
  return event;
}

void Session::UpdateBlockedLocked() {
  bool full = closed_.ok() && !ExhaustedLocked();
  for (const Slot& slot : slots_) {
    full = full && (slot.state == SlotState::kReady || slot.state == SlotState::kLeased);
  }
  const absl::Time now = params_.clock();
  if (full && blocked_since_ == absl::InfiniteFuture()) {
    blocked_since_ = now;
  } else if (!full && blocked_since_ != absl::InfiniteFuture()) {
    blocked_ += now - blocked_since_;
    blocked_since_ = absl::InfiniteFuture();
  }
}

absl::Status Session::Release(int32_t slot_index, uint64_t generation, absl::Duration waited) {
  bool schedule;
  {
    absl::MutexLock lock(&mu_);
    if (slot_index < 0 || slot_index >= static_cast<int32_t>(slots_.size())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "release of slot ", slot_index, ": this session's slots are 0..", slots_.size() - 1));
    }
    Slot& slot = slots_[static_cast<size_t>(slot_index)];
    if (slot.state != SlotState::kLeased) {
      return absl::FailedPreconditionError(absl::StrCat(
          "release of slot ", slot_index, " generation ", generation,
          ": the slot is not leased to this consumer"));
    }
    if (slot.generation != generation) {
      return absl::FailedPreconditionError(absl::StrCat(
          "release of slot ", slot_index, " generation ", generation,
          ": stale generation, the slot holds generation ", slot.generation));
    }
    slot.state = SlotState::kFree;
    all_leased_since_ = absl::InfiniteFuture();
    consumer_wait_ += waited;
    if (params_.adaptive_decode) release_pace_.Released(params_.clock());
    UpdateBlockedLocked();
    schedule = WantScheduleLocked();
  }
  if (schedule) scheduler_->Schedule(shared_from_this());
  return absl::OkStatus();
}

absl::Time Session::all_leased_since() const {
  absl::MutexLock lock(&mu_);
  return all_leased_since_;
}

Position Session::delivered() const {
  absl::MutexLock lock(&mu_);
  return delivered_;
}

bool Session::DropQueued() {
  absl::MutexLock lock(&mu_);
  queued_ = false;
  return std::exchange(fill_gone_, false);
}

bool Session::MarkQueuedFillGone() {
  absl::MutexLock lock(&mu_);
  if (!queued_) return false;
  fill_gone_ = true;
  return true;
}

bool Session::FillOne() {
  Slot* slot = nullptr;
  bool more;
  CpuRows cpu;
  {
    absl::MutexLock lock(&mu_);
    queued_ = false;
    // Marked only once closed, so such a fill ends right here.
    if (std::exchange(fill_gone_, false)) return true;
    if (!FillableLocked()) return false;
    for (Slot& s : slots_) {
      if (s.state == SlotState::kFree) {
        slot = &s;
        break;
      }
    }
    slot->state = SlotState::kFilling;
    ++slot->generation;
    slot->seq = next_fill_seq_++;
    slot->batch.position = fill_position_;
    slot->batch.end_of_epoch = feed_->sampler().EndsEpoch(fill_position_);
    slot->batch.samples_after =
        slot->batch.end_of_epoch ? 0 : feed_->sampler().GlobalBatchSpan(fill_position_).second;
    slot->batch.slot = static_cast<int32_t>(slot - slots_.data());
    slot->batch.generation = slot->generation;
    fill_position_ = feed_->sampler().Next(fill_position_);
    if (params_.adaptive_decode) {
      cpu.share = decode_share_.share();
      if (params_.cheapest_cpu_rows) {
        cpu.costs = &row_costs_;
        cpu.bound = row_costs_.BoundFor(cpu.share);
      }
    }
    ++fills_in_flight_;
    more = WantScheduleLocked();
  }
  // Let another worker take this session's next free slot while this one reads.
  if (more) scheduler_->Schedule(shared_from_this());

  // The slot is ours alone while kFilling: read without the lock. device_ring_ stays valid
  // while this fill counts in fills_in_flight_.
  const bool reused = slot->generation > 1;
  absl::StatusOr<int64_t> valid = int64_t{0};
  if (device_ring_ != nullptr && reused) {
    // The previous copy out of this host slot must be done before it is overwritten.
    if (absl::Status s = device_ring_->WaitCopied(slot->batch.slot); !s.ok()) valid = s;
  }
  const absl::Time fill_start = params_.clock();
  if (valid.ok()) {
    std::byte* data = ring_data_ + static_cast<uint64_t>(slot->batch.slot) * stride_;
    auto parallel = [this](int n, const std::function<void(int)>& fn) {
      scheduler_->ParallelFor(n, fn);
    };
    FillDeadline deadline;
    if (params_.max_batch_time > absl::ZeroDuration()) {
      deadline = {fill_start + params_.max_batch_time, params_.clock, params_.max_batch_time};
    }
    valid = params_.stage == StageMode::kNone
                ? feed_->Fill(slot->batch.position, params_.rank, data,
                              std::span<int64_t>(slot->batch.ids), parallel, deadline,
                              params_.share.get())
                : feed_->FillStaged(slot->batch.position, params_.rank, params_.stage, cpu, data,
                                    std::span<int64_t>(slot->batch.ids), parallel, deadline,
                                    params_.share.get());
  }

  const absl::Duration fill = params_.clock() - fill_start;
  bool failed_here = false;
  bool copy = false;
  TakenRings rings;
  {
    absl::MutexLock lock(&mu_);
    if (params_.adaptive_decode && valid.ok()) decode_share_.Filled(fill, release_pace_.period());
    if (valid.ok() && closed_.ok() && device_ != nullptr) {
      slot->batch.valid = *valid;
      slot->state = SlotState::kCopying;  // stays in flight until the copy is enqueued
      copy = true;
    } else {
      --fills_in_flight_;
      if (valid.ok()) {
        slot->batch.valid = *valid;
        slot->state = SlotState::kReady;
        UpdateBlockedLocked();
      } else {
        slot->state = SlotState::kFree;
        if (closed_.ok()) {
          closed_ = valid.status();
          failed_here = true;
        }
      }
      TakeRingsIfIdleLocked(&rings);
    }
  }
  if (failed_here) {
    spdlog::error("session {} (job {} rank {}) failed: {}", params_.id, params_.job,
                  params_.rank, EscapeForLog(valid.status().ToString()));
  }
  if (copy) {
    std::shared_ptr<Session> self = shared_from_this();
    backend_->Post(params_.gpu_uuid, [self, slot] { self->CopyOne(slot); });
    return false;
  }
  Notify();
  return false;
}

void Session::KeepRingPagesForConsumer() {
  absl::MutexLock lock(&mu_);
  ring_.KeepPagesForConsumer();
}

void Session::Close(absl::Status reason) {
  if (reason.ok()) reason = absl::CancelledError("session closed");
  TakenRings rings;
  {
    absl::MutexLock lock(&mu_);
    if (!closed_.ok()) return;
    closed_ = std::move(reason);
    UpdateBlockedLocked();  // a closed session is not blocked
    // Return the rings now unless a worker or the copy thread still uses them; the last one
    // does then. They are freed below, outside the lock (freeing device memory waits for
    // copies in flight).
    TakeRingsIfIdleLocked(&rings);
  }
  Notify();
}

bool Session::closed() const {
  absl::MutexLock lock(&mu_);
  return !closed_.ok();
}

SessionSnapshot Session::Snapshot() const {
  absl::MutexLock lock(&mu_);
  SessionSnapshot s;
  s.id = params_.id;
  s.owner_uid = params_.owner_uid;
  s.job = params_.job;
  s.rank = params_.rank;
  s.world_size = feed_->spec().world_size;
  s.feed_key = feed_->key();
  s.delivery = params_.delivery;
  s.gpu_uuid = params_.gpu_uuid;
  s.delivered = delivered_;
  s.delivered_samples = feed_->sampler().Cursor(delivered_);
  s.ring_slots = params_.ring_slots;
  for (const Slot& slot : slots_) s.slots_leased += slot.state == SlotState::kLeased ? 1 : 0;
  s.ring_bytes = ring_bytes_;
  s.batches_delivered = batches_delivered_;
  s.streaming = streaming_;
  const absl::Time now = params_.clock();
  s.age = now - attached_at_;
  s.bytes_delivered = bytes_delivered_;
  s.producer_blocked =
      blocked_ + (blocked_since_ == absl::InfiniteFuture() ? absl::ZeroDuration() : now - blocked_since_);
  s.consumer_wait = consumer_wait_;
  s.cpu_decode_share = params_.adaptive_decode ? decode_share_.share() : 0.0;
  s.streaming_for = streaming_since_ == absl::InfiniteFuture() ? absl::ZeroDuration()
                                                                : now - streaming_since_;
  for (const Slot& slot : slots_) {
    s.slots_filling += slot.state == SlotState::kFilling || slot.state == SlotState::kCopying;
    s.slots_ready += slot.state == SlotState::kReady;
  }
  return s;
}

}  // namespace gpufeed::server
