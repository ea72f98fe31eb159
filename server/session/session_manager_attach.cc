// SessionManager::Attach and its steps: the spec's rules (attach_spec.h), admission
// (admission.h), the feed, the ring (ring_planner.h), the job (job_registry.h), the session.
#include "server/session/session_manager.h"

#include <sys/random.h>

#include <memory>
#include <optional>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/session/elastic.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

std::string NewToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(bytes), sizeof(bytes)));
}

// The new session's settings: the spec's, the manager's options' and the ring's.
SessionParams ParamsFor(const AttachSpec& spec, const SessionManagerOptions& options,
                        StageMode stage, int32_t slots, bool device) {
  SessionParams params;
  params.token = NewToken();
  params.clock = options.clock;
  params.owner_uid = spec.caller.uid();
  params.gpu_uuid = spec.gpu_uuid;
  params.job = spec.job;
  params.rank = spec.rank;
  params.delivery = spec.delivery;
  params.ring_slots = slots;
  params.start = spec.start;
  params.stop_epoch = spec.stop_epoch;
  params.stage = stage;
  // decode auto: nvJPEG's engines cost a training process on the same GPU more time a batch
  // than the CPU decoder does (less under MPS than without; session/decode_share.h), so the
  // CPU pool decodes what it keeps up with.
  params.adaptive_decode = options.adaptive_decode && stage == StageMode::kNvjpeg &&
                           spec.decode == DecodeChoice::kAuto && device;
  params.cheapest_cpu_rows = options.cheapest_cpu_rows;
  params.max_batch_time = options.max_batch_time;
  return params;
}

// What Attach answers: the session's id and token, the feed's shape and the ring.
Attachment AttachmentOf(const Session& session, const Feed& feed, const AttachSpec& spec,
                        StageMode stage, int32_t slots) {
  Attachment out;
  out.session_id = session.id();
  out.token = session.token();
  out.feed_key = feed.key();
  out.num_samples = feed.dataset().num_samples();
  out.steps_per_epoch = feed.sampler().steps_per_epoch();
  out.ring_slots = slots;
  out.layout = feed.layout();
  out.start = spec.start;
  out.start_samples = feed.sampler().Cursor(spec.start);
  out.batch_size = feed.spec().batch_size;
  out.fingerprint = feed.fingerprint();
  out.device = spec.delivery == DeliveryKind::kDevice;
  if (out.device) out.device_ring = session.device_export();
  out.stage = stage;
  out.image = feed.staged_layout().has_value();
  out.notices = feed.dataset().notices();
  if (feed.lm() != nullptr) out.blend_segments = feed.lm()->segments();
  return out;
}

// The attach line, and the resume line of a client's re-attach after its stream failed.
void LogAttach(const AttachSpec& spec, const Session& session, const Feed& feed, int32_t slots,
               uint64_t stride) {
  spdlog::info("attach: session {} uid {} job '{}' rank {}/{} feed {} (dataset '{}': {} "
               "samples, {} steps/epoch), {} slots x {} bytes, start ({}, {})",
               session.id(), session.owner_uid(), EscapeForLog(spec.job), spec.rank,
               spec.feed.world_size, feed.key(), EscapeForLog(spec.feed.dataset.path),
               feed.dataset().num_samples(), feed.sampler().steps_per_epoch(), slots, stride,
               spec.start.epoch, spec.start.step);
  if (spec.resume_gap > absl::ZeroDuration()) {
    spdlog::info(
        "resume: session {} uid {} job '{}' rank {} goes on at ({}, {}) after {} "
        "without a stream (a re-attach across a restart or drain)",
        session.id(), session.owner_uid(), EscapeForLog(spec.job), spec.rank, spec.start.epoch,
        spec.start.step,
        absl::FormatDuration(absl::Trunc(spec.resume_gap, absl::Milliseconds(1))));
  }
}

}  // namespace

absl::Status SessionManager::Admit(const AttachSpec& spec) const {
  GPUFEED_RETURN_IF_ERROR(ValidateAttachSpec(spec, options_.max_ring_slots));
  GPUFEED_RETURN_IF_ERROR(CheckDeviceDelivery(spec, devices_));
  absl::MutexLock lock(&mu_);
  // Refused before the dataset is opened; checked again, with the ring's bytes, below.
  GPUFEED_RETURN_IF_ERROR(admission_.Admit(spec.caller, 0, Admission::Step::kBeforeOpen));
  return CheckGoneFills(spec.caller);
}

std::shared_ptr<const UniqueFd> SessionManager::TakeLifeline(const AttachSpec& spec) {
  if (spec.feed.dataset.handle.empty()) return nullptr;
  UniqueFd fd = feeds_.TakeLifeline(spec.feed.dataset.handle, spec.caller.uid());
  return fd.valid() ? std::make_shared<const UniqueFd>(std::move(fd)) : nullptr;
}

absl::StatusOr<SessionManager::PlacedRing> SessionManager::PlaceRing(const AttachSpec& spec,
                                                                     const Feed& feed,
                                                                     StageMode stage) {
  const uint64_t stride = stage == StageMode::kNone ? feed.layout().stride_bytes
                                                    : feed.staged_layout()->stride_bytes;
  // A deep auto ring of staged batches that does not fit now (a slab's free blocks, the uid's
  // quota, the GPU's budget or memory) is tried shallower, down to the byte rule's depth.
  std::optional<StagedRingRoom> room;
  if (stage != StageMode::kNone && spec.delivery == DeliveryKind::kDevice) {
    absl::MutexLock lock(&mu_);
    room = StagedRingRoom{devices_ != nullptr ? static_cast<int>(devices_->gpu_uuids().size()) : 1,
                          admission_.StagingRoom(spec.caller, pool_->total_bytes())};
  }
  const std::vector<int32_t> depths =
      RingDepths(RingDepthRule{options_.default_ring_slots, options_.auto_ring_bytes},
                 spec.ring_slots, stride, room.has_value() ? &*room : nullptr);
  return AllocateFirstThatFits(depths, [&](int32_t slots) {
    return AllocateRing(spec, feed, stage, stride, slots);
  });
}

absl::StatusOr<SessionManager::PlacedRing> SessionManager::AllocateRing(
    const AttachSpec& spec, const Feed& feed, StageMode stage, uint64_t stride, int32_t slots) {
  // stride < 2^45 (Feed bounds a batch) and slots <= 64: the product cannot wrap. Both
  // layouts' strides are page-aligned, so this is the region's size. A host ring is a memfd
  // of its own (its consumer maps it); device staging stays in the private slabs.
  const uint64_t ring_bytes = stride * static_cast<uint64_t>(slots);
  {
    absl::MutexLock lock(&mu_);
    GPUFEED_RETURN_IF_ERROR(admission_.Quota(
        spec.caller, ring_bytes + static_cast<uint64_t>(spec.feed.batch_size) *
                                      static_cast<uint64_t>(slots) * sizeof(int64_t)));
  }
  absl::StatusOr<StagingRegion> host = spec.delivery == DeliveryKind::kHost
                                           ? pool_->AllocateOwnMemfd(ring_bytes)
                                           : pool_->Allocate(ring_bytes);
  if (!host.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ring of ", slots, " slots x ", stride, " bytes: ", host.status().message()));
  }
  PlacedRing ring{slots, stride, std::move(*host), nullptr};
  if (spec.delivery != DeliveryKind::kDevice) return ring;
  // On a refusal the host ring goes back to the pool (with `ring`) before a shallower try.
  absl::StatusOr<std::unique_ptr<DeviceRing>> device = devices_->AllocateRing(
      spec.gpu_uuid, slots, feed.layout().stride_bytes, spec.ipc,
      stage == StageMode::kNone ? 0 : feed.staged_layout()->device_scratch_bytes);
  if (!device.ok()) return Annotate(device.status(), "device ring");
  ring.device = std::move(*device);
  return ring;
}

absl::StatusOr<Attachment> SessionManager::Attach(const AttachSpec& request) {
  AttachSpec spec = request;
  const absl::Status admitted = Admit(spec);
  absl::StatusOr<std::string> elastic =
      admitted.ok() ? ResolveElastic(spec) : absl::StatusOr<std::string>(admitted);
  if (!elastic.ok()) {
    // A refused Attach spends its dataset handle all the same: the caller's descriptor is
    // closed now, not held until the handle expires (and does not count against the uid's
    // handles meanwhile).
    if (!spec.feed.dataset.handle.empty()) {
      feeds_.DropDatasetHandle(spec.feed.dataset.handle, spec.caller.uid());
    }
    return elastic.status();
  }
  if (spec.feed.lm.changes_weights()) {
    // A blend resumed with other weights: they take over at the resume's global cursor
    // (LmDataset finds the first pick the rows before it left untouched).
    // The cursor as ResolveElastic left it: a saved one, or the step's global batches plus
    // the base an elastic resume read its epoch from.
    spec.feed.lm.change_epoch = spec.start.epoch;
    spec.feed.lm.change_samples = static_cast<uint64_t>(
        spec.start_samples > 0
            ? spec.start_samples
            : spec.start.step * spec.feed.batch_size * spec.feed.world_size +
                  (spec.feed.resume_epoch == spec.start.epoch
                       ? static_cast<int64_t>(spec.feed.resume_base)
                       : 0));
  }
  // The consumer's lifeline, taken before the handle is spent opening the dataset.
  std::shared_ptr<const UniqueFd> lifeline = TakeLifeline(spec);
  // Open (or share) the feed first: the job check below compares resolved specs, so ranks
  // naming one file by different paths still agree.
  GPUFEED_ASSIGN_OR_RETURN(std::shared_ptr<Feed> feed, feeds_.GetOrCreate(spec.feed, spec.caller));
  GPUFEED_RETURN_IF_ERROR(SettleElasticStart(spec, feed->sampler()));
  GPUFEED_RETURN_IF_ERROR(CheckAgainstFeed(spec, *feed));
  if (feed->lm() != nullptr) {
    // A blended or packed stream is packed up to the session's start here, within the
    // attach-time scan's limits, so that no fill packs from far behind (LmDataset::Reach).
    GPUFEED_ASSIGN_OR_RETURN(const uint64_t row,
                             feed->lm()->StreamRow(spec.start.epoch,
                                                   feed->sampler().Cursor(spec.start)));
    GPUFEED_RETURN_IF_ERROR(feed->lm()->Reach(row));
  }
  GPUFEED_ASSIGN_OR_RETURN(const StageMode stage, ResolveStage(spec, *feed, devices_));
  GPUFEED_ASSIGN_OR_RETURN(PlacedRing ring, PlaceRing(spec, *feed, stage));
  SessionParams params = ParamsFor(spec, options_, stage, ring.slots, ring.device != nullptr);
  GPUFEED_ASSIGN_OR_RETURN(params.ids_charge,
                           TakeIds(*ids_budget_, Admission::IdsOwner(spec.caller),
                                   spec.feed.batch_size, ring.slots));
  params.lifeline = std::move(lifeline);
  if (!spec.feed.share_group.empty()) {
    // Each uid's groups are its own (the same name under another uid is another group), but
    // for the names the admin lets uids share. A member holds at most its ring's rows of
    // decodes in flight.
    const bool across = absl::c_linear_search(options_.share_groups_across_uids,
                                              spec.feed.share_group);
    const ShareMemberOptions share{
        spec.caller.uid(), static_cast<int64_t>(ring.slots) * spec.feed.batch_size};
    absl::StatusOr<ShareCache::Member> member = share_cache_.Join(
        absl::StrCat("uid ", across ? "*" : absl::StrCat(spec.caller.uid()), "/",
                     spec.feed.share_group),
        feed->ShareIdentity(across), feed->OrderCursor(spec.start), share);
    if (!member.ok()) {
      return Annotate(member.status(), absl::StrCat("share_group \"", spec.feed.share_group, "\""));
    }
    params.share = std::make_shared<ShareCache::Member>(std::move(*member));
  }
  const uint64_t ids_bytes = params.ids_charge != nullptr ? params.ids_charge->bytes() : 0;
  const JobMember member{spec.caller.uid(), spec.job, spec.rank, feed->spec().Canonical(),
                         feed->key()};
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    // The pool had room for the ring; the daemon's state, its session count (attaches
    // running at once may have filled it) and the uid's quotas decide now, under the lock
    // that inserts the session.
    GPUFEED_RETURN_IF_ERROR(
        admission_.Admit(spec.caller, ring.host.size() + ids_bytes, Admission::Step::kInsert));
    GPUFEED_RETURN_IF_ERROR(CheckGoneFills(spec.caller));
    GPUFEED_RETURN_IF_ERROR(jobs_.CheckJoin(member));
    params.id = next_id_++;
    // Made before the job is registered: if it throws (std::bad_alloc), nothing is left
    // behind (the attach thread turns the exception into this Attach's error).
    session = std::make_shared<Session>(params, feed, std::move(ring.host), this,
                                        std::move(ring.device), devices_);
    jobs_.Join(member);
    sessions_[params.id] = session;
    admission_.Add(params.owner_uid, session->quota_bytes());
  }
  session->Start();
  if (spec.resume_gap > absl::ZeroDuration()) resumed_.fetch_add(1, std::memory_order_relaxed);
  LogAttach(spec, *session, *feed, ring.slots, ring.stride);
  if (!elastic->empty()) {
    spdlog::info("attach: session {} job '{}' rank {}: {}", session->id(),
                 EscapeForLog(spec.job), spec.rank, *elastic);
  }
  return AttachmentOf(*session, *feed, spec, stage, ring.slots);
}

}  // namespace gpufeed::server
