// The public Session and Batch: thin handles on internal::SessionCore (session_core.h).
#include "gpufeed/client.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/rpc.h"
#include "client/cpp/session_core.h"
#include "common/os/runtime_dir.h"
#include "common/status.h"

namespace gpufeed::client {

// ---- Batch ----

Batch::Batch(Batch&& other) noexcept { *this = std::move(other); }

Batch& Batch::operator=(Batch&& other) noexcept {
  if (this != &other) {
    Release(nullptr);
    core_ = std::move(other.core_);
    ring_ = std::move(other.ring_);
    link_ = other.link_;
    slot_ = std::exchange(other.slot_, -1);
    generation_ = other.generation_;
    epoch_ = other.epoch_;
    step_ = other.step_;
    valid_ = other.valid_;
    after_ = std::move(other.after_);
    waited_ = other.waited_;
    ids_ = std::move(other.ids_);
    tensors_ = std::move(other.tensors_);
  }
  return *this;
}

Batch::~Batch() { Release(nullptr); }

void Batch::Release(void* stream) {
  if (core_ == nullptr) return;
  core_->Release(slot_, generation_, waited_, stream, ring_.get(), link_);
  core_->BatchReleased();
  core_.reset();
  ring_.reset();
  for (Tensor& t : tensors_) t.data = nullptr;
}

absl::Status Batch::WaitReady(void* stream) const {
  if (core_ == nullptr) return absl::FailedPreconditionError("the batch was released");
  return internal::SessionCore::WaitReady(ring_.get(), slot_, stream);
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

// Detaches now if no batch is held, else when the last held batch is released (each Batch
// keeps the core): a held batch's bytes never change under it.
Session::~Session() {
  if (core_ != nullptr) (void)core_->DetachWhenUnused();
}

std::string DefaultSocket() {
  return DefaultSocketPath(std::getenv("XDG_RUNTIME_DIR"), kSystemRuntimeDir);
}

std::string SocketPath(const std::string& given) {
  if (given.empty()) return DefaultSocket();
  for (const char* scheme : {"unix://", "unix:"}) {
    if (absl::StartsWith(given, scheme)) return given.substr(std::strlen(scheme));
  }
  return given;
}

absl::StatusOr<std::unique_ptr<Session>> Session::Attach(const AttachOptions& given) {
  AttachOptions options = given;
  options.socket = SocketPath(given.socket);
  GPUFEED_RETURN_IF_ERROR(internal::ProbeSocket(options.socket));
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout: must be > 0");
  }
  if (options.reconnect_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("reconnect_timeout: must be >= 0 (0: no re-attach)");
  }
  if (options.keepalive != absl::ZeroDuration() && options.keepalive < absl::Seconds(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("keepalive: must be 0 (no pings) or at least 1s, got ",
                     absl::FormatDuration(options.keepalive)));
  }
  auto core = std::make_shared<internal::SessionCore>(
      internal::ChannelFor(options.socket, /*fresh=*/false, options.keepalive), options.socket,
      options.rpc_timeout, options.reconnect_timeout, options.keepalive);
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
std::vector<BlendSegment> Session::blend_segments() const { return core_->blend_segments(); }
absl::StatusOr<Position> Session::DaemonPosition() { return core_->DaemonPosition(); }
int64_t Session::rejected_releases() const { return core_->rejected(); }
bool Session::reconnecting() const { return core_->reconnecting(); }
// Batches still held keep this session and its ring: the daemon frees an ended ring's pages,
// so the detach waits for the last of them (DetachWhenUnused).
absl::Status Session::Detach() { return core_->DetachWhenUnused(); }

}  // namespace gpufeed::client
