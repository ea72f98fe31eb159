#include "server/service/convert.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace gpufeed::server {

absl::StatusOr<std::vector<PipelineStep>> PipelineFromProto(
    const google::protobuf::RepeatedPtrField<v1::PipelineOp>& ops) {
  std::vector<PipelineStep> steps;
  for (int i = 0; i < ops.size(); ++i) {
    const v1::PipelineOp& op = ops[i];
    switch (op.op_case()) {
      case v1::PipelineOp::kRandomResizedCrop: {
        const v1::RandomResizedCropOp& o = op.random_resized_crop();
        RandomResizedCropStep step;
        step.size = o.size();
        // Zero (unset) means torchvision's default.
        if (o.scale_min() != 0) step.options.scale_min = o.scale_min();
        if (o.scale_max() != 0) step.options.scale_max = o.scale_max();
        if (o.ratio_min() != 0) step.options.ratio_min = o.ratio_min();
        if (o.ratio_max() != 0) step.options.ratio_max = o.ratio_max();
        steps.push_back(step);
        break;
      }
      case v1::PipelineOp::kResize:
        steps.push_back(ResizeStep{op.resize().shorter_side()});
        break;
      case v1::PipelineOp::kCenterCrop:
        steps.push_back(CenterCropStep{op.center_crop().size()});
        break;
      case v1::PipelineOp::kFlip:
        steps.push_back(FlipStep{op.flip().p()});
        break;
      case v1::PipelineOp::kNormalize:
        steps.push_back(NormalizeStep{{op.normalize().mean().begin(), op.normalize().mean().end()},
                                      {op.normalize().std().begin(), op.normalize().std().end()}});
        break;
      case v1::PipelineOp::kCast:
        steps.push_back(CastStep{static_cast<DType>(op.cast().dtype())});
        break;
      case v1::PipelineOp::kLayout:
        steps.push_back(LayoutStep{op.layout().layout() == v1::IMAGE_LAYOUT_NHWC ? Layout::kNHWC
                                                                                 : Layout::kNCHW});
        break;
      case v1::PipelineOp::kDecode:
        steps.push_back(DecodeStep{op.decode().dct_scaling()});
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("pipeline[", i, "]: no op set"));
    }
  }
  return steps;
}

absl::StatusOr<AttachSpec> AttachSpecFromProto(const v1::AttachRequest& r) {
  AttachSpec spec;
  spec.job = r.job();
  spec.rank = r.rank();
  spec.feed.world_size = r.world_size();
  spec.feed.batch_size = r.batch_size();
  spec.feed.seed = r.seed();
  spec.feed.shuffle = r.shuffle();
  spec.feed.drop_last = r.drop_last();
  spec.feed.even = r.even();
  spec.feed.share_group = r.share_group();
  spec.ring_slots = r.ring_slots();
  spec.start = {r.start().epoch(), r.start().step()};
  spec.resume_gap = absl::Milliseconds(static_cast<int64_t>(
      std::min<uint64_t>(r.resume_gap_ms(), uint64_t{1} << 40)));  // no overflow downstream
  spec.start_fingerprint = r.start().fingerprint();
  spec.start_samples = r.start().samples();
  switch (r.elastic()) {
    case v1::ELASTIC_KEEP_GLOBAL_BATCH:
      spec.elastic = ElasticMode::kKeepGlobalBatch;
      break;
    case v1::ELASTIC_KEEP_RANK_BATCH:
      spec.elastic = ElasticMode::kKeepRankBatch;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("elastic: unknown value ", static_cast<int>(r.elastic()),
                       " (0 keeps the global batch, 1 the per-rank batch)"));
  }
  spec.stop_epoch = r.stop_epoch();

  const v1::DatasetSpec& d = r.dataset();
  switch (d.kind()) {
    case v1::DATASET_KIND_TOKENS:
      spec.feed.dataset.kind = DatasetKind::kTokens;
      break;
    case v1::DATASET_KIND_RECORDS:
      spec.feed.dataset.kind = DatasetKind::kRecords;
      break;
    case v1::DATASET_KIND_IMAGE_FOLDER:
      spec.feed.dataset.kind = DatasetKind::kImageFolder;
      break;
    case v1::DATASET_KIND_WEBDATASET:
      spec.feed.dataset.kind = DatasetKind::kWebDataset;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.kind: unknown kind ", static_cast<int>(d.kind()),
                       " (want tokens, records, image_folder or webdataset)"));
  }
  switch (r.bad_sample()) {
    case v1::BAD_SAMPLE_POLICY_UNSPECIFIED:
    case v1::BAD_SAMPLE_POLICY_SKIP:
      spec.feed.dataset.bad_sample = BadSamplePolicy::kSkip;
      break;
    case v1::BAD_SAMPLE_POLICY_FAIL:
      spec.feed.dataset.bad_sample = BadSamplePolicy::kFail;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("bad_sample: unknown policy ", static_cast<int>(r.bad_sample())));
  }
  switch (r.decode()) {
    case v1::IMAGE_DECODE_AUTO: spec.decode = DecodeChoice::kAuto; break;
    case v1::IMAGE_DECODE_CPU: spec.decode = DecodeChoice::kCpu; break;
    case v1::IMAGE_DECODE_NVJPEG: spec.decode = DecodeChoice::kNvjpeg; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("decode: unknown decoder ", static_cast<int>(r.decode())));
  }
  switch (r.augment()) {
    case v1::IMAGE_AUGMENT_AUTO: spec.augment = AugmentChoice::kAuto; break;
    case v1::IMAGE_AUGMENT_CPU: spec.augment = AugmentChoice::kCpu; break;
    case v1::IMAGE_AUGMENT_GPU: spec.augment = AugmentChoice::kGpu; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("augment: unknown place ", static_cast<int>(r.augment())));
  }
  spec.feed.dataset.path = d.path();
  spec.feed.dataset.handle = d.handle();  // resolved by the feed registry (SECURITY.md 2)
  spec.feed.dataset.token_dtype = static_cast<DType>(d.token_dtype());
  spec.feed.dataset.seq_len = d.seq_len();
  spec.feed.dataset.vocab_size = d.vocab_size();
  // Copied as they come (a request is at most the server's 4 MiB receive limit); their
  // counts, names and kinds are the spec's rules (ValidateAttachSpec).
  for (const v1::RecordArray& a : d.arrays()) {
    spec.feed.dataset.arrays.push_back({a.name(), a.file()});
  }
  spec.feed.dataset.paths.assign(d.paths().begin(), d.paths().end());
  // A blend and packing (feed/lm_dataset.h; LmSpec::Validate bounds them).
  LmSpec& lm = spec.feed.lm;
  for (const v1::BlendSource& source : d.sources()) {
    lm.sources.push_back(
        {{source.paths().begin(), source.paths().end()}, source.weight(), source.name()});
  }
  switch (d.pack()) {
    case v1::PACK_MODE_NONE: lm.pack = PackMode::kNone; break;
    case v1::PACK_MODE_CONCAT: lm.pack = PackMode::kConcat; break;
    case v1::PACK_MODE_BEST_FIT: lm.pack = PackMode::kBestFit; break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.pack: unknown mode ", static_cast<int>(d.pack()),
                       " (want none, concat or best_fit)"));
  }
  if (d.has_eos_id()) lm.eos_id = d.eos_id();
  lm.lookahead = d.pack_lookahead();
  for (const v1::BlendSegment& segment : d.blend_history()) {
    lm.history.push_back({segment.start(),
                          {segment.weights().begin(), segment.weights().end()},
                          {segment.ledger().begin(), segment.ledger().end()}});
  }

  switch (r.delivery().kind()) {
    case v1::DELIVERY_KIND_UNSPECIFIED:
    case v1::DELIVERY_KIND_HOST:
      spec.delivery = DeliveryKind::kHost;
      break;
    case v1::DELIVERY_KIND_DEVICE:
      spec.delivery = DeliveryKind::kDevice;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "delivery.kind: unknown kind ", static_cast<int>(r.delivery().kind())));
  }
  if (!r.pipeline().empty()) {
    absl::StatusOr<std::vector<PipelineStep>> steps = PipelineFromProto(r.pipeline());
    if (!steps.ok()) return steps.status();
    spec.feed.dataset.pipeline = std::move(*steps);
  }
  spec.gpu_uuid = r.delivery().gpu_uuid();
  switch (r.delivery().ipc()) {
    case v1::IPC_KIND_UNSPECIFIED:
      spec.ipc = IpcKind::kUnspecified;
      break;
    case v1::IPC_KIND_VMM:
      spec.ipc = IpcKind::kVmm;
      break;
    case v1::IPC_KIND_LEGACY:
      spec.ipc = IpcKind::kLegacy;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("delivery.ipc: unknown kind ", static_cast<int>(r.delivery().ipc())));
  }
  return spec;
}

void ToProto(const Position& position, uint64_t samples, v1::Position* out) {
  out->set_epoch(position.epoch);
  out->set_step(position.step);
  out->set_samples(static_cast<int64_t>(samples));
}

void ToProto(const Attachment& a, v1::AttachResponse* out) {
  out->set_session_id(a.session_id);
  out->set_token(a.token);
  out->set_feed_key(a.feed_key);
  out->set_num_samples(static_cast<int64_t>(a.num_samples));
  out->set_steps_per_epoch(a.steps_per_epoch);
  out->set_ring_slots(a.ring_slots);
  out->set_slot_stride_bytes(a.layout.stride_bytes);
  for (const TensorLayout& t : a.layout.tensors) {
    v1::TensorLayout* p = out->add_tensors();
    p->set_name(t.name);
    p->set_dtype(static_cast<v1::DType>(t.dtype));
    for (int64_t d : t.shape) p->add_shape(d);
    p->set_byte_offset(t.byte_offset);
    p->set_byte_size(t.byte_size);
  }
  ToProto(a.start, a.start_samples, out->mutable_start());
  out->set_batch_size(a.batch_size);
  for (const BlendSegment& segment : a.blend_segments) {
    v1::BlendSegment* s = out->add_blend_segments();
    s->set_start(segment.start);
    for (const double w : segment.weights) s->add_weights(w);
    for (const uint64_t c : segment.ledger) s->add_ledger(c);
  }
  out->mutable_start()->set_fingerprint(a.fingerprint);
  if (a.device) {
    v1::DeviceRing* d = out->mutable_device();
    d->set_ipc(a.device_ring.ipc == IpcKind::kLegacy ? v1::IPC_KIND_LEGACY : v1::IPC_KIND_VMM);
    d->set_gpu_uuid(a.device_ring.gpu_uuid);
    d->set_mps(a.device_ring.mps);
    d->set_alloc_bytes(a.device_ring.alloc_bytes);
    d->set_legacy_mem_handle(a.device_ring.legacy_mem_handle);
    for (const std::string& h : a.device_ring.ready_event_handles) d->add_ready_event_handles(h);
  }
  if (a.image) {
    out->set_decode(a.stage == StageMode::kNvjpeg ? "nvjpeg" : "cpu");
    out->set_augment(a.stage == StageMode::kNone ? "cpu" : "gpu");
  }
  for (const DatasetNotice& n : a.notices) {
    v1::DatasetNotice* p = out->add_notices();
    p->set_reason(n.reason);
    p->set_count(n.count);
    p->set_example(n.example);
    p->set_message(n.message);
  }
}

void ToProto(const ReadyBatch& b, v1::BatchReady* out) {
  out->set_slot(b.slot);
  out->set_generation(b.generation);
  out->set_epoch(b.position.epoch);
  out->set_step(b.position.step);
  out->mutable_ids()->Add(b.ids.begin(), b.ids.end());
  out->set_valid_count(b.valid);
  out->set_samples(static_cast<int64_t>(b.samples_after));
  out->set_end_of_epoch(b.end_of_epoch);
}

void ToProto(const SessionSnapshot& s, v1::SessionInfo* out) {
  out->set_session_id(s.id);
  out->set_owner_uid(s.owner_uid);
  out->set_job(s.job);
  out->set_rank(s.rank);
  out->set_world_size(s.world_size);
  out->set_feed_key(s.feed_key);
  out->set_delivery(s.delivery == DeliveryKind::kDevice ? v1::DELIVERY_KIND_DEVICE
                                                        : v1::DELIVERY_KIND_HOST);
  ToProto(s.delivered, s.delivered_samples, out->mutable_delivered());
  out->set_ring_slots(s.ring_slots);
  out->set_slots_leased(s.slots_leased);
  out->set_ring_bytes(s.ring_bytes);
  out->set_batches_delivered(s.batches_delivered);
  out->set_streaming(s.streaming);
  out->set_age_ms(absl::ToInt64Milliseconds(s.age));
  out->set_gpu_uuid(s.gpu_uuid);
  out->set_bytes_delivered(s.bytes_delivered);
  out->set_producer_blocked_ns(absl::ToInt64Nanoseconds(s.producer_blocked));
  out->set_consumer_wait_ns(absl::ToInt64Nanoseconds(s.consumer_wait));
  out->set_cpu_decode_share(s.cpu_decode_share);
  out->set_streaming_ns(absl::ToInt64Nanoseconds(s.streaming_for));
}

void ToProto(const FeedSnapshot& f, v1::FeedInfo* out) {
  out->set_key(f.key);
  v1::DatasetSpec* d = out->mutable_dataset();
  d->set_kind(static_cast<v1::DatasetKind>(f.spec.dataset.kind));
  d->set_path(f.spec.dataset.path);
  d->set_token_dtype(static_cast<v1::DType>(f.spec.dataset.token_dtype));
  d->set_seq_len(f.spec.dataset.seq_len);
  d->set_vocab_size(f.spec.dataset.vocab_size);
  for (const RecordArraySpec& a : f.spec.dataset.arrays) {
    v1::RecordArray* out_array = d->add_arrays();
    out_array->set_name(a.name);
    out_array->set_file(a.file);
  }
  // A blend's sources as the user named them, with their weights (not their files: up to
  // 16,384 a source), and the pack mode.
  for (const LmSourceSpec& source : f.spec.lm.sources) {
    v1::BlendSource* out_source = d->add_sources();
    out_source->set_name(source.name);
    out_source->set_weight(source.weight);
  }
  d->set_pack(static_cast<v1::PackMode>(f.spec.lm.pack));
  if (f.spec.lm.eos_id.has_value()) d->set_eos_id(*f.spec.lm.eos_id);
  d->set_pack_lookahead(static_cast<uint32_t>(f.spec.lm.lookahead));
  out->set_num_samples(static_cast<int64_t>(f.num_samples));
  out->set_batch_size(f.spec.batch_size);
  out->set_world_size(f.spec.world_size);
  out->set_seed(f.spec.seed);
  out->set_shuffle(f.spec.shuffle);
  out->set_drop_last(f.spec.drop_last);
  out->set_even(f.spec.even);
  out->set_share_group(f.spec.share_group);
  out->set_sessions(f.sessions);
  out->set_batches_produced(f.batches_produced);
  out->set_bytes_produced(f.bytes_produced);
  for (const auto& [reason, count] : f.bad_samples) (*out->mutable_bad_samples())[reason] = count;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

objstore::ObjectStoreAccess ToObjectStoreAccess(const v1::ObjectStoreAccess& access) {
  objstore::ObjectStoreAccess out;
  out.credentials.access_key_id = access.access_key_id();
  out.credentials.secret_access_key = access.secret_access_key();
  out.credentials.session_token = access.session_token();
  out.web_identity_token = access.web_identity_token();
  out.role_arn = access.role_arn();
  out.role_session_name = access.role_session_name();
  out.region = access.region();
  out.endpoint = access.endpoint_url();
  out.anonymous = access.anonymous();
  return out;
}

}  // namespace gpufeed::server
