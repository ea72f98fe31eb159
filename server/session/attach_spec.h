// The first step of Attach: what a consumer asks for (AttachSpec, converted from the wire by
// service/convert.cc), and every rule about it, each stated once. The rules that need only
// the spec run before anything is opened; those that need the opened feed or this daemon's
// GPUs run where the manager has them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/auth/caller.h"
#include "server/device/device_backend.h"
#include "server/feed/feed.h"
#include "server/session/session.h"

namespace gpufeed::server {

// What a resume at another world layout keeps (AttachRequest.elastic; session/elastic.h).
enum class ElasticMode { kKeepGlobalBatch, kKeepRankBatch };

struct AttachSpec {
  // Who attaches (peer credentials and policy, from the service layer): the session's owner;
  // feed.dataset.handle must be this uid's, and no handle needs caller.admin.
  Caller caller;
  // Namespaced by the caller's uid: job "train" of uid 1000 is not job "train" of uid 1001.
  std::string job;
  int32_t rank = 0;
  FeedSpec feed;
  int32_t ring_slots = 0;  // 0 = default
  DeliveryKind delivery = DeliveryKind::kHost;
  std::string gpu_uuid;
  IpcKind ipc = IpcKind::kUnspecified;
  Position start;
  // The fingerprint saved with `start`; empty: not checked. A different one is refused,
  // its layout items aside (fingerprint.h: a resume at another layout is elastic).
  std::string start_fingerprint;
  // The global cursor saved with `start` (Position.samples); 0: step x the saved global
  // batch. ResolveElastic turns it and `elastic` into start, batch_size and the feed's
  // resume fields.
  int64_t start_samples = 0;
  ElasticMode elastic = ElasticMode::kKeepGlobalBatch;
  // Set by ResolveElastic: the saved layout differs from this job's.
  bool relaid = false;
  int64_t stop_epoch = 0;
  DecodeChoice decode = DecodeChoice::kAuto;
  AugmentChoice augment = AugmentChoice::kAuto;
  // A client's re-attach after its stream failed (AttachRequest.resume_gap_ms > 0): how
  // long it had been without one. Counted and logged, nothing else.
  absl::Duration resume_gap = absl::ZeroDuration();
};

inline constexpr size_t kMaxJobNameBytes = 128;

// Checks what can be checked without opening the dataset; INVALID_ARGUMENT naming the field.
// A job name is 1 to 128 bytes of [A-Za-z0-9._:@+=/-]. The dataset's kind is the
// conversion's to check (an enum the wire may carry out of range); this takes it as given.
// The sharing group's rules (docs/ARCHITECTURE.md section 9): its name, an image dataset,
// no dct_scaling, no nvJPEG; OK without a group. INVALID_ARGUMENT naming share_group.
absl::Status CheckShareGroup(const AttachSpec& spec);
absl::Status ValidateAttachSpec(const AttachSpec& spec, int32_t max_ring_slots);

// Device delivery needs a GPU of this daemon (FAILED_PRECONDITION; `devices` may be null)
// and names the consumer's (INVALID_ARGUMENT); host delivery needs neither.
absl::Status CheckDeviceDelivery(const AttachSpec& spec, const DeviceBackend* devices);

// The spec against the feed it opened: a saved position resumes only the feed it came from
// (start_fingerprint, FAILED_PRECONDITION naming each field that differs), and start.step
// lies within an epoch (INVALID_ARGUMENT).
absl::Status CheckAgainstFeed(const AttachSpec& spec, const Feed& feed);

// Where a session's images are decoded and augmented, from Attach's choices, the delivery
// and what the device backend can do; INVALID_ARGUMENT / FAILED_PRECONDITION naming the
// field when the choice cannot be served. `devices` is consulted only for device delivery,
// which CheckDeviceDelivery has admitted.
absl::StatusOr<StageMode> ResolveStage(const AttachSpec& spec, const Feed& feed,
                                       DeviceBackend* devices);

}  // namespace gpufeed::server
