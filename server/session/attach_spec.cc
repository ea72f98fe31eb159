#include "server/session/attach_spec.h"

#include <algorithm>
#include <variant>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/augment/pipeline.h"
#include "server/objstore/object_store.h"
#include "server/reader/shards.h"

namespace gpufeed::server {
namespace {

bool IsJobNameByte(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         absl::string_view("._:@+=/-").find(c) != absl::string_view::npos;
}

// The dataset's fields that belong to one kind: token fields to tokens, arrays to records,
// an explicit list of files to tokens and webdataset (ValidateShardPaths).
absl::Status CheckFieldsOfKind(const FileDatasetSpec& dataset) {
  if (dataset.kind != DatasetKind::kTokens &&
      (dataset.token_dtype != DType::kUnspecified || dataset.seq_len != 0 ||
       dataset.vocab_size != 0)) {
    return absl::InvalidArgumentError(
        "dataset.token_dtype, dataset.seq_len, dataset.vocab_size: only for kind tokens");
  }
  if (!dataset.arrays.empty()) {
    if (dataset.kind != DatasetKind::kRecords) {
      return absl::InvalidArgumentError(
          "dataset.arrays: only for kind records (several .npy arrays, one tensor each)");
    }
    GPUFEED_RETURN_IF_ERROR(ValidateRecordArrays(dataset.arrays));
  }
  return ValidateShardPaths(dataset);
}

}  // namespace

absl::Status CheckShareGroup(const AttachSpec& spec) {
  const std::string& name = spec.feed.share_group;
  if (name.empty()) return absl::OkStatus();
  if (name.size() > kMaxJobNameBytes ||
      !std::all_of(name.begin(), name.end(), [](char c) { return IsJobNameByte(c); })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "share_group: a group name is 1 to ", kMaxJobNameBytes,
        " bytes of [A-Za-z0-9._:@+=/-], got '", EscapeForLog(name), "'"));
  }
  const DatasetSpec& dataset = spec.feed.dataset;
  if (!IsImageKind(dataset.kind)) {
    return absl::InvalidArgumentError(
        "share_group: only image datasets (image_folder, webdataset) share their decodes; "
        "token and record feeds have nothing to decode");
  }
  for (const PipelineStep& step : dataset.pipeline) {
    if (const auto* decode = std::get_if<DecodeStep>(&step); decode && decode->dct_scaling) {
      return absl::InvalidArgumentError(
          "share_group: decode(dct) decodes each sample at a scale of its own crop, so no "
          "decode serves another job; drop dct_scaling or the group");
    }
  }
  if (spec.decode == DecodeChoice::kNvjpeg) {
    return absl::InvalidArgumentError(
        "share_group: a group decodes on the CPU (nvJPEG's pixels are not libjpeg-turbo's, and "
        "a shared decode must be the one the job would make); use decode cpu or auto");
  }
  return absl::OkStatus();
}

absl::Status ValidateAttachSpec(const AttachSpec& spec, int32_t max_ring_slots) {
  GPUFEED_RETURN_IF_ERROR(CheckFieldsOfKind(spec.feed.dataset));
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
  const bool object_store = absl::StartsWith(dataset.path, "s3://");
  if (!object_store && (dataset.path.empty() || dataset.path[0] != '/')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.path: must be an absolute path or an s3:// URL, got '", dataset.path, "'"));
  }
  if (object_store) {
    // The forms an object store's dataset takes (docs/howto/object-storage.md): checked here,
    // before any request leaves the node.
    GPUFEED_RETURN_IF_ERROR(objstore::ParseS3Path(dataset.path, "dataset.path").status());
    if (!dataset.paths.empty() || !dataset.arrays.empty()) {
      return absl::InvalidArgumentError(
          "dataset.paths: not for an s3:// dataset (name a directory, a glob or one object)");
    }
  }
  GPUFEED_RETURN_IF_ERROR(spec.feed.lm.Validate(dataset));
  return CheckShareGroup(spec);
}

absl::Status CheckDeviceDelivery(const AttachSpec& spec, const DeviceBackend* devices) {
  if (spec.delivery != DeliveryKind::kDevice) return absl::OkStatus();
  if (devices == nullptr || devices->gpu_uuids().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("delivery: ", kNoGpuMessage, "; attach with host delivery"));
  }
  if (spec.gpu_uuid.empty()) {
    return absl::InvalidArgumentError(
        "delivery.gpu_uuid: device delivery names the consumer's GPU by UUID");
  }
  return absl::OkStatus();
}

absl::Status CheckAgainstFeed(const AttachSpec& spec, const Feed& feed) {
  if (!spec.start_fingerprint.empty()) {
    GPUFEED_RETURN_IF_ERROR(CompareFingerprints(spec.start_fingerprint, feed.fingerprint()));
  }
  const int64_t steps = feed.sampler().steps_per_epoch();
  if (spec.start.step >= steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "start.step: ", spec.start.step, " is past the epoch's last step (steps_per_epoch = ",
        steps, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<StageMode> ResolveStage(const AttachSpec& spec, const Feed& feed,
                                       DeviceBackend* devices) {
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
  if (!devices->can_stage()) {
    if (spec.augment == AugmentChoice::kGpu || spec.decode == DecodeChoice::kNvjpeg) {
      return absl::FailedPreconditionError(
          "augment: this gpufeedd was built without the GPU augment kernel");
    }
    return StageMode::kNone;
  }
  // A sharing group decodes on the CPU: nvJPEG's pixels are not libjpeg-turbo's, and a row
  // taken from the group's cache must be the row the job's own decode gives.
  if (spec.decode == DecodeChoice::kCpu || !spec.feed.share_group.empty()) {
    return StageMode::kCpuDecode;
  }
  absl::Status nvjpeg = devices->NvjpegStatus(spec.gpu_uuid);
  if (nvjpeg.ok()) return StageMode::kNvjpeg;
  if (spec.decode == DecodeChoice::kNvjpeg) return nvjpeg;
  return StageMode::kCpuDecode;
}

}  // namespace gpufeed::server
