#include "client/cpp/options.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cpp/blend.h"
#include "client/cpp/pipeline_json.h"
#include "common/shard_list.h"
#include "common/status.h"

namespace gpufeed::client::internal {
namespace {

// The records arrays of `o` as DatasetSpec.arrays beneath one directory, which is returned:
// `o.dataset` when set (files are names in it), else the one directory of the files' absolute
// paths. The daemon checks names and files again (the socket is a trust boundary); this
// words what the user wrote.
absl::StatusOr<std::string> ArraysInto(const AttachOptions& o, v1::DatasetSpec* d) {
  std::string dir = o.dataset;
  for (size_t i = 0; i < o.arrays.size(); ++i) {
    const auto& [name, file] = o.arrays[i];
    std::string base = file;
    if (o.dataset.empty()) {
      const size_t slash = file.find_last_of('/');
      if (file.empty() || file[0] != '/' || slash + 1 == file.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "arrays: '", name, "' is '", file,
            "'; without dataset (the arrays' directory) each file must be an absolute path"));
      }
      const std::string parent = slash == 0 ? "/" : file.substr(0, slash);
      if (i == 0) dir = parent;
      if (parent != dir) {
        return absl::InvalidArgumentError(absl::StrCat(
            "arrays: '", o.arrays[0].first, "' (", o.arrays[0].second, ") and '", name, "' (", file,
            ") lie in different directories; the arrays of one records dataset share one"));
      }
      base = file.substr(slash + 1);
    }
    v1::RecordArray* a = d->add_arrays();
    a->set_name(name);
    a->set_file(base);
  }
  return dir;
}

}  // namespace

absl::StatusOr<AttachPlan> AttachPlanFromOptions(const AttachOptions& o) {
  AttachPlan plan;
  v1::AttachRequest& request = plan.request;
  request.set_job(o.job);
  request.set_rank(o.rank);
  request.set_world_size(o.world_size);
  v1::DatasetSpec* d = request.mutable_dataset();
  if (o.kind == "tokens") {
    d->set_kind(v1::DATASET_KIND_TOKENS);
    const DType t = o.token_dtype.empty() ? DType::kUnspecified : DTypeFromName(o.token_dtype);
    if (!o.token_dtype.empty() && t != DType::kUInt16 && t != DType::kUInt32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token_dtype: must be uint16 or uint32 (or empty: the .npy header's, else uint16), "
          "got '", o.token_dtype, "'"));
    }
    d->set_token_dtype(static_cast<v1::DType>(t));
    d->set_seq_len(o.seq_len);
    if (o.vocab_size < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("vocab_size: must be >= 0 (0: not checked), got ", o.vocab_size));
    }
    d->set_vocab_size(static_cast<uint64_t>(o.vocab_size));
  } else if (o.kind == "records") {
    d->set_kind(v1::DATASET_KIND_RECORDS);
  } else if (o.kind == "image_folder") {
    d->set_kind(v1::DATASET_KIND_IMAGE_FOLDER);
  } else if (o.kind == "webdataset") {
    d->set_kind(v1::DATASET_KIND_WEBDATASET);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("kind: unknown dataset kind '", o.kind,
                     "' (want tokens, records, image_folder or webdataset)"));
  }
  if (o.bad_sample == "skip") {
    request.set_bad_sample(v1::BAD_SAMPLE_POLICY_SKIP);
  } else if (o.bad_sample == "fail") {
    request.set_bad_sample(v1::BAD_SAMPLE_POLICY_FAIL);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("bad_sample: want skip or fail, got '", o.bad_sample, "'"));
  }
  static const std::pair<const char*, v1::ImageDecode> kDecode[] = {
      {"auto", v1::IMAGE_DECODE_AUTO}, {"cpu", v1::IMAGE_DECODE_CPU},
      {"nvjpeg", v1::IMAGE_DECODE_NVJPEG}};
  static const std::pair<const char*, v1::ImageAugment> kAugment[] = {
      {"auto", v1::IMAGE_AUGMENT_AUTO}, {"cpu", v1::IMAGE_AUGMENT_CPU},
      {"gpu", v1::IMAGE_AUGMENT_GPU}};
  bool known = false;
  for (const auto& [name, value] : kDecode) {
    if (o.decode == name) request.set_decode(value), known = true;
  }
  if (!known) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode: want auto, cpu or nvjpeg, got '", o.decode, "'"));
  }
  known = false;
  for (const auto& [name, value] : kAugment) {
    if (o.augment == name) request.set_augment(value), known = true;
  }
  if (!known) {
    return absl::InvalidArgumentError(
        absl::StrCat("augment: want auto, cpu or gpu, got '", o.augment, "'"));
  }
  if (!o.arrays.empty() && o.kind != "records") {
    return absl::InvalidArgumentError(absl::StrCat("arrays: only for kind records, not ", o.kind));
  }
  // Before the dataset's own checks: a blend given with a dataset names both.
  GPUFEED_RETURN_IF_ERROR(BlendInto(o, d));
  if (!o.dataset_paths.empty()) {
    if (o.kind != "tokens" && o.kind != "webdataset") {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.paths: a list of shard files is for kind tokens and webdataset, not ", o.kind));
    }
    if (!o.dataset.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset: '", o.dataset, "' and a list of ", o.dataset_paths.size(),
                       " shard files (dataset_paths) given together; give one"));
    }
    if (o.dataset_paths.size() > kMaxListedShards) {
      return absl::InvalidArgumentError(absl::StrCat("dataset.paths: ", o.dataset_paths.size(),
                                                     " files, at most ", kMaxListedShards,
                                                     "; name their directory or a glob instead"));
    }
    size_t bytes = 0;
    for (size_t i = 0; i < o.dataset_paths.size(); ++i) {
      const std::string& p = o.dataset_paths[i];
      bytes += p.size();
      if (p.empty() || p[0] != '/' || p.back() == '/') {
        return absl::InvalidArgumentError(
            absl::StrCat("dataset.paths[", i, "]: '", p, "' is not an absolute path of a file"));
      }
      d->add_paths(p);
    }
    if (bytes > kMaxListedShardBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.paths: ", bytes, " bytes of paths, at most ", kMaxListedShardBytes,
                       "; name their directory or a glob instead"));
    }
  } else if (o.arrays.empty()) {
    d->set_path(o.dataset);
  } else {
    GPUFEED_ASSIGN_OR_RETURN(std::string dir, ArraysInto(o, d));
    d->set_path(std::move(dir));
  }
  request.set_batch_size(o.batch_size);
  request.set_seed(o.seed);
  request.set_shuffle(o.shuffle);
  request.set_drop_last(o.drop_last);
  request.set_even(o.even);
  request.set_share_group(o.share_group);
  request.set_ring_slots(o.ring_slots);
  if (o.delivery == "host") {
    request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_HOST);
  } else if (o.delivery == "device") {
    request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_DEVICE);
    GPUFEED_ASSIGN_OR_RETURN(plan.gpu, ResolveGpu(o.gpu));
    request.mutable_delivery()->set_gpu_uuid(plan.gpu.uuid);
    if (o.ipc == "vmm") {
      request.mutable_delivery()->set_ipc(v1::IPC_KIND_VMM);
    } else if (o.ipc == "legacy") {
      request.mutable_delivery()->set_ipc(v1::IPC_KIND_LEGACY);
    } else if (o.ipc != "auto" && !o.ipc.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("ipc: unknown kind '", o.ipc, "' (want auto, vmm or legacy)"));
    }
    plan.device = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("delivery: unknown kind '", o.delivery, "' (want host or device)"));
  }
  request.mutable_start()->set_epoch(o.start.epoch);
  request.mutable_start()->set_step(o.start.step);
  request.mutable_start()->set_samples(o.start.samples);
  request.mutable_start()->set_fingerprint(o.start.fingerprint);
  if (o.elastic == "global_batch") {
    request.set_elastic(v1::ELASTIC_KEEP_GLOBAL_BATCH);
  } else if (o.elastic == "rank_batch") {
    request.set_elastic(v1::ELASTIC_KEEP_RANK_BATCH);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("elastic: want global_batch or rank_batch, got '", o.elastic, "'"));
  }
  request.set_stop_epoch(o.stop_epoch);
  if (!o.pipeline_json.empty()) {
    GPUFEED_ASSIGN_OR_RETURN(v1::Pipeline pipeline, ParsePipelineJson(o.pipeline_json));
    *request.mutable_pipeline() = std::move(*pipeline.mutable_ops());
  }
  return plan;
}

}  // namespace gpufeed::client::internal
