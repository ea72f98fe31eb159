// A session: one consumer process (rank r of a job) attached to a feed, with its own ring of
// K slots from the staging pool (host delivery: a memfd of its own, the only memory its
// consumer receives; device delivery: daemon-private slab memory) and its own cursor. The spine, per slot:
//
//   kFree --(a worker claims it: next position)--> kFilling --(read done)--> kReady
//     ^                                                                        |
//     +----(consumer releases it: a credit)---- kLeased <--(stream sends it)---+
//
// Slots are claimed in stream order and delivered in that order even when fills finish out
// of order. A session never waits for another: the ranks of a job share the feed (dataset,
// permutation) but each reads only its own slice, so each global batch is read once.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/os/fd.h"
#include "server/device/device_backend.h"
#include "server/feed/feed.h"
#include "server/feed/ids_budget.h"
#include "server/images/cpu_rows.h"
#include "server/session/decode_share.h"
#include "server/share/share_cache.h"
#include "server/staging/staging_pool.h"

namespace gpufeed::server {

enum class DeliveryKind { kHost = 1, kDevice = 2 };

class Session;

// Where sessions with free slots go to be filled (the manager's worker pool).
class FillScheduler {
 public:
  virtual ~FillScheduler() = default;
  // Never blocks.
  virtual void Schedule(std::shared_ptr<Session> session) = 0;
  // Runs `work` on a worker (never on the caller's thread unless no worker can take it).
  // Never blocks. How the copy thread hands CPU work (rows nvJPEG refused) back to a worker.
  virtual void Submit(std::function<void()> work) = 0;
  // Runs fn(0..n-1) with the help of idle workers, the caller taking part; returns when all
  // are done. Serial unless overridden.
  virtual void ParallelFor(int n, const std::function<void(int)>& fn) {
    for (int i = 0; i < n; ++i) fn(i);
  }
};

struct ReadyBatch {
  int32_t slot = 0;
  uint64_t generation = 0;
  Position position;
  std::vector<int64_t> ids;
  int64_t valid = 0;
  // The position after this batch, for a checkpoint (BatchReady.samples, end_of_epoch):
  // its global cursor, and whether the batch ends its epoch.
  uint64_t samples_after = 0;
  bool end_of_epoch = false;
};

// What the stream should send next.
struct StreamEvent {
  enum Kind { kNothing, kBatch, kEnd, kClosed } kind = kNothing;
  ReadyBatch batch;        // kBatch
  Position end_position;   // kEnd
  absl::Status status;     // kClosed: why the session ended
};

struct SessionSnapshot {
  uint64_t id = 0;
  uint32_t owner_uid = 0;  // the uid that attached (docs/SECURITY.md section 1)
  std::string job;
  int32_t rank = 0;
  int32_t world_size = 0;
  std::string feed_key;
  DeliveryKind delivery = DeliveryKind::kHost;
  std::string gpu_uuid;
  Position delivered;
  uint64_t delivered_samples = 0;  // the global cursor at `delivered`
  int32_t ring_slots = 0;
  int32_t slots_leased = 0;
  uint64_t ring_bytes = 0;
  int64_t batches_delivered = 0;
  bool streaming = false;
  absl::Duration age;
  uint64_t bytes_delivered = 0;
  absl::Duration producer_blocked;  // the ring was full of ready or leased batches
  double cpu_decode_share = 0;      // adaptive decode: the CPU's share of the rows now
  absl::Duration consumer_wait;     // as the consumer reported with its releases
  absl::Duration streaming_for;     // since the stream opened
  int32_t slots_filling = 0, slots_ready = 0;
};

struct SessionParams {
  uint64_t id = 0;
  std::string token;
  // The uid that attached (its peer credentials): only it may stream, ask the position or
  // map the ring; jobs are namespaced by it.
  uint32_t owner_uid = 0;
  std::string job;
  int32_t rank = 0;
  DeliveryKind delivery = DeliveryKind::kHost;
  std::string gpu_uuid;  // device delivery
  int32_t ring_slots = 0;
  Position start;
  int64_t stop_epoch = 0;  // exclusive; 0 = never
  // Device delivery of image datasets: kNone finishes samples on the CPU; kCpuDecode and
  // kNvjpeg stage them for the GPU's kernel (augment/staged.h).
  StageMode stage = StageMode::kNone;
  // kNvjpeg from decode auto with --adaptive_decode: the CPU pool decodes the share of each
  // batch it keeps up with (DecodeShare), nvJPEG the rest.
  bool adaptive_decode = false;
  // adaptive_decode: the CPU takes the rows cheapest for it (RowCosts); off: by index.
  bool cheapest_cpu_rows = true;
  // One batch's time budget (max_batch_time, docs/SECURITY.md section 4): a fill still running
  // this long after it started stops and the session ends with its DEADLINE_EXCEEDED. Zero:
  // none. Measured on `clock`.
  absl::Duration max_batch_time = absl::ZeroDuration();
  // The session's share of max_ids_bytes (its slots' id arrays), returned when the session
  // and this last copy of its params go.
  std::shared_ptr<const ByteBudget::Charge> ids_charge;
  // What attached_at, streaming_for, all_leased_since and the blocked times are read from
  // (the SessionManager's clock): the reaper compares them with its own "now".
  Clock clock = RealClock();
  // The consumer's memory-socket connection that came with its dataset handle
  // (MemRequest.lifeline), or null: its close before the stream opens ends the session
  // (SessionManager's reaper). Shared, so that the params stay copyable.
  std::shared_ptr<const UniqueFd> lifeline;
  // The session's place in its sharing group (docs/ARCHITECTURE.md section 9), or null; it
  // leaves the group when the session and this last copy of its params go.
  std::shared_ptr<ShareCache::Member> share;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  // `device` and `backend` are set for device delivery: slots are filled in the host ring,
  // then copied into the device ring by the GPU's copy thread.
  Session(SessionParams params, std::shared_ptr<Feed> feed, StagingRegion ring,
          FillScheduler* scheduler, std::unique_ptr<DeviceRing> device = nullptr,
          DeviceBackend* backend = nullptr);

  uint64_t id() const { return params_.id; }
  const std::string& token() const { return params_.token; }
  uint32_t owner_uid() const { return params_.owner_uid; }
  const std::string& job() const { return params_.job; }
  int32_t rank() const { return params_.rank; }
  const Feed& feed() const { return *feed_; }
  // The host ring's size (page-rounded): for host delivery, the size of its own memfd.
  uint64_t ring_bytes() const { return ring_bytes_; }
  // What the session costs its owner's staging quota: its host ring and the heap of its
  // per-slot sample ids (max_ids_bytes is daemon-wide; the quota makes it per uid too).
  uint64_t quota_bytes() const {
    return ring_bytes_ + (params_.ids_charge != nullptr ? params_.ids_charge->bytes() : 0);
  }
  // A new descriptor of the host ring's own memfd, for the memory socket to hand to the
  // consumer (mapped from offset 0, ring_bytes() long): always this session's own ring, also
  // after it ended (the consumer then learns why on its stream, and sees only its own old
  // batches). FAILED_PRECONDITION for device delivery, whose host slots never leave the
  // daemon.
  absl::StatusOr<UniqueFd> ShareRingFd() const;
  absl::Time attached_at() const { return attached_at_; }
  // The consumer closed its lifeline (exited, was killed); false when it has none.
  bool LifelineClosed() const;

  // Queues the first fills. Called once, right after construction.
  void Start();

  // ---- stream side ----
  // Binds the session's one stream; `notify` is called (no lock held, any thread) whenever
  // NextEvent may have something new. FAILED_PRECONDITION when a stream is already bound.
  // `release_events`: for device delivery, none or one cudaIpcEventHandle_t per slot
  // (INVALID_ARGUMENT otherwise).
  absl::Status BindStream(std::function<void()> notify,
                          const std::vector<std::string>& release_events = {});
  bool streaming() const;
  // The next thing to send, in stream order; kClosed once the session has ended.
  StreamEvent NextEvent();
  // A credit: the consumer is done with (slot, generation). FAILED_PRECONDITION, naming the
  // slot, for a slot that is not leased to this session or an old generation; the session
  // goes on either way.
  // `waited`: how long the consumer waited for this batch (its data stall), accumulated.
  absl::Status Release(int32_t slot, uint64_t generation,
                       absl::Duration waited = absl::ZeroDuration());
  // Position after the last batch handed to the stream.
  Position delivered() const;
  // Since when the consumer has held every slot of the ring (leased, none released since);
  // InfiniteFuture while it does not. The manager ends a host session idle this long
  // (idle_lease_timeout).
  absl::Time all_leased_since() const;

  // A descriptor of the device ring's exported allocation (device delivery, VMM).
  absl::StatusOr<UniqueFd> ExportDeviceFd() const;
  bool device_delivery() const { return params_.delivery == DeliveryKind::kDevice; }
  const DeviceRingExport& device_export() const { return device_export_; }

  // ---- producer side ----
  // Claims one free slot, reads its batch into it and publishes it. Run by pool workers.
  // True for a fill that was queued when the session was removed (MarkQueuedFillGone): it
  // does nothing and its scheduler stops counting it.
  bool FillOne();
  // Whether a fill of this closed session is queued; if so, that fill is marked, so that
  // FillOne says so when a worker pops it. Called once, after Close, by the scheduler that
  // counts such fills.
  bool MarkQueuedFillGone();
  // The scheduler could not queue the fill WantScheduleLocked asked for: not queued. True
  // when MarkQueuedFillGone marked it meanwhile: the scheduler uncounts it (no worker will).
  bool DropQueued();

  // Ends the session: no more fills, the stream is told `reason`, and the ring returns to the
  // pool as soon as no fill is writing into it. Idempotent: the first reason wins.
  void Close(absl::Status reason);
  // At shutdown, before Close: the host ring's pages stay with its consumer's mapping when the
  // session goes, so that batches it holds across the daemon's restart keep their bytes.
  void KeepRingPagesForConsumer() ABSL_LOCKS_EXCLUDED(mu_);
  bool closed() const;

  SessionSnapshot Snapshot() const;

 private:
  enum class SlotState { kFree, kFilling, kCopying, kReady, kLeased };
  struct Slot {
    SlotState state = SlotState::kFree;
    uint64_t generation = 0;
    uint64_t seq = 0;
    ReadyBatch batch;
  };

  bool FillableLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts or stops the producer-blocked clock: blocked while every slot holds a ready or
  // leased batch (the consumer, not the pipeline, is what the session waits for).
  void UpdateBlockedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ExhaustedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the session queued and returns true when it should be handed to the scheduler.
  bool WantScheduleLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Notify();
  // Copies a filled host slot into the device ring (on the GPU's copy thread), once the
  // consumer's release of the slot has completed on its GPU (polled, never waited on).
  void CopyOne(Slot* slot);
  // Rows nvJPEG refused, finished on the CPU by a worker, then written by the copy thread.
  void RedoRows(Slot* slot, std::vector<int> rows);
  // The end of a slot's trip to the GPU: ready, or the session fails with `s`.
  void FinishCopy(Slot* slot, absl::Status s, bool closed);
  // The rings of an ended session, freed when this goes: the host region back to the pool
  // at once, the device ring on its GPU's copy thread (freeing it waits for the ring's
  // stream, which no gRPC or other thread should).
  struct TakenRings {
    StagingRegion host;
    std::unique_ptr<DeviceRing> device;
    DeviceBackend* backend = nullptr;
    std::string gpu_uuid;
    ~TakenRings();
  };
  // Once closed and nothing is in flight: hands the rings over for freeing outside the lock.
  void TakeRingsIfIdleLocked(TakenRings* rings) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SessionParams params_;
  const std::shared_ptr<Feed> feed_;
  FillScheduler* const scheduler_;
  const absl::Time attached_at_;
  const uint64_t stride_;
  const uint64_t ring_bytes_;
  // Host delivery: the ring's own memfd, kept while this object lives (the region, which
  // goes when the session ends, keeps the mapping and the budget). Invalid for device.
  const UniqueFd ring_fd_;
  std::byte* const ring_data_;
  DeviceBackend* const backend_;
  const DeviceRingExport device_export_;
  // The device ring, for the fill and copy paths, which use it without the lock: each holds a
  // count in fills_in_flight_, and device_ (its owner) lets it go only when that count is 0.
  // Null for host delivery.
  DeviceRing* const device_ring_;

  mutable absl::Mutex mu_;
  StagingRegion ring_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<DeviceRing> device_ ABSL_GUARDED_BY(mu_);
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  Position fill_position_ ABSL_GUARDED_BY(mu_);
  Position delivered_ ABSL_GUARDED_BY(mu_);
  uint64_t next_fill_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_deliver_seq_ ABSL_GUARDED_BY(mu_) = 0;
  int fills_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // reads and device copies
  int64_t batches_delivered_ ABSL_GUARDED_BY(mu_) = 0;
  bool queued_ ABSL_GUARDED_BY(mu_) = false;
  bool fill_gone_ ABSL_GUARDED_BY(mu_) = false;  // MarkQueuedFillGone
  bool end_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_ ABSL_GUARDED_BY(mu_);  // OK while open
  std::function<void()> notify_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_delivered_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time blocked_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Duration blocked_ ABSL_GUARDED_BY(mu_);
  absl::Duration consumer_wait_ ABSL_GUARDED_BY(mu_);
  DecodeShare decode_share_ ABSL_GUARDED_BY(mu_){params_.ring_slots};  // adaptive_decode
  ReleasePace release_pace_ ABSL_GUARDED_BY(mu_);
  RowCosts row_costs_;  // adaptive_decode: which rows the CPU takes (atomics, no lock)
  absl::Time streaming_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  absl::Time all_leased_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
};

}  // namespace gpufeed::server
