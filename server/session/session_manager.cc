#include "server/session/session_manager.h"

#include <pthread.h>
#include <sys/random.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

constexpr size_t kMaxJobNameBytes = 128;

std::string NewToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(bytes), sizeof(bytes)));
}

bool IsJobNameByte(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         absl::string_view("._:@+=/-").find(c) != absl::string_view::npos;
}

// Constant-time comparison: the token is a capability.
bool TokenEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// FeedSnapshot::bad_samples: the dataset's counts by reason, plus each notice's samples left
// out at open under its reason (issue 31: what Attach reports is counted too). A "warning" is
// no sample.
std::vector<std::pair<std::string, int64_t>> BadSamplesOf(const Dataset& dataset) {
  std::vector<std::pair<std::string, int64_t>> out = dataset.bad_samples();
  for (const DatasetNotice& n : dataset.notices()) {
    if (n.reason == "warning" || n.count <= 0) continue;
    auto same =
        std::find_if(out.begin(), out.end(), [&](const auto& r) { return r.first == n.reason; });
    if (same == out.end()) {
      out.emplace_back(n.reason, n.count);
    } else {
      same->second += n.count;
    }
  }
  return out;
}

}  // namespace

int32_t DefaultRingSlots(const SessionManagerOptions& options, uint64_t stride_bytes,
                         const StagedRingRoom* staged) {
  if (options.default_ring_slots > 0) return options.default_ring_slots;
  const uint64_t fit = options.auto_ring_bytes / std::max<uint64_t>(stride_bytes, 1);
  const auto slots = static_cast<int32_t>(std::clamp<uint64_t>(fit, 2, 16));
  if (staged == nullptr) return slots;
  const uint64_t gpus = static_cast<uint64_t>(std::max(staged->gpus, 1));
  for (const int32_t deep : {4, 3}) {
    // stride < 2^45 (Feed bounds a batch), gpus a device count: the product cannot wrap.
    if (deep > slots && deep * stride_bytes * gpus <= staged->budget_bytes / 2) return deep;
  }
  return slots;
}

absl::Status ValidateAttachSpec(const AttachSpec& spec, int32_t max_ring_slots) {
  if (spec.job.empty() || spec.job.size() > kMaxJobNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job: must be 1 to ", kMaxJobNameBytes, " bytes, got ", spec.job.size()));
  }
  for (size_t i = 0; i < spec.job.size(); ++i) {
    if (!IsJobNameByte(spec.job[i])) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "job: byte %d is 0x%02x ('%s'); a job name is 1 to %d bytes of [A-Za-z0-9._:@+=/-]",
          i, static_cast<unsigned char>(spec.job[i]), EscapeForLog(spec.job.substr(i, 1)),
          kMaxJobNameBytes));
    }
  }
  if (spec.feed.world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: must be >= 1, got ", spec.feed.world_size));
  }
  if (spec.rank < 0 || spec.rank >= spec.feed.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank: must be in [0, world_size=",
                                                   spec.feed.world_size, "), got ", spec.rank));
  }
  if (spec.feed.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size: must be >= 1, got ", spec.feed.batch_size));
  }
  if (spec.feed.batch_size > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size: at most 16777216, got ", spec.feed.batch_size));
  }
  if (spec.ring_slots < 0 || spec.ring_slots > max_ring_slots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring_slots: must be in [1, ", max_ring_slots, "] (0 for the default), got ",
        spec.ring_slots));
  }
  if (spec.start.epoch < 0 || spec.start.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("start: epoch and step must be >= 0, got (",
                                                   spec.start.epoch, ", ", spec.start.step, ")"));
  }
  if (spec.start.epoch > kMaxEpoch) {  // so that epoch arithmetic cannot wrap
    return absl::InvalidArgumentError(absl::StrCat("start.epoch: at most 2^40 (", kMaxEpoch,
                                                   "), got ", spec.start.epoch));
  }
  if (spec.stop_epoch < 0 || (spec.stop_epoch > 0 && spec.stop_epoch <= spec.start.epoch)) {
    return absl::InvalidArgumentError(absl::StrCat("stop_epoch: must be 0 or > start.epoch (",
                                                   spec.start.epoch, "), got ", spec.stop_epoch));
  }
  const DatasetSpec& dataset = spec.feed.dataset;
  if (dataset.kind != DatasetKind::kTokens && dataset.kind != DatasetKind::kRecords &&
      !IsImageKind(dataset.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.kind: unknown kind ", static_cast<int>(dataset.kind),
                     " (want tokens, records, image_folder or webdataset)"));
  }
  if (IsImageKind(dataset.kind)) {
    // Validated here, before any file is touched: INVALID_ARGUMENT naming op and field.
    if (absl::StatusOr<PipelinePlan> plan = CompilePipeline(dataset.pipeline); !plan.ok()) {
      return plan.status();
    }
  } else if (!dataset.pipeline.empty()) {
    return absl::InvalidArgumentError(
        "pipeline: only image_folder and webdataset datasets take a pipeline; tokens and records "
        "are served "
        "as stored");
  }
  if (spec.feed.dataset.path.empty() || spec.feed.dataset.path[0] != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: must be an absolute path, got '", spec.feed.dataset.path, "'"));
  }
  return absl::OkStatus();
}

SessionManager::SessionManager(const SessionManagerOptions& options, StagingPool* pool,
                               FileSystem* fs, DeviceBackend* devices)
    : options_(options),
      pool_(pool),
      devices_(devices),
      ids_budget_(CreateIdsBudget(options.max_ids_bytes, options.max_ids_bytes_per_uid)),
      feeds_(fs,
             [&options] {
               FeedAccessOptions access = options.access;
               access.handles.lifetime = options.attach_timeout;
               return access;
             }(),
             options.feed_limits, options.clock),
      // Each session is queued at most once at a time (closed ones may linger briefly), each
      // running fill asks for at most threads - 1 helpers, and each slot in flight to a GPU
      // has at most one CPU redo of rows nvJPEG refused.
      workers_("read", options.threads,
               static_cast<size_t>(options.max_sessions) * (2 + options.max_ring_slots) + 16 +
                   static_cast<size_t>(std::max(1, options.threads)) *
                       std::max(1, options.threads)) {
  reaper_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "lease");
    ReaperLoop();
  });
}

SessionManager::~SessionManager() {
  Shutdown(absl::UnavailableError("gpufeedd is shutting down"));
}

absl::Status SessionManager::Admit(const AttachSpec& spec) const {
  GPUFEED_RETURN_IF_ERROR(ValidateAttachSpec(spec, options_.max_ring_slots));
  if (spec.delivery == DeliveryKind::kDevice) {
    if (devices_ == nullptr || devices_->gpu_uuids().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("delivery: ", kNoGpuMessage, "; attach with host delivery"));
    }
    if (spec.gpu_uuid.empty()) {
      return absl::InvalidArgumentError(
          "delivery.gpu_uuid: device delivery names the consumer's GPU by UUID");
    }
  }
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("gpufeedd is shutting down");
    if (draining_) {
      return absl::UnavailableError(
          "gpufeedd is draining (gpufeedctl drain): attach to another daemon or retry after "
          "its restart");
    }
    if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("gpufeedd serves at most ", options_.max_sessions, " sessions"));
    }
    // Refused before the dataset is opened; checked again, with the ring's bytes, below.
    GPUFEED_RETURN_IF_ERROR(CheckQuotaLocked(spec.caller, 0));
  }
  return absl::OkStatus();
}

namespace {

// The fields of two FeedSpec::Canonical strings that differ, as "name=asked (the job's:
// had)"; "the dataset file" when only the opened file differs (same text, another inode).
std::string SpecDifference(const std::string& had, const std::string& asked) {
  const auto a = ParseFields(had);
  const auto b = ParseFields(asked);
  std::vector<std::string> differ;
  for (const auto& [name, value] : b) {
    std::string theirs = "(none)";
    for (const auto& [n, v] : a) {
      if (n == name) theirs = v;
    }
    if (theirs != value)
      differ.push_back(absl::StrCat(name, "=", value, " (the job's: ", theirs, ")"));
  }
  return differ.empty() ? std::string("another dataset file under the same path")
                        : absl::StrJoin(differ, ", ");
}

}  // namespace

absl::StatusOr<Attachment> SessionManager::Attach(const AttachSpec& spec) {
  if (absl::Status admitted = Admit(spec); !admitted.ok()) {
    // A refused Attach spends its dataset handle all the same: the caller's descriptor is
    // closed now, not held until the handle expires (and does not count against the uid's
    // handles meanwhile).
    if (!spec.feed.dataset.handle.empty()) {
      feeds_.DropDatasetHandle(spec.feed.dataset.handle, spec.caller.uid());
    }
    return admitted;
  }
  // The consumer's lifeline, taken before the handle is spent opening the dataset.
  std::shared_ptr<const UniqueFd> lifeline;
  if (!spec.feed.dataset.handle.empty()) {
    UniqueFd fd = feeds_.TakeLifeline(spec.feed.dataset.handle, spec.caller.uid());
    if (fd.valid()) lifeline = std::make_shared<const UniqueFd>(std::move(fd));
  }
  // Open (or share) the feed first: the job check below compares resolved specs, so ranks
  // naming one file by different paths still agree.
  GPUFEED_ASSIGN_OR_RETURN(std::shared_ptr<Feed> feed,
                           feeds_.GetOrCreate(spec.feed, spec.caller));
  if (!spec.start_fingerprint.empty()) {
    GPUFEED_RETURN_IF_ERROR(CompareFingerprints(spec.start_fingerprint, feed->fingerprint()));
  }
  const int64_t steps = feed->sampler().steps_per_epoch();
  if (spec.start.step >= steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start.step: ", spec.start.step, " is past the epoch's last step (steps_per_epoch = ",
        steps, ")"));
  }
  GPUFEED_ASSIGN_OR_RETURN(const StageMode stage, ResolveStage(spec, *feed));
  const uint64_t stride = stage == StageMode::kNone ? feed->layout().stride_bytes
                                                    : feed->staged_layout()->stride_bytes;
  StagedRingRoom room;
  const bool staged_device = stage != StageMode::kNone && spec.delivery == DeliveryKind::kDevice;
  if (staged_device) {
    room.gpus = devices_ != nullptr ? static_cast<int>(devices_->gpu_uuids().size()) : 1;
    const uint64_t quota = options_.max_staging_bytes_per_uid;
    room.budget_bytes = spec.caller.admin || quota == 0 ? pool_->total_bytes()
                                                        : std::min(quota, pool_->total_bytes());
  }
  const int32_t shallow = DefaultRingSlots(options_, stride);
  int32_t slots = spec.ring_slots != 0
                      ? spec.ring_slots
                      : DefaultRingSlots(options_, stride, staged_device ? &room : nullptr);
  // Within the caller's quota now (checked again, authoritatively, where the session is
  // inserted), the host ring, then the device ring, of `n` slots.
  absl::StatusOr<StagingRegion> ring = absl::UnknownError("not allocated");
  std::unique_ptr<DeviceRing> device;
  auto allocate = [&](int32_t n) -> absl::Status {
    // stride < 2^45 (Feed bounds a batch) and n <= 64: the product cannot wrap. Both layouts'
    // strides are page-aligned, so this is the region's size. A host ring is a memfd of its
    // own (its consumer maps it); device staging stays in the private slabs.
    const uint64_t ring_bytes = stride * static_cast<uint64_t>(n);
    {
      absl::MutexLock lock(&mu_);
      GPUFEED_RETURN_IF_ERROR(CheckQuotaLocked(
          spec.caller, ring_bytes + static_cast<uint64_t>(spec.feed.batch_size) *
                                        static_cast<uint64_t>(n) * sizeof(int64_t)));
    }
    ring = spec.delivery == DeliveryKind::kHost ? pool_->AllocateOwnMemfd(ring_bytes)
                                                : pool_->Allocate(ring_bytes);
    if (!ring.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("ring of ", n, " slots x ", stride, " bytes: ", ring.status().message()));
    }
    if (spec.delivery != DeliveryKind::kDevice) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<DeviceRing>> allocated = devices_->AllocateRing(
        spec.gpu_uuid, n, feed->layout().stride_bytes, spec.ipc,
        stage == StageMode::kNone ? 0 : feed->staged_layout()->device_scratch_bytes);
    if (!allocated.ok()) {
      ring = absl::UnknownError("freed");  // the host ring back to the pool before a retry
      return Annotate(allocated.status(), "device ring");
    }
    device = std::move(*allocated);
    return absl::OkStatus();
  };
  absl::Status allocated = allocate(slots);
  // A deep auto ring of staged batches that does not fit now (a slab's free blocks, the uid's
  // quota, the GPU's budget or memory): a shallower one, down to the byte rule's depth.
  for (const int32_t fewer : {3, shallow}) {
    if (!absl::IsResourceExhausted(allocated) || spec.ring_slots != 0 || fewer >= slots ||
        fewer < shallow) {
      continue;
    }
    slots = fewer;
    allocated = allocate(slots);
  }
  GPUFEED_RETURN_IF_ERROR(allocated);
  GPUFEED_ASSIGN_OR_RETURN(
      std::shared_ptr<const ByteBudget::Charge> ids_charge,
      TakeIds(*ids_budget_,
              spec.caller.admin ? std::nullopt : std::optional<uint32_t>(spec.caller.uid()),
              spec.feed.batch_size, slots));

  SessionParams params;
  params.token = NewToken();
  params.clock = options_.clock;
  params.owner_uid = spec.caller.uid();
  params.gpu_uuid = spec.gpu_uuid;
  params.job = spec.job;
  params.rank = spec.rank;
  params.delivery = spec.delivery;
  params.ring_slots = slots;
  params.start = spec.start;
  params.stop_epoch = spec.stop_epoch;
  params.stage = stage;
  // decode auto: nvJPEG's engines cost a training process on the same GPU ~8.5 ms a batch
  // without MPS and less, but more than the CPU decoder, under it (session/decode_share.h),
  // so the CPU pool decodes what it keeps up with.
  params.adaptive_decode = options_.adaptive_decode && stage == StageMode::kNvjpeg &&
                           spec.decode == DecodeChoice::kAuto && device != nullptr;
  params.cheapest_cpu_rows = options_.cheapest_cpu_rows;
  params.max_batch_time = options_.max_batch_time;
  params.ids_charge = std::move(ids_charge);
  params.lifeline = std::move(lifeline);
  const std::string canonical = feed->spec().Canonical();
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("gpufeedd is shutting down");
    // Opening the dataset can take long: a drain may have begun meanwhile.
    if (draining_) return absl::UnavailableError("gpufeedd is draining (gpufeedctl drain)");
    // The pool had room for the ring (a ring larger than the whole pool is refused as such,
    // above); the uid's quotas decide now, under the lock that inserts the session.
    // Admit checked the session count before the dataset was opened; attaches running at
    // once may have filled it meanwhile.
    if (static_cast<int>(sessions_.size()) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("gpufeedd serves at most ", options_.max_sessions, " sessions"));
    }
    GPUFEED_RETURN_IF_ERROR(CheckQuotaLocked(
        spec.caller, ring->size() + (params.ids_charge != nullptr ? params.ids_charge->bytes() : 0)));
    const JobKey key(spec.caller.uid(), spec.job);
    auto it = jobs_.find(key);
    if (it != jobs_.end()) {
      // The spec as shown, and the dataset as opened (its device and inode, and for an
      // image folder its reader: the feed's key): two ranks passing different files under
      // one display path are not one job.
      if (it->second.canonical != canonical || it->second.feed_key != feed->key()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job '", spec.job,
            "' is attached with another feed: ", SpecDifference(it->second.canonical, canonical),
            "; rank ", spec.rank, " asked for {", canonical,
            "}: every rank of a job must use the same dataset and sampling; to run another "
            "job beside it, give that one another name (job=)"));
      }
      if (it->second.ranks.contains(spec.rank)) {
        return absl::AlreadyExistsError(
            absl::StrCat("job '", spec.job, "' rank ", spec.rank,
                         " is already attached; to run another "
                         "job beside it, give that one another name (job=)"));
      }
    }
    params.id = next_id_++;
    // Made before the job is registered: if it throws (std::bad_alloc), nothing is left
    // behind (the attach thread turns the exception into this Attach's error).
    session = std::make_shared<Session>(params, feed, std::move(*ring), this, std::move(device),
                                        devices_);
    Job& job = jobs_[key];
    job.canonical = canonical;
    job.feed_key = feed->key();
    job.world_size = spec.feed.world_size;
    job.ranks.insert(spec.rank);
    sessions_[params.id] = session;
    Usage& usage = usage_[params.owner_uid];
    ++usage.sessions;
    usage.staging_bytes += session->quota_bytes();
  }
  session->Start();
  spdlog::info("attach: session {} uid {} job '{}' rank {}/{} feed {} (dataset '{}': {} "
               "samples, {} steps/epoch), {} slots x {} bytes, start ({}, {})",
               params.id, params.owner_uid, EscapeForLog(spec.job), spec.rank,
               spec.feed.world_size, feed->key(), EscapeForLog(spec.feed.dataset.path),
               feed->dataset().num_samples(), steps, slots, stride, spec.start.epoch,
               spec.start.step);
  if (spec.resume_gap > absl::ZeroDuration()) {
    resumed_.fetch_add(1, std::memory_order_relaxed);
    spdlog::info(
        "resume: session {} uid {} job '{}' rank {} goes on at ({}, {}) after {} "
        "without a stream (a re-attach across a restart or drain)",
        params.id, params.owner_uid, EscapeForLog(spec.job), spec.rank, spec.start.epoch,
        spec.start.step, absl::FormatDuration(absl::Trunc(spec.resume_gap, absl::Milliseconds(1))));
  }

  Attachment out;
  out.session_id = params.id;
  out.token = params.token;
  out.feed_key = feed->key();
  out.num_samples = feed->dataset().num_samples();
  out.steps_per_epoch = steps;
  out.ring_slots = slots;
  out.layout = feed->layout();
  out.start = spec.start;
  out.fingerprint = feed->fingerprint();
  out.device = spec.delivery == DeliveryKind::kDevice;
  if (out.device) out.device_ring = session->device_export();
  out.stage = stage;
  out.image = feed->staged_layout().has_value();
  out.notices = feed->dataset().notices();
  return out;
}

absl::StatusOr<StageMode> SessionManager::ResolveStage(const AttachSpec& spec,
                                                       const Feed& feed) const {
  const bool asked = spec.decode != DecodeChoice::kAuto || spec.augment != AugmentChoice::kAuto;
  if (!feed.staged_layout()) {
    if (asked) {
      return absl::InvalidArgumentError(
          "decode, augment: only image datasets are decoded and augmented");
    }
    return StageMode::kNone;
  }
  if (spec.delivery != DeliveryKind::kDevice) {
    if (spec.augment == AugmentChoice::kGpu || spec.decode == DecodeChoice::kNvjpeg) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec.augment == AugmentChoice::kGpu ? "augment: gpu" : "decode: nvjpeg",
          " works on the consumer's GPU and needs device delivery"));
    }
    return StageMode::kNone;
  }
  if (spec.augment == AugmentChoice::kCpu) {
    if (spec.decode == DecodeChoice::kNvjpeg) {
      return absl::InvalidArgumentError(
          "decode: nvjpeg decodes on the GPU, where the augment ops then run: use augment gpu "
          "or auto");
    }
    return StageMode::kNone;
  }
  if (!devices_->can_stage()) {
    if (spec.augment == AugmentChoice::kGpu || spec.decode == DecodeChoice::kNvjpeg) {
      return absl::FailedPreconditionError(
          "augment: this gpufeedd was built without the GPU augment kernel");
    }
    return StageMode::kNone;
  }
  if (spec.decode == DecodeChoice::kCpu) return StageMode::kCpuDecode;
  absl::Status nvjpeg = devices_->NvjpegStatus(spec.gpu_uuid);
  if (nvjpeg.ok()) return StageMode::kNvjpeg;
  if (spec.decode == DecodeChoice::kNvjpeg) return nvjpeg;
  return StageMode::kCpuDecode;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(uint64_t id,
                                                              absl::string_view token) const {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
  }
  if (!TokenEquals(it->second->token(), token)) {
    return absl::PermissionDeniedError(absl::StrCat("wrong token for session ", id));
  }
  return it->second;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::Find(uint64_t id,
                                                              absl::string_view token,
                                                              const Caller& caller) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    // Another uid's session answers exactly as a missing one: ids are no oracle.
    if (it == sessions_.end() || it->second->owner_uid() != caller.uid()) {
      return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
    }
  }
  return Find(id, token);
}

absl::Status SessionManager::Detach(uint64_t id, absl::string_view token, const Caller& caller) {
  // An admin may end any session by its id alone (gpufeedctl sessions shows ids, never
  // tokens); everyone else needs the session's token and must own it.
  absl::StatusOr<std::shared_ptr<Session>> session;
  if (caller.admin) {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("no session ", id, " (detached or expired)"));
    }
    session = it->second;
  } else {
    session = Find(id, token, caller);
  }
  if (!session.ok()) return session.status();
  Remove(id, absl::CancelledError("session detached"),
         (*session)->owner_uid() == caller.uid() ? "detach" : "detach by an admin");
  return absl::OkStatus();
}

absl::Status SessionManager::Detach(uint64_t id, absl::string_view token) {
  absl::StatusOr<std::shared_ptr<Session>> session = Find(id, token);
  if (!session.ok()) return session.status();
  Remove(id, absl::CancelledError("session detached"), "detach");
  return absl::OkStatus();
}

absl::Status SessionManager::CheckQuotaLocked(const Caller& caller, uint64_t bytes) const {
  // Admins are trusted (docs/SECURITY.md section 6): root, the daemon's own uid and those the
  // config names. Their sessions are counted but not capped.
  if (caller.admin) return absl::OkStatus();
  const uint32_t uid = caller.uid();
  auto it = usage_.find(uid);
  const Usage usage = it == usage_.end() ? Usage() : it->second;
  if (options_.max_sessions_per_uid > 0 && usage.sessions >= options_.max_sessions_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_sessions_per_uid: uid ", uid, " has ", usage.sessions,
        " sessions attached, the most one uid may hold; detach one (or an admin raises "
        "max_sessions_per_uid)"));
  }
  const uint64_t quota = options_.max_staging_bytes_per_uid;
  if (quota > 0 && bytes > 0 && (bytes > quota || usage.staging_bytes > quota - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_staging_bytes_per_uid: uid ", uid, "'s rings hold ", usage.staging_bytes,
        " bytes of staging (with their sample ids); a ring of ", bytes,
        " more would pass its quota of ", quota,
        " bytes (use fewer or smaller rings, or an admin raises max_staging_bytes_per_uid)"));
  }
  return absl::OkStatus();
}

void SessionManager::End(uint64_t id, const absl::Status& why) { Remove(id, why, "stream ended"); }

void SessionManager::Remove(uint64_t id, const absl::Status& why, const char* verb) {
  std::shared_ptr<Session> session;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return;
    session = std::move(it->second);
    sessions_.erase(it);
    auto job = jobs_.find(JobKey(session->owner_uid(), session->job()));
    if (job != jobs_.end()) {
      job->second.ranks.erase(session->rank());
      if (job->second.ranks.empty()) jobs_.erase(job);
    }
    auto usage = usage_.find(session->owner_uid());
    if (usage != usage_.end()) {
      --usage->second.sessions;
      usage->second.staging_bytes -=
          std::min(usage->second.staging_bytes, session->quota_bytes());
      if (usage->second.sessions <= 0) usage_.erase(usage);
    }
  }
  session->Close(why);
  spdlog::info("{}: session {} uid {} job '{}' rank {} feed {} ({})", verb, id,
               session->owner_uid(), EscapeForLog(session->job()), session->rank(),
               session->feed().key(), EscapeForLog(why.ToString()));
}

std::vector<SessionSnapshot> SessionManager::ListSessions() const {
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) sessions.push_back(session);
  }
  std::vector<SessionSnapshot> out;
  for (const auto& session : sessions) out.push_back(session->Snapshot());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return out;
}

std::vector<SessionSnapshot> SessionManager::ListSessions(const Caller& caller) const {
  std::vector<SessionSnapshot> out = ListSessions();
  if (caller.admin) return out;
  out.erase(std::remove_if(out.begin(), out.end(),
                           [&](const SessionSnapshot& s) { return s.owner_uid != caller.uid(); }),
            out.end());
  return out;
}

std::vector<FeedSnapshot> SessionManager::ListFeeds() const {
  return ListFeedsWhere(nullptr);
}

std::vector<FeedSnapshot> SessionManager::ListFeeds(const Caller& caller) const {
  if (caller.admin) return ListFeeds();
  // A non-admin sees the feeds its own sessions use; `sessions` counts its own only.
  return ListFeedsWhere(
      [uid = caller.uid()](const Session& s) { return s.owner_uid() == uid; });
}

std::vector<FeedSnapshot> SessionManager::ListFeedsWhere(
    const std::function<bool(const Session&)>& visible) const {
  absl::flat_hash_map<std::string, int32_t> counts;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, session] : sessions_) {
      if (visible == nullptr || visible(*session)) ++counts[session->feed().key()];
    }
  }
  std::vector<FeedSnapshot> out;
  for (const std::shared_ptr<Feed>& feed : feeds_.List()) {
    // Filtered: only the feeds the visible sessions use.
    if (visible != nullptr && !counts.contains(feed->key())) continue;
    FeedSnapshot f;
    f.key = feed->key();
    f.spec = feed->spec();
    f.num_samples = feed->dataset().num_samples();
    f.sessions = counts[feed->key()];
    f.batches_produced = feed->batches_produced();
    f.samples_produced = feed->samples_produced();
    f.bytes_produced = feed->bytes_produced();
    f.bad_samples = BadSamplesOf(feed->dataset());
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return out;
}

int SessionManager::num_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

void SessionManager::BeginDrain() {
  absl::MutexLock lock(&mu_);
  if (!draining_) spdlog::info("draining: new sessions are refused, {} run on", sessions_.size());
  draining_ = true;
}

bool SessionManager::draining() const {
  absl::MutexLock lock(&mu_);
  return draining_;
}

void SessionManager::Schedule(std::shared_ptr<Session> session) {
  const uint64_t id = session->id();
  absl::Status s = workers_.TrySubmit([session = std::move(session)] { session->FillOne(); });
  if (!s.ok() && !workers_.closed()) {
    // Cannot happen while the capacity bound holds; never leave a session silently stuck.
    spdlog::error("session {}: fill queue full ({}); ending the session", id, s.ToString());
    Remove(id, absl::InternalError("gpufeedd fill queue overflow"), "abort");
  }
}

void SessionManager::Submit(std::function<void()> work) {
  absl::Status s = workers_.TrySubmit(work);
  if (s.ok()) return;
  if (!workers_.closed()) {
    // Cannot happen while the capacity bound holds.
    spdlog::error("fill queue full ({}): running a task on the caller's thread", s.ToString());
  }
  work();
}

void SessionManager::ParallelFor(int n, const std::function<void(int)>& fn) {
  workers_.ParallelFor(n, fn);
}

void SessionManager::ReaperLoop() {
  while (!stop_reaper_.WaitForNotificationWithTimeout(options_.reap_interval)) {
    std::vector<uint64_t> expired;
    std::vector<uint64_t> orphaned;  // the consumer went before opening its stream
    std::vector<uint64_t> idle;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = options_.clock();
      for (const auto& [id, session] : sessions_) {
        if (!session->streaming() && now - session->attached_at() > options_.attach_timeout) {
          expired.push_back(id);
        } else if (!session->streaming() && session->LifelineClosed()) {
          orphaned.push_back(id);
        } else if (options_.idle_lease_timeout > absl::ZeroDuration() &&
                   !session->device_delivery() &&
                   now - session->all_leased_since() >= options_.idle_lease_timeout) {
          // all_leased_since is InfiniteFuture unless every slot is held: now - it < 0.
          idle.push_back(id);
        }
      }
    }
    for (uint64_t id : expired) {
      Remove(id,
             absl::DeadlineExceededError(absl::StrCat(
                 "no stream opened within ", absl::FormatDuration(options_.attach_timeout),
                 " of Attach")),
             "lease expired");
    }
    for (uint64_t id : orphaned) {
      lifeline_reclaims_.fetch_add(1, std::memory_order_relaxed);
      Remove(id,
             absl::CancelledError(
                 "the consumer closed its connection (exited or was killed) before opening its "
                 "stream"),
             "consumer gone before its stream");
    }
    for (uint64_t id : idle) {
      Remove(id,
             absl::DeadlineExceededError(absl::StrCat(
                 "idle lease: the consumer held every slot of its ring and released none for ",
                 absl::FormatDuration(options_.idle_lease_timeout),
                 " (idle_lease_timeout); the session is ended")),
             "idle lease");
    }
    reap_rounds_.fetch_add(1, std::memory_order_release);
  }
}

void SessionManager::Shutdown(const absl::Status& reason) {
  feeds_.CancelOpens();  // an attach walking a folder ends now, not after the walk
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [id, session] : sessions_) sessions.push_back(std::move(session));
    sessions_.clear();
    jobs_.clear();
    usage_.clear();
  }
  for (const auto& session : sessions) {
    session->KeepRingPagesForConsumer();  // held batches keep their bytes across a restart
    session->Close(reason);
  }
  workers_.Shutdown(reason);
  stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
}

}  // namespace gpufeed::server
