#include "client/cpp/session_core.h"

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/blend.h"
#include "client/cpp/object_store_access.h"
#include "client/cpp/options.h"
#include "client/cpp/rpc.h"
#include "common/os/file.h"
#include "common/os/unix_socket.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "common/version.h"

namespace gpufeed::client::internal {
namespace {

// AttachResponse.notices kept, and the bytes of each of their strings.
constexpr size_t kMaxNotices = 64;
constexpr size_t kMaxNoticeBytes = 4096;

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string BaseOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The deepest directory both absolute directories `a` and `b` lie in (component-wise).
std::string CommonDir(const std::string& a, const std::string& b) {
  size_t end = 0;  // the end of the last component both share
  for (size_t i = 0;; ++i) {
    const bool a_end = i == a.size() || a[i] == '/', b_end = i == b.size() || b[i] == '/';
    if (a_end && b_end) {
      end = i;
      if (i == a.size() || i == b.size()) break;
    } else if (a_end != b_end || a[i] != b[i]) {
      break;
    }
  }
  return end == 0 ? "/" : a.substr(0, end);
}

// An explicit list (DatasetSpec.paths), or a blend's files (every source's paths): each
// file opened with this process's rights and checked a regular file (one it cannot read is
// refused, named), its path made real (links resolved: gpufeedd follows none beneath the
// directory passed), and their deepest common directory returned, which this process then
// passes.
absl::StatusOr<std::string> RealListedFiles(v1::DatasetSpec* dataset) {
  std::string common;
  bool first = true;
  // `field` names the entry in errors: "dataset.paths[3]", "blend[1] '/data/code/*.bin'".
  auto real = [&](std::string* p, const std::string& field) -> absl::Status {
    UniqueFd fd(::open(p->c_str(), kDatasetOpenFlags));
    if (!fd.valid()) {
      const int error = errno;
      return ErrnoToStatus(error,
                           absl::StrCat("attach: ", field, ": this process (uid ", ::geteuid(),
                                        ") cannot open ", *p, " (errno ", error, ")"));
    }
    absl::Status kind = CheckFileKind(fd.get(), FileKind::kRegular, *p, field).status();
    if (!kind.ok()) return Annotate(kind, "attach");
    char resolved[PATH_MAX];
    if (::realpath(p->c_str(), resolved) == nullptr) {
      return ErrnoToStatus(errno, absl::StrCat("attach: ", field, ": resolving ", *p));
    }
    *p = resolved;
    const std::string dir = p->rfind('/') == 0 ? "/" : DirOf(*p);
    common = first ? dir : CommonDir(common, dir);
    first = false;
    return absl::OkStatus();
  };
  for (int i = 0; i < dataset->paths_size(); ++i) {
    GPUFEED_RETURN_IF_ERROR(
        real(dataset->mutable_paths(i), absl::StrCat("dataset.paths[", i, "]")));
  }
  for (int k = 0; k < dataset->sources_size(); ++k) {
    v1::BlendSource* source = dataset->mutable_sources(k);
    const std::string field = absl::StrCat("blend[", k, "] '", source->name(), "'");
    for (int i = 0; i < source->paths_size(); ++i) {
      GPUFEED_RETURN_IF_ERROR(real(source->mutable_paths(i), field));
    }
  }
  return common;
}

}  // namespace

Position PositionAfter(const v1::BatchReady& b, int64_t steps_per_epoch) {
  if (b.end_of_epoch()) return {b.epoch() + 1, 0, "", 0};
  if (b.samples() > 0) return {b.epoch(), b.step() + 1, "", b.samples()};
  if (b.step() + 1 >= steps_per_epoch) return {b.epoch() + 1, 0, "", 0};
  return {b.epoch(), b.step() + 1, "", 0};
}

SessionCore::SessionCore(std::shared_ptr<grpc::Channel> channel, std::string socket,
                         absl::Duration rpc_timeout, absl::Duration reconnect_timeout,
                         absl::Duration keepalive)
    : channel_(std::move(channel)),
      stub_(v1::Feed::NewStub(channel_)),
      socket_(std::move(socket)),
      rpc_timeout_(rpc_timeout),
      reconnect_timeout_(reconnect_timeout),
      keepalive_(keepalive) {}

absl::Duration SessionCore::CallTimeout() const {
  if (!reconnecting_) return rpc_timeout_;
  // A re-attach's calls end by its bound: a daemon that accepts connections but never
  // answers (stopped) gives the bound's error on time, not a call's timeout later.
  const absl::Duration floor = std::min(absl::Milliseconds(100), rpc_timeout_);
  return std::max(std::min(give_up_ - absl::Now(), rpc_timeout_), floor);
}

SessionCore::~SessionCore() {
  bool detach = false;
  {
    absl::MutexLock lock(&mu_);
    detach = detach_when_unused_ && !detached_;
  }
  if (detach) (void)Detach();  // stops too
  Stop();
}

absl::Status SessionCore::DetachWhenUnused() {
  {
    absl::MutexLock lock(&mu_);
    detach_when_unused_ = true;
  }
  // Idempotent: a release racing this may detach too.
  return held_.load() == 0 ? Detach() : absl::OkStatus();
}

void SessionCore::BatchReleased() {
  if (held_.fetch_sub(1) != 1) return;
  bool detach = false;
  {
    absl::MutexLock lock(&mu_);
    detach = detach_when_unused_ && !detached_;
  }
  if (detach) (void)Detach();
}

absl::StatusOr<SessionInfo> SessionCore::Attach(const AttachOptions& options) {
  GPUFEED_ASSIGN_OR_RETURN(AttachPlan plan, AttachPlanFromOptions(options));
  device_ = plan.device;
  gpu_ = plan.gpu;
  stop_epoch_ = options.stop_epoch;
  plan.request.set_protocol(kProtocol);
  request_ = plan.request;
  GPUFEED_ASSIGN_OR_RETURN(SessionInfo info, AttachWith(std::move(plan.request), false));
  // A re-attach asks for what the session serves: at an elastic resume that kept the global
  // batch, that is not the batch_size asked for (which the daemon may refuse then).
  request_.set_batch_size(batch_size_);
  return info;
}

absl::StatusOr<SessionInfo> SessionCore::AttachWith(v1::AttachRequest request, bool again) {
  GPUFEED_RETURN_IF_ERROR(PassDataset(&request));
  v1::AttachResponse response;
  GPUFEED_RETURN_IF_ERROR(
      Call(stub_.get(), &v1::Feed::Stub::Attach, request, &response, CallTimeout(), "attach"));
  if (again) {
    // The same request, the same feed: anything else would be another stream. The feed the
    // daemon checked itself: the request's start carries our fingerprint, and another feed is
    // FAILED_PRECONDITION. A fingerprint that differs in form only (a gpufeedd upgraded across
    // the restart writes a shard directory's differently: CompareFingerprints) is adopted, so
    // positions saved from here on carry the daemon's current form. The per-rank batch is
    // compared, not steps_per_epoch: an epoch an elastic resume began mid-way may have
    // another number of steps, and positions go by BatchReady's end of epoch. (A daemon
    // that does not say its batch: steps_per_epoch, as before.)
    const bool same_batch = response.batch_size() > 0
                                ? response.batch_size() == batch_size_
                                : response.steps_per_epoch() == steps_per_epoch_;
    bool same = same_batch && response.slot_stride_bytes() == stride_ &&
                response.ring_slots() == ring_slots_ &&
                request.start().fingerprint() == fingerprint_ &&
                response.tensors_size() == static_cast<int>(offsets_.size());
    for (int i = 0; same && i < response.tensors_size(); ++i) {
      same = response.tensors(i).byte_offset() == offsets_[i] &&
             response.tensors(i).byte_size() == layout_[i].byte_size;
    }
    if (!same) {
      v1::DetachRequest detach;
      detach.set_session_id(response.session_id());
      detach.set_token(response.token());
      v1::DetachResponse detached;
      (void)Call(stub_.get(), &v1::Feed::Stub::Detach, detach, &detached, CallTimeout(), "detach");
      return absl::FailedPreconditionError(
          "re-attach: gpufeedd came back with another feed or slot layout than the session's");
    }
    GPUFEED_RETURN_IF_ERROR(KeepBlendSegments(request, response));
    session_id_ = response.session_id();
    token_ = response.token();
    steps_per_epoch_ = response.steps_per_epoch();
    if (response.start().fingerprint() != fingerprint_) {
      fingerprint_ = response.start().fingerprint();
      absl::MutexLock lock(&mu_);
      position_.fingerprint = fingerprint_;
    }
    if (device_) {
      if (!response.has_device() ||
          response.device().alloc_bytes() < stride_ * static_cast<uint64_t>(ring_slots_) ||
          response.device().ready_event_handles_size() != ring_slots_) {
        return absl::InternalError("re-attach: daemon sent a device ring smaller than its slots");
      }
      device_reply_ = response.device();
    }
    mem_socket_ = absl::StrCat(DirOf(socket_), "/", BaseOf(response.mem_socket()));
    return SessionInfo{};
  }
  GPUFEED_RETURN_IF_ERROR(KeepBlendSegments(request, response));
  session_id_ = response.session_id();
  token_ = response.token();
  steps_per_epoch_ = response.steps_per_epoch();
  batch_size_ = response.batch_size() > 0 ? response.batch_size() : request.batch_size();
  stride_ = response.slot_stride_bytes();
  ring_slots_ = response.ring_slots();
  fingerprint_ = response.start().fingerprint();
  {
    absl::MutexLock lock(&mu_);  // no reader yet; position_ is only ever written under mu_
    position_ = {response.start().epoch(), response.start().step(), fingerprint_,
                 response.start().samples()};
  }

  SessionInfo info;
  info.session_id = session_id_;
  info.feed_key = response.feed_key();
  info.num_samples = response.num_samples();
  info.steps_per_epoch = steps_per_epoch_;
  info.batch_size = batch_size_;
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
  info.blend_segments = blend_segments();
  // Bounded as everything taken from the socket: a few notices of one line each.
  for (const v1::DatasetNotice& n : response.notices()) {
    if (info.notices.size() == kMaxNotices) break;
    info.notices.push_back({n.reason().substr(0, kMaxNoticeBytes), n.count(),
                            n.example().substr(0, kMaxNoticeBytes),
                            n.message().substr(0, kMaxNoticeBytes)});
  }
  if (device_) {
    if (!response.has_device()) return absl::InternalError("attach: no device ring in reply");
    device_reply_ = response.device();
    info.device = true;
    info.gpu_uuid = device_reply_.gpu_uuid();
    info.gpu_ordinal = gpu_.ordinal;
    info.ipc = device_reply_.ipc() == v1::IPC_KIND_LEGACY ? "legacy" : "vmm";
    // Daemons before protocol 3 do not say.
    info.daemon_mps = daemon_protocol_ >= 3 ? (device_reply_.mps() ? 1 : 0) : -1;
    if (absl::StatusOr<bool> mine = UsesMps(gpu_.ordinal); mine.ok()) info.consumer_mps = *mine;
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

absl::Status SessionCore::KeepBlendSegments(const v1::AttachRequest& request,
                                            const v1::AttachResponse& response) {
  GPUFEED_ASSIGN_OR_RETURN(
      std::vector<BlendSegment> segments,
      BlendSegmentsFromReply(response.blend_segments(), request.dataset().sources_size(),
                             request.dataset().blend_history_size()));
  // A re-attach (the daemon restarted) resumes the blend as the daemon last reported it: with
  // the weights unchanged, no new segment.
  BlendHistoryInto(segments, request_.mutable_dataset());
  absl::MutexLock lock(&mu_);
  blend_segments_ = std::move(segments);
  return absl::OkStatus();
}

std::vector<BlendSegment> SessionCore::blend_segments() const {
  absl::MutexLock lock(&mu_);
  return blend_segments_;
}

absl::Status SessionCore::PassDataset(v1::AttachRequest* request) {
  v1::DatasetSpec* dataset = request->mutable_dataset();
  const std::string given = dataset->path();
  // An explicit list or a blend's files: `path` is set below.
  const bool listed = dataset->paths_size() > 0 || dataset->sources_size() > 0;
  // s3://bucket/...: no file here to open; the caller's access goes instead (below).
  const bool object_store = !listed && absl::StartsWith(given, "s3://");
  // A relative path is the daemon's to refuse (dataset.path must be absolute).
  if (!listed && !object_store && (given.empty() || given[0] != '/')) return absl::OkStatus();

  // The memory socket's name, from the daemon (asked first: a daemon that is not there is
  // the error to report); it lies beside the gRPC socket as this process sees it (a
  // container may mount the directory elsewhere than the daemon does).
  std::unique_ptr<v1::Admin::Stub> admin = v1::Admin::NewStub(channel_);
  v1::GetStatusResponse status;
  if (absl::Status asked = Call(admin.get(), &v1::Admin::Stub::GetStatus, v1::GetStatusRequest(),
                                &status, CallTimeout(), "attach");
      !asked.ok()) {
    // A re-attach words its last error itself (Reconnect).
    if (reconnecting_ || (!absl::IsUnavailable(asked) && !absl::IsDeadlineExceeded(asked))) {
      return asked;
    }
    return absl::Status(asked.code(), absl::StrCat("attach: gpufeedd at ", socket_, ": ",
                                                   InOurWords(asked, socket_)));
  }
  // Daemons before protocol 2 do not take the datasets their clients open (no memory socket
  // named in their status); 2 sent no number.
  const uint32_t protocol = status.protocol() != 0        ? status.protocol()
                            : status.mem_socket().empty() ? 1
                                                          : 2;
  daemon_protocol_ = protocol;
  if (protocol < kMinDaemonProtocol || status.mem_socket().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "attach: gpufeedd at ", socket_, " is version ", status.version(), " (protocol ", protocol,
        "); this client (version ", kVersion, ") needs protocol ", kMinDaemonProtocol,
        " or newer: upgrade gpufeedd, or use a client of its version"));
  }
  mem_socket_ = absl::StrCat(DirOf(socket_), "/", BaseOf(status.mem_socket()));
  if (object_store) {
    // The caller's own access, resolved here with its environment and files (the daemon reads
    // neither), for this session's reads only (MemRequest.object_store).
    absl::StatusOr<ObjectStoreAccess> access = ResolveObjectStoreAccess();
    if (!access.ok()) {
      return absl::Status(access.status().code(), absl::StrCat("attach: dataset.path ", given, ": ",
                                                               access.status().message()));
    }
    v1::MemRequest mem;
    mem.set_open_dataset(true);
    mem.set_lifeline(true);
    v1::ObjectStoreAccess* a = mem.mutable_object_store();
    a->set_access_key_id(access->access_key_id);
    a->set_secret_access_key(access->secret_access_key);
    a->set_session_token(access->session_token);
    a->set_web_identity_token(access->web_identity_token);
    a->set_role_arn(access->role_arn);
    a->set_role_session_name(access->role_session_name);
    a->set_region(access->region);
    a->set_endpoint_url(access->endpoint_url);
    a->set_anonymous(access->anonymous);
    return HandOver(mem, -1, absl::StrCat(given, " (credentials from ", access->source, ")"),
                    dataset);
  }

  // An image folder, records of several arrays (their directory), or token or WebDataset
  // shards: a directory, or a glob (or, for WebDataset, a brace pattern) in the last
  // component (`/data/train_*.bin`, `/data/train-{000..146}.tar`: its directory is what this
  // process opens and passes).
  bool folder = dataset->kind() == v1::DATASET_KIND_IMAGE_FOLDER || dataset->arrays_size() > 0;
  std::string to_open = given;
  std::string pattern;
  if (listed) {
    // The files' deepest common directory, beneath which gpufeedd opens each listed file.
    GPUFEED_ASSIGN_OR_RETURN(to_open, RealListedFiles(dataset));
    folder = true;
  } else if (dataset->kind() == v1::DATASET_KIND_TOKENS ||
             dataset->kind() == v1::DATASET_KIND_WEBDATASET) {
    const char* pattern_chars = dataset->kind() == v1::DATASET_KIND_WEBDATASET ? "*?[{" : "*?[";
    struct stat st {};
    if (BaseOf(given).find_first_of(pattern_chars) != std::string::npos) {
      pattern = BaseOf(given);
      to_open = DirOf(given).empty() ? "/" : DirOf(given);
      folder = true;
    } else if (::stat(given.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      folder = true;
    } else if (dataset->kind() == v1::DATASET_KIND_TOKENS && S_ISREG(st.st_mode) &&
               absl::EndsWith(given, ".bin") && BaseOf(given).size() > 4 &&
               ::stat(absl::StrCat(given.substr(0, given.size() - 4), ".idx").c_str(), &st) == 0 &&
               S_ISREG(st.st_mode)) {
      // A Megatron-LM X.bin with its X.idx beside it: the directory is passed, for the
      // daemon to read both beneath it; the path's last component names the .bin
      // (FindPairedFile). A .bin alone is passed itself, as before.
      pattern = BaseOf(given);
      to_open = DirOf(given).empty() ? "/" : DirOf(given);
      folder = true;
    } else if (dataset->kind() == v1::DATASET_KIND_TOKENS && S_ISREG(st.st_mode) &&
               !absl::EndsWith(given, kOffsetsSuffix) &&
               ::stat(OffsetsFileOf(given).c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      // A token file with its document offsets (S.offsets.npy) beside it: the same, for the
      // daemon to read both beneath the directory.
      pattern = BaseOf(given);
      to_open = DirOf(given).empty() ? "/" : DirOf(given);
      folder = true;
    }
  }
  // O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer.
  UniqueFd fd(::open(to_open.c_str(), kDatasetOpenFlags | (folder ? O_DIRECTORY : 0)));
  if (!fd.valid()) {
    const int error = errno;
    return ErrnoToStatus(error,
                         absl::StrCat("attach: dataset.path: this process (uid ", ::geteuid(),
                                      ") cannot open ", to_open, " (errno ", error, ")"));
  }
  absl::Status kind =
      CheckFileKind(fd.get(), folder ? FileKind::kDirectory : FileKind::kRegular, to_open).status();
  if (!kind.ok()) return Annotate(kind, "attach");
  // The daemon keys feeds by this name: ranks naming one file by different paths agree.
  char real[PATH_MAX];
  if (::realpath(to_open.c_str(), real) != nullptr) {
    dataset->set_path(pattern.empty()
                          ? std::string(real)
                          : absl::StrCat(std::string_view(real) == "/" ? "" : real, "/", pattern));
  }

  v1::MemRequest mem;
  mem.set_open_dataset(true);
  // This connection stays open as the session's lifeline (MemRequest.lifeline).
  mem.set_lifeline(true);
  return HandOver(mem, fd.get(), listed ? to_open : given, dataset);
}

absl::Status SessionCore::HandOver(const v1::MemRequest& mem, int fd, const std::string& what,
                                   v1::DatasetSpec* dataset) {
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(mem_socket_));
  // The descriptor or the credentials go only to a server this client trusts to be gpufeedd
  // (a socket planted at the path by another user would get a dataset this process can read,
  // or its keys).
  if (absl::Status s = CheckDaemonPeer(conn.get(), mem_socket_); !s.ok()) {
    return Annotate(s, "attach");
  }
  GPUFEED_RETURN_IF_ERROR(SetSocketTimeout(conn.get(), CallTimeout()));
  GPUFEED_RETURN_IF_ERROR(SendFrame(conn.get(), mem.SerializeAsString(), fd));
  GPUFEED_ASSIGN_OR_RETURN(Frame frame, RecvFrame(conn.get(), 1 << 16));
  v1::MemResponse reply;
  if (!reply.ParseFromString(frame.bytes)) {
    return absl::InternalError("memory socket: malformed reply");
  }
  if (reply.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(reply.code()),
                        absl::StrCat("attach: passing ", what, " to gpufeedd: ", reply.message()));
  }
  if (reply.dataset_handle().size() != 32) {
    return absl::InternalError("memory socket: no dataset handle in the reply");
  }
  dataset->set_handle(reply.dataset_handle());
  lifeline_ = std::move(conn);
  return absl::OkStatus();
}

absl::Status SessionCore::MapRing() {
  auto ring = std::make_shared<RingMapping>();
  if (device_ && device_reply_.ipc() == v1::IPC_KIND_LEGACY) {
    GPUFEED_ASSIGN_OR_RETURN(
        ring->device, DeviceRingMapping::MapLegacy(gpu_.ordinal, device_reply_.legacy_mem_handle(),
                                                   ReadyEvents()));
    ring_ = std::move(ring);
    return absl::OkStatus();
  }
  GPUFEED_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(mem_socket_));
  GPUFEED_RETURN_IF_ERROR(CheckDaemonPeer(conn.get(), mem_socket_));  // before the token
  GPUFEED_RETURN_IF_ERROR(SetSocketTimeout(conn.get(), CallTimeout()));
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
    if (!response.device()) {
      return absl::InternalError("memory socket: host memory for a device session");
    }
    GPUFEED_ASSIGN_OR_RETURN(ring->device,
                             DeviceRingMapping::MapVmm(gpu_.ordinal, std::move(frame.fd),
                                                       response.map_bytes(), ReadyEvents()));
    ring_ = std::move(ring);
    return absl::OkStatus();
  }
  if (response.map_bytes() < stride_ * static_cast<uint64_t>(ring_slots_)) {
    return absl::InternalError("memory socket: ring smaller than its slots");
  }
  // Writable and shared: a consumer may transform a batch it holds in place (torch's `x.add_`
  // on a host batch); the daemon never reads a slot back nor writes one that is leased.
  GPUFEED_ASSIGN_OR_RETURN(
      ring->host, Mapping::Map(frame.fd.get(), response.map_offset(), response.map_bytes(), true));
  ring_ = std::move(ring);
  return absl::OkStatus();
}

absl::Status SessionCore::OpenStream() {
  // A new link: releases of the old one's batches go nowhere from here on (top of the header).
  ++link_;
  {
    absl::MutexLock lock(&release_mu_);
    releases_.Clear();
    release_link_ = link_;
  }
  auto ctx = std::make_unique<grpc::ClientContext>();
  auto stream = stub_->Stream(ctx.get());
  v1::StreamRequest open;
  open.mutable_open()->set_session_id(session_id_);
  open.mutable_open()->set_token(token_);
  if (ring_->device != nullptr) {
    for (const std::string& h : ring_->device->release_event_handles()) {
      open.mutable_open()->add_release_event_handles(h);
    }
  }
  if (!stream->Write(open)) {
    return FromGrpc(stream->Finish(), "opening stream");
  }
  decltype(stream_) old_stream;
  {
    absl::MutexLock lock(&write_mu_);
    old_stream = std::exchange(stream_, std::move(stream));
    stream_link_ = link_;
    writes_done_ = false;
  }
  old_stream.reset();  // before its context
  stream_ctx_ = std::move(ctx);
  {
    absl::MutexLock lock(&mu_);  // the old reader is joined: only the new one sets end_
    end_ = absl::OkStatus();
  }
  reader_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "gpufeed-rx");
    ReadLoop();
  });
  return absl::OkStatus();
}

absl::StatusOr<Batch> SessionCore::Next(absl::Duration timeout) {
  Event event;
  const auto asked = std::chrono::steady_clock::now();  // a wall-clock step is no wait
  absl::Time deadline = absl::Now() + timeout;          // infinite stays infinite
  bool renewed = false;  // the deadline, once, for the first batch of a re-attached stream
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !events_.empty() || !end_.ok();
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
        return absl::DeadlineExceededError(
            absl::StrCat("no batch within ", absl::FormatDuration(timeout)));
      }
      if (!events_.empty()) {
        event = std::move(events_.front());
        events_.pop_front();
        if (event.end) {
          end_ = absl::OutOfRangeError("end of data: the stream reached stop_epoch");
          return end_;
        }
        bounded_ = false;  // a batch came: a later failure starts a bound of its own
        break;
      }
      // Every batch of the old stream is handed out: position_ is the next one. (Past
      // reconnect_timeout, Reconnect gives the bound's error, at once.)
      if (!absl::IsUnavailable(end_) || reconnect_timeout_ <= absl::ZeroDuration() || detached_) {
        return end_;
      }
      if (stop_epoch_ > 0 && position_.epoch >= stop_epoch_) {
        end_ = absl::OutOfRangeError("end of data: the stream reached stop_epoch");
        return end_;
      }
      if (!reconnecting_) last_error_ = InOurWords(end_, socket_);
    }
    absl::Status reconnected = Reconnect(deadline);
    if (absl::IsDeadlineExceeded(reconnected)) {
      return absl::DeadlineExceededError(absl::StrCat("no batch within ",
                                                      absl::FormatDuration(timeout), ": ",
                                                      reconnected.message()));
    }
    if (!reconnected.ok()) {
      absl::MutexLock lock(&mu_);
      end_ = reconnected;
      return end_;
    }
    // `timeout` bounds the wait on a daemon that is there: the new one gets all of it for
    // its first batch (the time away was reconnect_timeout's to bound). Once a call: a
    // daemon that fails again before its first batch gets no second renewal.
    if (!renewed) {
      deadline = absl::Now() + timeout;
      renewed = true;
    }
  }
  const v1::BatchReady& b = event.batch;
  if (b.slot() < 0 || b.slot() >= ring_slots_) {
    return absl::InternalError(absl::StrCat("daemon named slot ", b.slot(), " outside the ring"));
  }
  Batch batch;
  batch.core_ = shared_from_this();
  held_.fetch_add(1);
  batch.ring_ = ring_;
  batch.link_ = link_;
  batch.slot_ = b.slot();
  batch.generation_ = b.generation();
  batch.epoch_ = b.epoch();
  batch.step_ = b.step();
  batch.valid_ = b.valid_count();
  batch.after_ = PositionAfter(b, steps_per_epoch_);
  batch.waited_ = absl::FromChrono(std::chrono::steady_clock::now() - asked);
  batch.ids_.assign(b.ids().begin(), b.ids().end());
  batch.tensors_ = layout_;
  const std::byte* slot = ring_->base() + static_cast<uint64_t>(b.slot()) * stride_;
  for (size_t i = 0; i < batch.tensors_.size(); ++i) {
    batch.tensors_[i].data = slot + offsets_[i];
    batch.tensors_[i].device = ring_->device != nullptr ? ring_->device->ordinal() : -1;
  }
  {
    absl::MutexLock lock(&mu_);
    position_ = batch.after_;
    position_.fingerprint = fingerprint_;
  }
  return batch;
}

absl::Status SessionCore::Reconnect(absl::Time deadline) {
  auto gave_up = [this] {
    return absl::UnavailableError(
        absl::StrCat("gpufeedd at ", socket_, " did not come back within ",
                     absl::ToDoubleSeconds(reconnect_timeout_), " s (last: ", last_error_, ")"));
  };
  // The bound runs from the first failure until a batch of a new stream is handed out, so a
  // daemon that fails again before its first batch (a crash loop) does not renew it.
  if (!bounded_) {
    bounded_ = true;
    give_up_ = absl::Now() + reconnect_timeout_;
    backoff_ = absl::Milliseconds(50);
  }
  reconnecting_ = true;
  Stop();  // the stream that failed is over: join its reader (again: a no-op)
  if (absl::Now() >= give_up_) return gave_up();
  while (true) {
    absl::Status attempt = ReattachOnce();
    if (attempt.ok()) {
      reconnecting_ = false;
      return absl::OkStatus();
    }
    if (!absl::IsUnavailable(attempt) && !absl::IsNotFound(attempt) &&
        !absl::IsDeadlineExceeded(attempt) && !absl::IsAlreadyExists(attempt)) {
      const Position at = position();
      return absl::Status(attempt.code(),
                          absl::StrCat("re-attaching to gpufeedd at ", socket_, " at (",
                                       at.epoch, ", ", at.step, "): ", attempt.message()));
    }
    last_error_ = InOurWords(attempt, socket_);
    const absl::Time now = absl::Now();
    if (now >= give_up_) return gave_up();
    if (now >= deadline) return absl::DeadlineExceededError("re-attaching to gpufeedd");
    // Sleep the backoff (Detach wakes it), never past the bound or the call's deadline.
    const absl::Time wake = std::min({now + backoff_, give_up_, deadline});
    // A local socket: an attempt costs a failed connect() (microseconds), so the cap is low;
    // it is the most a rank waits after the new daemon answers.
    backoff_ = std::min(backoff_ * 2, absl::Milliseconds(200));
    absl::MutexLock lock(&mu_);
    auto detached = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return detached_; };
    if (mu_.AwaitWithDeadline(absl::Condition(&detached), wake)) {
      return absl::CancelledError("the session was detached while re-attaching");
    }
  }
}

absl::Status SessionCore::ReattachOnce() {
  absl::Status status = ReattachSteps();
  // A failed attempt closes its lifeline: a session the daemon made for it (an Attach whose
  // answer came too late, a MapRing that failed) is then freed at once, not at attach_timeout.
  if (!status.ok()) lifeline_.Reset();
  return status;
}

absl::Status SessionCore::ReattachSteps() {
  GPUFEED_RETURN_IF_ERROR(CheckSocket(socket_));
  channel_ = ChannelFor(socket_, /*fresh=*/true, keepalive_);
  stub_ = v1::Feed::NewStub(channel_);
  v1::AttachRequest request = request_;
  // How long this session has been without a stream, for the daemon's count and log.
  request.set_resume_gap_ms(static_cast<uint64_t>(std::max<int64_t>(
      1, absl::ToInt64Milliseconds(absl::Now() - (give_up_ - reconnect_timeout_)))));
  const Position at = position();
  request.mutable_start()->set_epoch(at.epoch);
  request.mutable_start()->set_step(at.step);
  request.mutable_start()->set_samples(at.samples);
  request.mutable_start()->set_fingerprint(fingerprint_);
  GPUFEED_RETURN_IF_ERROR(AttachWith(std::move(request), true).status());
  absl::Status status = MapRing();
  if (status.ok()) status = OpenStream();
  if (!status.ok()) {
    // Half attached: end it at the daemon so the retry's rank is free.
    v1::DetachRequest detach;
    detach.set_session_id(session_id_);
    detach.set_token(token_);
    v1::DetachResponse detached;
    (void)Call(stub_.get(), &v1::Feed::Stub::Detach, detach, &detached, CallTimeout(), "detach");
    return status;
  }
  return absl::OkStatus();
}

// Whoever finds no write in progress becomes the writer and sends every release queued
// meanwhile in one message, so releases that arrive while a write is under way share the next.
void SessionCore::Release(int32_t slot, uint64_t generation, absl::Duration waited, void* stream,
                          RingMapping* ring, uint64_t link) {
  {
    absl::MutexLock lock(&release_mu_);
    if (link != release_link_) return;  // an earlier attachment's: its session is gone
  }
  if (ring != nullptr && ring->device != nullptr) {
    // The daemon's next copy into this slot waits for the work queued on `stream` so far.
    absl::Status s = ring->device->RecordRelease(slot, stream);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      if (end_.ok()) end_ = s;  // a CUDA error: the next Next() reports it
    }
  }
  {
    absl::MutexLock lock(&release_mu_);
    if (link != release_link_) return;
    v1::Release* r = releases_.add_releases();
    r->set_slot(slot);
    r->set_generation(generation);
    r->set_waited_ns(static_cast<uint64_t>(absl::ToInt64Nanoseconds(waited)));
    if (release_writer_active_) return;
    release_writer_active_ = true;
  }
  while (true) {
    v1::StreamRequest request;
    uint64_t request_link = 0;
    {
      absl::MutexLock lock(&release_mu_);
      if (releases_.releases().empty()) {
        release_writer_active_ = false;
        return;
      }
      request.Swap(&releases_);
      request_link = release_link_;
    }
    absl::MutexLock lock(&write_mu_);
    // Session over, or re-attached meanwhile: nothing to return.
    if (writes_done_ || stream_ == nullptr || stream_link_ != request_link) continue;
    stream_->Write(request);
  }
}

absl::Status SessionCore::Detach() {
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

absl::StatusOr<Position> SessionCore::DaemonPosition() {
  v1::GetPositionRequest request;
  request.set_session_id(session_id_);
  request.set_token(token_);
  v1::GetPositionResponse response;
  GPUFEED_RETURN_IF_ERROR(Call(stub_.get(), &v1::Feed::Stub::GetPosition, request, &response,
                               rpc_timeout_, "position"));
  return Position{response.delivered().epoch(), response.delivered().step(),
                  response.delivered().fingerprint(), response.delivered().samples()};
}

absl::Status SessionCore::WaitReady(const RingMapping* ring, int32_t slot, void* stream) {
  if (ring == nullptr || ring->device == nullptr) return absl::OkStatus();
  return ring->device->WaitReady(slot, stream);
}

Position SessionCore::position() const {
  absl::MutexLock lock(&mu_);
  return position_;
}

int64_t SessionCore::rejected() const {
  absl::MutexLock lock(&mu_);
  return rejected_;
}

std::vector<std::string> SessionCore::ReadyEvents() const {
  return {device_reply_.ready_event_handles().begin(), device_reply_.ready_event_handles().end()};
}

void SessionCore::ReadLoop() {
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
  if (absl::IsUnavailable(status)) {
    // gRPC's transport text in our words; the daemon's own message ("stream: gpufeedd is
    // shutting down") as it is.
    if (std::string words = InOurWords(status, socket_); words != status.message()) {
      status = absl::UnavailableError(absl::StrCat("stream: ", words));
    }
  }
  absl::MutexLock lock(&mu_);
  if (end_.ok()) end_ = status;
}

void SessionCore::Stop() {
  {
    absl::MutexLock lock(&write_mu_);
    if (stream_ != nullptr && !writes_done_) {
      writes_done_ = true;
      stream_->WritesDone();
    }
  }
  if (stream_ctx_ != nullptr) stream_ctx_->TryCancel();
  if (reader_.joinable()) reader_.join();
  lifeline_.Reset();  // the session's end (or its stream's, before a re-attach)
}

}  // namespace gpufeed::client::internal
