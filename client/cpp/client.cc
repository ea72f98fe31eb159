#include "gpufeed/client.h"

#include <pthread.h>
#include <sys/stat.h>

#include <chrono>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/device_ring.h"
#include "common/os/fd.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gpufeed::client {
namespace {

absl::Status FromGrpc(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

absl::Status CheckSocket(const std::string& socket) {
  struct stat st {};
  if (::stat(socket.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(absl::StrCat(
        "no gpufeedd socket at ", socket, " (is gpufeedd running? set the socket path with "
        "--socket or GPUFEED_SOCKET)"));
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::Channel> ChannelFor(const std::string& socket) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(absl::StrCat("unix://", socket),
                                   grpc::InsecureChannelCredentials(), args);
}

void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
}

// One unary call with a deadline; a failure carries `what` as context.
template <typename Stub, typename Request, typename Response>
absl::Status Call(Stub* stub,
                  grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                  const Request& request, Response* response, absl::Duration timeout,
                  absl::string_view what) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  return FromGrpc((stub->*method)(&ctx, request, response), what);
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string BaseOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

Position Advance(Position p, int64_t steps_per_epoch) {
  if (++p.step >= steps_per_epoch) {
    p.step = 0;
    ++p.epoch;
  }
  return p;
}

}  // namespace

namespace internal {

// Everything a session shares with its batches: the stream, the mapping, the reader thread.
// Batches hold it by shared_ptr, so the mapping outlives the last batch.
class SessionCore : public std::enable_shared_from_this<SessionCore> {
 public:
  SessionCore(std::shared_ptr<grpc::Channel> channel, absl::Duration rpc_timeout)
      : channel_(std::move(channel)),
        stub_(v1::Feed::NewStub(channel_)),
        rpc_timeout_(rpc_timeout) {}

  ~SessionCore() { Stop(); }

  absl::StatusOr<SessionInfo> Attach(const AttachOptions& o) {
    v1::AttachRequest request;
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
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "kind: unknown dataset kind '", o.kind, "' (want tokens, records or image_folder)"));
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
    d->set_path(o.dataset);
    request.set_batch_size(o.batch_size);
    request.set_seed(o.seed);
    request.set_shuffle(o.shuffle);
    request.set_drop_last(o.drop_last);
    request.set_ring_slots(o.ring_slots);
    if (o.delivery == "host") {
      request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_HOST);
    } else if (o.delivery == "device") {
      request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_DEVICE);
      GPUFEED_ASSIGN_OR_RETURN(gpu_, internal::ResolveGpu(o.gpu));
      request.mutable_delivery()->set_gpu_uuid(gpu_.uuid);
      if (o.ipc == "vmm") {
        request.mutable_delivery()->set_ipc(v1::IPC_KIND_VMM);
      } else if (o.ipc == "legacy") {
        request.mutable_delivery()->set_ipc(v1::IPC_KIND_LEGACY);
      } else if (o.ipc != "auto" && !o.ipc.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("ipc: unknown kind '", o.ipc, "' (want auto, vmm or legacy)"));
      }
      device_ = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("delivery: unknown kind '", o.delivery, "' (want host or device)"));
    }
    request.mutable_start()->set_epoch(o.start.epoch);
    request.mutable_start()->set_step(o.start.step);
    request.mutable_start()->set_fingerprint(o.start.fingerprint);
    request.set_stop_epoch(o.stop_epoch);
    if (!o.pipeline_json.empty()) {
      v1::Pipeline pipeline;
      const auto parsed = google::protobuf::util::JsonStringToMessage(o.pipeline_json, &pipeline);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("pipeline: not a pipeline in JSON: ", std::string(parsed.message())));
      }
      *request.mutable_pipeline() = pipeline.ops();
    }

    v1::AttachResponse response;
    GPUFEED_RETURN_IF_ERROR(Call(stub_.get(), &v1::Feed::Stub::Attach, request, &response,
                                 rpc_timeout_, "attach"));
    session_id_ = response.session_id();
    token_ = response.token();
    steps_per_epoch_ = response.steps_per_epoch();
    stride_ = response.slot_stride_bytes();
    ring_slots_ = response.ring_slots();
    position_ = {response.start().epoch(), response.start().step(), response.start().fingerprint()};
    fingerprint_ = response.start().fingerprint();

    SessionInfo info;
    info.session_id = session_id_;
    info.feed_key = response.feed_key();
    info.num_samples = response.num_samples();
    info.steps_per_epoch = steps_per_epoch_;
    info.ring_slots = ring_slots_;
    info.slot_stride_bytes = stride_;
    for (const v1::TensorLayout& t : response.tensors()) {
      Tensor tensor;
      tensor.name = t.name();
      tensor.dtype = static_cast<DType>(t.dtype());
      tensor.shape.assign(t.shape().begin(), t.shape().end());
      tensor.byte_size = t.byte_size();
      // Never trust the layout blindly: every tensor must lie inside its slot.
      if (t.byte_offset() > stride_ || t.byte_size() > stride_ - t.byte_offset()) {
        return absl::InternalError("attach: daemon sent a tensor layout outside the slot");
      }
      offsets_.push_back(t.byte_offset());
      info.layout.push_back(std::move(tensor));
    }
    layout_ = info.layout;
    info.decode = response.decode();
    info.augment = response.augment();
    if (device_) {
      if (!response.has_device()) return absl::InternalError("attach: no device ring in reply");
      device_reply_ = response.device();
      info.device = true;
      info.gpu_uuid = device_reply_.gpu_uuid();
      info.gpu_ordinal = gpu_.ordinal;
      info.ipc = device_reply_.ipc() == v1::IPC_KIND_LEGACY ? "legacy" : "vmm";
      if (device_reply_.alloc_bytes() < stride_ * static_cast<uint64_t>(ring_slots_) ||
          device_reply_.ready_event_handles_size() != ring_slots_) {
        return absl::InternalError("attach: daemon sent a device ring smaller than its slots");
      }
    }
    // The memory socket lies beside the gRPC socket as this process sees it (a container may
    // mount the directory elsewhere than the daemon does).
    mem_socket_ = absl::StrCat(DirOf(socket_), "/", BaseOf(response.mem_socket()));
    return info;
  }

  absl::Status MapRing() {
    if (device_ && device_reply_.ipc() == v1::IPC_KIND_LEGACY) {
      GPUFEED_ASSIGN_OR_RETURN(
          device_ring_, internal::DeviceRingMapping::MapLegacy(
                            gpu_.ordinal, device_reply_.legacy_mem_handle(), ReadyEvents()));
      return absl::OkStatus();
    }
    GPUFEED_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(mem_socket_));
    GPUFEED_RETURN_IF_ERROR(SetSocketTimeout(conn.get(), rpc_timeout_));
    v1::MemRequest request;
    request.set_session_id(session_id_);
    request.set_token(token_);
    GPUFEED_RETURN_IF_ERROR(SendFrame(conn.get(), request.SerializeAsString()));
    GPUFEED_ASSIGN_OR_RETURN(Frame frame, RecvFrame(conn.get(), 1 << 16));
    v1::MemResponse response;
    if (!response.ParseFromString(frame.bytes)) {
      return absl::InternalError("memory socket: malformed reply");
    }
    if (response.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(response.code()),
                          absl::StrCat("memory socket: ", response.message()));
    }
    if (!frame.fd.valid()) return absl::InternalError("memory socket: no descriptor came");
    if (device_) {
      if (!response.device()) return absl::InternalError("memory socket: host memory for a device session");
      GPUFEED_ASSIGN_OR_RETURN(device_ring_, internal::DeviceRingMapping::MapVmm(
                                                 gpu_.ordinal, std::move(frame.fd),
                                                 response.map_bytes(), ReadyEvents()));
      return absl::OkStatus();
    }
    if (response.map_bytes() < stride_ * static_cast<uint64_t>(ring_slots_)) {
      return absl::InternalError("memory socket: ring smaller than its slots");
    }
    // Writable and shared: a consumer may transform a batch it holds in place (torch's `x.add_`
    // on a host batch); the daemon never reads a slot back nor writes one that is leased.
    GPUFEED_ASSIGN_OR_RETURN(
        mapping_, Mapping::Map(frame.fd.get(), response.map_offset(), response.map_bytes(), true));
    return absl::OkStatus();
  }

  absl::Status OpenStream() {
    stream_ctx_ = std::make_unique<grpc::ClientContext>();
    stream_ = stub_->Stream(stream_ctx_.get());
    v1::StreamRequest open;
    open.mutable_open()->set_session_id(session_id_);
    open.mutable_open()->set_token(token_);
    if (device_ring_ != nullptr) {
      for (const std::string& h : device_ring_->release_event_handles()) {
        open.mutable_open()->add_release_event_handles(h);
      }
    }
    if (!stream_->Write(open)) {
      return FromGrpc(stream_->Finish(), "opening stream");
    }
    reader_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "gpufeed-rx");
      ReadLoop();
    });
    return absl::OkStatus();
  }

  absl::StatusOr<Batch> Next(absl::Duration timeout) {
    Event event;
    const auto asked = std::chrono::steady_clock::now();  // a wall-clock step is no wait
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !events_.empty() || !end_.ok();
      };
      if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
        return absl::DeadlineExceededError(
            absl::StrCat("no batch within ", absl::FormatDuration(timeout)));
      }
      if (events_.empty()) return end_;
      event = std::move(events_.front());
      events_.pop_front();
      if (event.end) {
        end_ = absl::OutOfRangeError("end of data: the stream reached stop_epoch");
        return end_;
      }
    }
    const v1::BatchReady& b = event.batch;
    if (b.slot() < 0 || b.slot() >= ring_slots_) {
      return absl::InternalError(absl::StrCat("daemon named slot ", b.slot(), " outside the ring"));
    }
    Batch batch;
    batch.core_ = shared_from_this();
    batch.slot_ = b.slot();
    batch.generation_ = b.generation();
    batch.epoch_ = b.epoch();
    batch.step_ = b.step();
    batch.valid_ = b.valid_count();
    batch.waited_ = absl::FromChrono(std::chrono::steady_clock::now() - asked);
    batch.ids_.assign(b.ids().begin(), b.ids().end());
    batch.tensors_ = layout_;
    const std::byte* base = device_ring_ != nullptr ? device_ring_->base() : mapping_.data();
    const std::byte* slot = base + static_cast<uint64_t>(b.slot()) * stride_;
    for (size_t i = 0; i < batch.tensors_.size(); ++i) {
      batch.tensors_[i].data = slot + offsets_[i];
      batch.tensors_[i].device = device_ring_ != nullptr ? device_ring_->ordinal() : -1;
    }
    {
      absl::MutexLock lock(&mu_);
      position_ = Advance({b.epoch(), b.step(), fingerprint_}, steps_per_epoch_);
    }
    return batch;
  }

  // Releases from any thread. Whoever finds no write in progress becomes the writer and
  // sends every release queued meanwhile in one message, so releases that arrive while a
  // write is under way share the next one.
  void Release(int32_t slot, uint64_t generation, absl::Duration waited, void* stream) {
    if (device_ring_ != nullptr) {
      // The daemon's next copy into this slot waits for the work queued on `stream` so far.
      absl::Status s = device_ring_->RecordRelease(slot, stream);
      if (!s.ok()) {
        absl::MutexLock lock(&mu_);
        if (end_.ok()) end_ = s;  // a CUDA error: the next Next() reports it
      }
    }
    {
      absl::MutexLock lock(&release_mu_);
      v1::Release* r = releases_.add_releases();
      r->set_slot(slot);
      r->set_generation(generation);
      r->set_waited_ns(static_cast<uint64_t>(absl::ToInt64Nanoseconds(waited)));
      if (release_writer_active_) return;
      release_writer_active_ = true;
    }
    while (true) {
      v1::StreamRequest request;
      {
        absl::MutexLock lock(&release_mu_);
        if (releases_.releases().empty()) {
          release_writer_active_ = false;
          return;
        }
        request.Swap(&releases_);
      }
      absl::MutexLock lock(&write_mu_);
      if (writes_done_ || stream_ == nullptr) continue;  // session over: nothing to return
      stream_->Write(request);
    }
  }

  absl::Status Detach() {
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (detached_) return absl::OkStatus();
      detached_ = true;
    }
    v1::DetachRequest request;
    request.set_session_id(session_id_);
    request.set_token(token_);
    v1::DetachResponse response;
    status = Call(stub_.get(), &v1::Feed::Stub::Detach, request, &response, rpc_timeout_, "detach");
    // A session the daemon already ended (shutdown, failure) is detached all the same.
    if (absl::IsNotFound(status) || absl::IsUnavailable(status)) status = absl::OkStatus();
    Stop();
    return status;
  }

  absl::StatusOr<Position> DaemonPosition() {
    v1::GetPositionRequest request;
    request.set_session_id(session_id_);
    request.set_token(token_);
    v1::GetPositionResponse response;
    GPUFEED_RETURN_IF_ERROR(Call(stub_.get(), &v1::Feed::Stub::GetPosition, request, &response,
                                 rpc_timeout_, "position"));
    return Position{response.delivered().epoch(), response.delivered().step(),
                    response.delivered().fingerprint()};
  }

  absl::Status WaitReady(int32_t slot, void* stream) const {
    if (device_ring_ == nullptr) return absl::OkStatus();
    return device_ring_->WaitReady(slot, stream);
  }

  Position position() const {
    absl::MutexLock lock(&mu_);
    return position_;
  }
  int64_t rejected() const {
    absl::MutexLock lock(&mu_);
    return rejected_;
  }
  void set_socket(std::string socket) { socket_ = std::move(socket); }

 private:
  std::vector<std::string> ReadyEvents() const {
    return {device_reply_.ready_event_handles().begin(), device_reply_.ready_event_handles().end()};
  }

  void ReadLoop() {
    v1::StreamResponse response;
    while (stream_->Read(&response)) {
      absl::MutexLock lock(&mu_);
      for (v1::BatchReady& b : *response.mutable_batches()) {
        events_.push_back(Event{false, std::move(b)});
      }
      for (const v1::ReleaseRejected& r : response.rejected()) {
        ++rejected_;
        last_rejection_ = r.message();
      }
      if (response.has_end()) events_.push_back(Event{true, {}});
    }
    {
      absl::MutexLock lock(&write_mu_);
      writes_done_ = true;
    }
    absl::Status status = FromGrpc(stream_->Finish(), "stream");
    if (status.ok()) status = absl::CancelledError("stream: the session was detached");
    absl::MutexLock lock(&mu_);
    if (end_.ok()) end_ = status;
  }

  // Stops the stream and joins the reader. Safe to call twice.
  void Stop() {
    {
      absl::MutexLock lock(&write_mu_);
      if (stream_ != nullptr && !writes_done_) {
        writes_done_ = true;
        stream_->WritesDone();
      }
    }
    if (stream_ctx_ != nullptr) stream_ctx_->TryCancel();
    if (reader_.joinable()) reader_.join();
  }

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<v1::Feed::Stub> stub_;
  const absl::Duration rpc_timeout_;
  std::string socket_;
  std::string mem_socket_;
  uint64_t session_id_ = 0;
  std::string token_;
  int64_t steps_per_epoch_ = 1;
  uint64_t stride_ = 0;
  int32_t ring_slots_ = 0;
  std::vector<Tensor> layout_;
  std::vector<uint64_t> offsets_;
  Mapping mapping_;                                        // host delivery
  bool device_ = false;                                    // device delivery
  internal::GpuTarget gpu_;
  v1::DeviceRing device_reply_;
  std::unique_ptr<internal::DeviceRingMapping> device_ring_;  // freed after the last batch
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
  std::thread reader_;

  absl::Mutex write_mu_;  // one writer on the stream at a time
  bool writes_done_ ABSL_GUARDED_BY(write_mu_) = false;

  absl::Mutex release_mu_;
  v1::StreamRequest releases_ ABSL_GUARDED_BY(release_mu_);  // queued, not yet written
  bool release_writer_active_ ABSL_GUARDED_BY(release_mu_) = false;

  struct Event {
    bool end = false;  // the end marker, after the last batch before stop_epoch
    v1::BatchReady batch;
  };
  mutable absl::Mutex mu_;
  std::deque<Event> events_ ABSL_GUARDED_BY(mu_);
  absl::Status end_ ABSL_GUARDED_BY(mu_);  // not OK once the stream is over
  Position position_ ABSL_GUARDED_BY(mu_);
  std::string fingerprint_;  // the feed's, set once at Attach
  int64_t rejected_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_rejection_ ABSL_GUARDED_BY(mu_);
  bool detached_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace internal

// ---- Batch ----

Batch::Batch(Batch&& other) noexcept { *this = std::move(other); }

Batch& Batch::operator=(Batch&& other) noexcept {
  if (this != &other) {
    Release(nullptr);
    core_ = std::move(other.core_);
    slot_ = std::exchange(other.slot_, -1);
    generation_ = other.generation_;
    epoch_ = other.epoch_;
    step_ = other.step_;
    valid_ = other.valid_;
    waited_ = other.waited_;
    ids_ = std::move(other.ids_);
    tensors_ = std::move(other.tensors_);
  }
  return *this;
}

Batch::~Batch() { Release(nullptr); }

void Batch::Release(void* stream) {
  if (core_ == nullptr) return;
  core_->Release(slot_, generation_, waited_, stream);
  core_.reset();
  for (Tensor& t : tensors_) t.data = nullptr;
}

absl::Status Batch::WaitReady(void* stream) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("the batch was released");
  return core_->WaitReady(slot_, stream);
}

std::vector<uint8_t> Batch::valid_mask() const {
  std::vector<uint8_t> mask(ids_.size(), 0);
  for (int64_t i = 0; i < valid_ && i < static_cast<int64_t>(mask.size()); ++i) mask[i] = 1;
  return mask;
}

const Tensor* Batch::tensor(const std::string& name) const {
  for (const Tensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// ---- Session ----

Session::Session(std::shared_ptr<internal::SessionCore> core, SessionInfo info)
    : core_(std::move(core)), info_(std::move(info)) {}

Session::~Session() { (void)Detach(); }

absl::StatusOr<std::unique_ptr<Session>> Session::Attach(const AttachOptions& options) {
  GPUFEED_RETURN_IF_ERROR(CheckSocket(options.socket));
  auto core = std::make_shared<internal::SessionCore>(ChannelFor(options.socket),
                                                      options.rpc_timeout);
  core->set_socket(options.socket);
  GPUFEED_ASSIGN_OR_RETURN(SessionInfo info, core->Attach(options));
  absl::Status status = core->MapRing();
  if (status.ok()) status = core->OpenStream();
  if (!status.ok()) {
    (void)core->Detach();
    return status;
  }
  return std::unique_ptr<Session>(new Session(std::move(core), std::move(info)));
}

absl::StatusOr<Batch> Session::Next(absl::Duration timeout) { return core_->Next(timeout); }
Position Session::position() const { return core_->position(); }
absl::StatusOr<Position> Session::DaemonPosition() { return core_->DaemonPosition(); }
int64_t Session::rejected_releases() const { return core_->rejected(); }
absl::Status Session::Detach() { return core_->Detach(); }

// ---- AdminClient ----

struct AdminClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Admin::Stub> admin;
  std::unique_ptr<::grpc::health::v1::Health::Stub> health;
  absl::Duration timeout;
};

AdminClient::AdminClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AdminClient::~AdminClient() = default;

absl::StatusOr<std::unique_ptr<AdminClient>> AdminClient::Connect(const std::string& socket,
                                                                  absl::Duration timeout) {
  GPUFEED_RETURN_IF_ERROR(CheckSocket(socket));
  auto impl = std::make_unique<Impl>();
  impl->channel = ChannelFor(socket);
  impl->admin = v1::Admin::NewStub(impl->channel);
  impl->health = ::grpc::health::v1::Health::NewStub(impl->channel);
  impl->timeout = timeout;
  return std::unique_ptr<AdminClient>(new AdminClient(std::move(impl)));
}

absl::StatusOr<DaemonStatus> AdminClient::GetStatus() {
  DaemonStatus out;
  {
    ::grpc::health::v1::HealthCheckRequest request;
    request.set_service("gpufeed.v1.Feed");
    ::grpc::health::v1::HealthCheckResponse response;
    GPUFEED_RETURN_IF_ERROR(Call(impl_->health.get(), &::grpc::health::v1::Health::Stub::Check,
                                 request, &response, impl_->timeout, "health"));
    out.health = ::grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  }
  v1::GetStatusResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::GetStatus,
                               v1::GetStatusRequest(), &response, impl_->timeout, "status"));
  out.version = response.version();
  out.uptime_ms = response.uptime_ms();
  out.staging_total_bytes = response.staging_total_bytes();
  out.staging_free_bytes = response.staging_free_bytes();
  out.sessions = response.sessions();
  out.feeds = response.feeds();
  out.draining = response.draining();
  return out;
}

absl::StatusOr<std::vector<FeedInfo>> AdminClient::ListFeeds() {
  v1::ListFeedsResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::ListFeeds,
                               v1::ListFeedsRequest(), &response, impl_->timeout, "feeds"));
  std::vector<FeedInfo> out;
  for (const v1::FeedInfo& f : response.feeds()) {
    FeedInfo info;
    info.key = f.key();
    info.kind = f.dataset().kind() == v1::DATASET_KIND_TOKENS    ? "tokens"
                : f.dataset().kind() == v1::DATASET_KIND_RECORDS ? "records"
                                                                 : "image_folder";
    info.dataset = f.dataset().path();
    info.num_samples = f.num_samples();
    info.batch_size = f.batch_size();
    info.world_size = f.world_size();
    info.seed = f.seed();
    info.shuffle = f.shuffle();
    info.drop_last = f.drop_last();
    info.sessions = f.sessions();
    info.batches_produced = f.batches_produced();
    info.bytes_produced = f.bytes_produced();
    info.bad_samples.insert(f.bad_samples().begin(), f.bad_samples().end());
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<std::vector<SessionSummary>> AdminClient::ListSessions() {
  v1::ListSessionsResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::ListSessions,
                               v1::ListSessionsRequest(), &response, impl_->timeout, "sessions"));
  std::vector<SessionSummary> out;
  for (const v1::SessionInfo& s : response.sessions()) {
    SessionSummary info;
    info.session_id = s.session_id();
    info.job = s.job();
    info.rank = s.rank();
    info.world_size = s.world_size();
    info.feed_key = s.feed_key();
    info.delivery = s.delivery() == v1::DELIVERY_KIND_DEVICE ? "device" : "host";
    info.gpu_uuid = s.gpu_uuid();
    info.delivered = {s.delivered().epoch(), s.delivered().step(), ""};
    info.ring_slots = s.ring_slots();
    info.slots_leased = s.slots_leased();
    info.ring_bytes = s.ring_bytes();
    info.batches_delivered = s.batches_delivered();
    info.streaming = s.streaming();
    info.age_ms = s.age_ms();
    info.bytes_delivered = s.bytes_delivered();
    info.producer_blocked_ns = s.producer_blocked_ns();
    info.consumer_wait_ns = s.consumer_wait_ns();
    info.streaming_ns = s.streaming_ns();
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<int32_t> AdminClient::Drain(absl::Duration timeout) {
  v1::DrainRequest request;
  request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  v1::DrainResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(impl_->admin.get(), &v1::Admin::Stub::Drain, request, &response,
                               impl_->timeout, "drain"));
  return response.sessions();
}

}  // namespace gpufeed::client
