// The C ABI over the C++ client: every failure becomes a code plus a thread-local message.
#include "gpufeed/gpufeed.h"

#include <cmath>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gpufeed/client.h"

struct gpufeed_options {
  gpufeed::client::AttachOptions attach;
};

struct gpufeed_session {
  std::unique_ptr<gpufeed::client::Session> session;
  std::string fingerprint;  // the feed's, from Attach
  // gpufeed_session_blend_segments_json's last answer (the segments may change at a
  // re-attach, which Next does).
  std::string blend_segments_json;
};

struct gpufeed_batch {
  gpufeed::client::Batch batch;
};

namespace {

thread_local std::string last_error;

gpufeed_status Fail(const absl::Status& status) {
  last_error = std::string(status.message());
  return static_cast<gpufeed_status>(status.code());
}

gpufeed_status Invalid(const std::string& message) {
  last_error = message;
  return GPUFEED_INVALID_ARGUMENT;
}

gpufeed_status Ok() {
  last_error.clear();
  return GPUFEED_OK;
}

}  // namespace

extern "C" {

uint32_t gpufeed_api_version(void) { return GPUFEED_API_VERSION; }

const char* gpufeed_default_socket(void) {
  thread_local std::string socket;
  socket = gpufeed::client::DefaultSocket();
  return socket.c_str();
}

const char* gpufeed_last_error(void) { return last_error.c_str(); }

gpufeed_status gpufeed_options_create(gpufeed_options** out_options) {
  if (out_options == nullptr) return Invalid("out_options is NULL");
  *out_options = new gpufeed_options();
  return Ok();
}

void gpufeed_options_destroy(gpufeed_options* options) { delete options; }

gpufeed_status gpufeed_options_set_string(gpufeed_options* options, const char* key,
                                          const char* value) {
  if (options == nullptr || key == nullptr || value == nullptr) {
    return Invalid("options, key and value must not be NULL");
  }
  const std::string k = key;
  gpufeed::client::AttachOptions& o = options->attach;
  if (k == "socket") {
    o.socket = value;
  } else if (k == "job") {
    o.job = value;
  } else if (k == "share_group") {
    o.share_group = value;
  } else if (k == "kind") {
    o.kind = value;
  } else if (k == "dataset") {
    o.dataset = value;
  } else if (k == "token_dtype") {
    o.token_dtype = value;
  } else if (k == "delivery") {
    o.delivery = value;
  } else if (k == "gpu") {
    o.gpu = value;
  } else if (k == "ipc") {
    o.ipc = value;
  } else if (k == "pipeline_json") {
    o.pipeline_json = value;
  } else if (k == "bad_sample") {
    o.bad_sample = value;
  } else if (k == "decode") {
    o.decode = value;
  } else if (k == "augment") {
    o.augment = value;
  } else if (k == "start_fingerprint") {
    o.start.fingerprint = value;
  } else if (k == "pack") {
    // Checked here, where the key is set, as well as at gpufeed_attach.
    const std::string v = value;
    if (v != "none" && v != "concat" && v != "best_fit") {
      return Invalid(absl::StrCat("pack: want none, concat or best_fit, got '", v, "'"));
    }
    o.pack = v;
  } else if (k == "blend_history_json") {
    auto segments = gpufeed::client::ParseBlendSegmentsJson(value);
    if (!segments.ok()) return Fail(segments.status());
    o.blend_history = std::move(*segments);
  } else if (k == "elastic") {
    // Checked here, where the key is set, as well as at gpufeed_attach.
    if (std::string(value) != "global_batch" && std::string(value) != "rank_batch") {
      return Invalid(absl::StrCat("elastic: want global_batch or rank_batch, got '", value, "'"));
    }
    o.elastic = value;
  } else {
    return Invalid(absl::StrCat("unknown string option '", k, "'"));
  }
  return Ok();
}

gpufeed_status gpufeed_options_add_array(gpufeed_options* options, const char* name,
                                         const char* file) {
  if (options == nullptr || name == nullptr || file == nullptr) {
    return Invalid("options, name and file must not be NULL");
  }
  options->attach.arrays.emplace_back(name, file);
  return Ok();
}

gpufeed_status gpufeed_options_add_dataset_path(gpufeed_options* options, const char* path) {
  if (options == nullptr || path == nullptr) return Invalid("options and path must not be NULL");
  options->attach.dataset_paths.emplace_back(path);
  return Ok();
}

gpufeed_status gpufeed_options_add_blend_source(gpufeed_options* options, const char* name,
                                                double weight) {
  if (options == nullptr || name == nullptr) return Invalid("options and name must not be NULL");
  auto& blend = options->attach.blend;
  // Checked here as well as at gpufeed_attach, in the same words.
  if (!(std::isfinite(weight) && weight > 0)) {
    return Invalid(absl::StrCat("blend[", blend.size(), "] '", name,
                                "': weight must be > 0 and finite, got ", weight));
  }
  blend.push_back({name, weight});
  return Ok();
}

gpufeed_status gpufeed_options_set_int(gpufeed_options* options, const char* key,
                                       int64_t value) {
  if (options == nullptr || key == nullptr) return Invalid("options and key must not be NULL");
  const std::string k = key;
  gpufeed::client::AttachOptions& o = options->attach;
  if (k == "rank") {
    o.rank = static_cast<int32_t>(value);
  } else if (k == "world_size") {
    o.world_size = static_cast<int32_t>(value);
  } else if (k == "seq_len") {
    o.seq_len = value;
  } else if (k == "vocab_size") {
    o.vocab_size = value;
  } else if (k == "batch_size") {
    o.batch_size = value;
  } else if (k == "seed") {
    o.seed = static_cast<uint64_t>(value);
  } else if (k == "shuffle") {
    o.shuffle = value != 0;
  } else if (k == "drop_last") {
    o.drop_last = value != 0;
  } else if (k == "even") {
    o.even = value != 0;
  } else if (k == "ring_slots") {
    o.ring_slots = static_cast<int32_t>(value);
  } else if (k == "start_epoch") {
    o.start.epoch = value;
  } else if (k == "start_step") {
    o.start.step = value;
  } else if (k == "start_samples") {
    o.start.samples = value;
  } else if (k == "stop_epoch") {
    o.stop_epoch = value;
  } else if (k == "eos_id") {
    o.eos_id = value;
  } else if (k == "pack_lookahead") {
    o.pack_lookahead = value;
  } else if (k == "rpc_timeout_ms") {
    o.rpc_timeout = absl::Milliseconds(value);
  } else if (k == "reconnect_timeout_ms") {
    o.reconnect_timeout = absl::Milliseconds(value);
  } else if (k == "keepalive_ms") {
    o.keepalive = absl::Milliseconds(value);
  } else {
    return Invalid(absl::StrCat("unknown integer option '", k, "'"));
  }
  if ((k == "rank" || k == "world_size" || k == "ring_slots") &&
      (value < INT32_MIN || value > INT32_MAX)) {
    return Invalid(absl::StrCat(k, ": ", value, " does not fit 32 bits"));
  }
  return Ok();
}

gpufeed_status gpufeed_attach(const gpufeed_options* options, gpufeed_session** out_session) {
  if (options == nullptr || out_session == nullptr) {
    return Invalid("options and out_session must not be NULL");
  }
  *out_session = nullptr;
  auto session = gpufeed::client::Session::Attach(options->attach);
  if (!session.ok()) return Fail(session.status());
  std::string fingerprint = (*session)->position().fingerprint;
  *out_session = new gpufeed_session{std::move(*session), std::move(fingerprint), ""};
  return Ok();
}

gpufeed_status gpufeed_session_get_info(const gpufeed_session* session,
                                        gpufeed_session_info* out_info) {
  if (session == nullptr || out_info == nullptr) return Invalid("session and out_info must not be NULL");
  const gpufeed::client::SessionInfo& info = session->session->info();
  out_info->session_id = info.session_id;
  out_info->num_samples = info.num_samples;
  out_info->steps_per_epoch = info.steps_per_epoch;
  out_info->ring_slots = info.ring_slots;
  out_info->num_tensors = static_cast<int32_t>(info.layout.size());
  return Ok();
}

gpufeed_status gpufeed_next(gpufeed_session* session, int64_t timeout_ms,
                            gpufeed_batch** out_batch) {
  if (session == nullptr || out_batch == nullptr) return Invalid("session and out_batch must not be NULL");
  *out_batch = nullptr;
  auto batch = session->session->Next(timeout_ms < 0 ? absl::InfiniteDuration()
                                                     : absl::Milliseconds(timeout_ms));
  if (!batch.ok()) return Fail(batch.status());
  *out_batch = new gpufeed_batch{std::move(*batch)};
  return Ok();
}

gpufeed_status gpufeed_position(const gpufeed_session* session, int64_t* out_epoch,
                                int64_t* out_step) {
  if (session == nullptr || out_epoch == nullptr || out_step == nullptr) {
    return Invalid("session, out_epoch and out_step must not be NULL");
  }
  const gpufeed::client::Position p = session->session->position();
  *out_epoch = p.epoch;
  *out_step = p.step;
  return Ok();
}

gpufeed_status gpufeed_position_samples(const gpufeed_session* session, int64_t* out_samples) {
  if (session == nullptr || out_samples == nullptr) {
    return Invalid("session and out_samples must not be NULL");
  }
  *out_samples = session->session->position().samples;
  return Ok();
}

gpufeed_status gpufeed_session_batch_size(const gpufeed_session* session,
                                          int64_t* out_batch_size) {
  if (session == nullptr || out_batch_size == nullptr) {
    return Invalid("session and out_batch_size must not be NULL");
  }
  *out_batch_size = session->session->info().batch_size;
  return Ok();
}

gpufeed_status gpufeed_fingerprint(const gpufeed_session* session, const char** out_fingerprint) {
  if (session == nullptr || out_fingerprint == nullptr) {
    return Invalid("session and out_fingerprint must not be NULL");
  }
  *out_fingerprint = session->fingerprint.c_str();
  return Ok();
}

gpufeed_status gpufeed_session_blend_segments_json(gpufeed_session* session,
                                                   const char** out_json) {
  if (session == nullptr || out_json == nullptr) {
    return Invalid("session and out_json must not be NULL");
  }
  session->blend_segments_json =
      gpufeed::client::BlendSegmentsJson(session->session->blend_segments());
  *out_json = session->blend_segments_json.c_str();
  return Ok();
}

gpufeed_status gpufeed_session_mps(const gpufeed_session* session, int32_t* out_daemon,
                                   int32_t* out_consumer) {
  if (session == nullptr || out_daemon == nullptr || out_consumer == nullptr) {
    return Invalid("session, out_daemon and out_consumer must not be NULL");
  }
  *out_daemon = session->session->info().daemon_mps;
  *out_consumer = session->session->info().consumer_mps;
  return Ok();
}

gpufeed_status gpufeed_session_notice_count(const gpufeed_session* session, int32_t* out_count) {
  if (session == nullptr || out_count == nullptr) {
    return Invalid("session and out_count must not be NULL");
  }
  *out_count = static_cast<int32_t>(session->session->info().notices.size());
  return Ok();
}

gpufeed_status gpufeed_session_get_notice(const gpufeed_session* session, int32_t index,
                                          gpufeed_notice* out_notice) {
  if (session == nullptr || out_notice == nullptr) {
    return Invalid("session and out_notice must not be NULL");
  }
  const auto& notices = session->session->info().notices;
  if (index < 0 || static_cast<size_t>(index) >= notices.size()) {
    return Fail(absl::OutOfRangeError(
        absl::StrCat("notice index ", index, " is not in [0, ", notices.size(), ")")));
  }
  const gpufeed::client::DatasetNotice& n = notices[static_cast<size_t>(index)];
  out_notice->reason = n.reason.c_str();
  out_notice->count = n.count;
  out_notice->example = n.example.c_str();
  out_notice->message = n.message.c_str();
  return Ok();
}

gpufeed_status gpufeed_detach(gpufeed_session* session) {
  if (session == nullptr) return Invalid("session must not be NULL");
  absl::Status status = session->session->Detach();
  return status.ok() ? Ok() : Fail(status);
}

void gpufeed_session_destroy(gpufeed_session* session) { delete session; }

gpufeed_status gpufeed_batch_get_info(const gpufeed_batch* batch, gpufeed_batch_info* out_info) {
  if (batch == nullptr || out_info == nullptr) return Invalid("batch and out_info must not be NULL");
  const gpufeed::client::Batch& b = batch->batch;
  out_info->epoch = b.epoch();
  out_info->step = b.step();
  out_info->batch_size = static_cast<int64_t>(b.ids().size());
  out_info->valid_count = b.valid_count();
  out_info->ids = b.ids().data();
  out_info->num_tensors = static_cast<int32_t>(b.tensors().size());
  out_info->slot = b.slot();
  out_info->generation = b.generation();
  return Ok();
}

gpufeed_status gpufeed_batch_get_tensor(const gpufeed_batch* batch, int32_t index,
                                        gpufeed_tensor* out_tensor) {
  if (batch == nullptr || out_tensor == nullptr) return Invalid("batch and out_tensor must not be NULL");
  const auto& tensors = batch->batch.tensors();
  if (index < 0 || index >= static_cast<int32_t>(tensors.size())) {
    last_error = absl::StrCat("tensor index ", index, " out of range [0, ", tensors.size(), ")");
    return GPUFEED_OUT_OF_RANGE;
  }
  const gpufeed::client::Tensor& t = tensors[static_cast<size_t>(index)];
  out_tensor->name = t.name.c_str();
  out_tensor->dtype = static_cast<int32_t>(t.dtype);
  out_tensor->ndim = static_cast<int32_t>(t.shape.size());
  out_tensor->shape = t.shape.data();
  out_tensor->data = const_cast<void*>(t.data);
  out_tensor->byte_size = t.byte_size;
  out_tensor->device_type = t.device >= 0 ? GPUFEED_DEVICE_CUDA : GPUFEED_DEVICE_CPU;
  out_tensor->device_id = t.device >= 0 ? t.device : 0;
  return Ok();
}

gpufeed_status gpufeed_batch_after(const gpufeed_batch* batch, int64_t* out_epoch,
                                   int64_t* out_step, int64_t* out_samples) {
  if (batch == nullptr || out_epoch == nullptr || out_step == nullptr || out_samples == nullptr) {
    return Invalid("batch, out_epoch, out_step and out_samples must not be NULL");
  }
  const gpufeed::client::Position& after = batch->batch.after();
  *out_epoch = after.epoch;
  *out_step = after.step;
  *out_samples = after.samples;
  return Ok();
}

gpufeed_status gpufeed_batch_wait_ready(const gpufeed_batch* batch, void* stream) {
  if (batch == nullptr) return Invalid("batch must not be NULL");
  absl::Status status = batch->batch.WaitReady(stream);
  return status.ok() ? Ok() : Fail(status);
}

void gpufeed_batch_release(gpufeed_batch* batch) { delete batch; }

void gpufeed_batch_release_after(gpufeed_batch* batch, void* stream) {
  if (batch == nullptr) return;
  batch->batch.Release(stream);
  delete batch;
}

}  // extern "C"
