#include "server/daemon.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/os/file.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/service/feed_service.h"
#include "server/service/mem_server.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "spdlog/spdlog.h"
#ifdef GPUFEED_WITH_CUDA
#include "server/device/cuda_backend.h"
#endif

namespace gpufeed::server {

absl::StatusOr<std::string> UnixPathOf(const std::string& listen) {
  std::string path;
  if (absl::StartsWith(listen, "unix://")) {
    path = listen.substr(7);
  } else if (absl::StartsWith(listen, "unix:")) {
    path = listen.substr(5);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "listen: '", listen, "' is not a unix socket address (want unix:///path/to.sock)"));
  }
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("listen: '", listen, "' must name an absolute socket path"));
  }
  return path;
}

absl::Status ValidateConfig(DaemonConfig& c) {
  GPUFEED_ASSIGN_OR_RETURN(std::string path, UnixPathOf(c.listen));
  if (c.mem_socket.empty()) {
    std::string base = path;
    if (absl::EndsWith(base, ".sock")) base.resize(base.size() - 5);
    c.mem_socket = base + ".mem.sock";
  }
  if (c.mem_socket[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("mem_socket: must be an absolute path, got '", c.mem_socket, "'"));
  }
  if (c.mem_socket == path) {
    return absl::InvalidArgumentError("mem_socket: must differ from the listen socket");
  }
  if (c.staging_bytes < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_bytes: at least 1 MiB, got ", c.staging_bytes));
  }
  if (c.staging_slab_bytes < (uint64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_slab_bytes: at least 1 MiB, got ", c.staging_slab_bytes));
  }
  if (c.threads < 0 || c.threads > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("threads: 0 to 1024, got ", c.threads));
  }
  if (c.threads == 0) c.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (c.max_sessions < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_sessions: >= 1, got ", c.max_sessions));
  }
  if (c.default_ring_slots < 0 || c.default_ring_slots > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring_slots: 0 (auto) to 64, got ", c.default_ring_slots));
  }
  if (c.device_bytes == 0) {
    return absl::InvalidArgumentError("device_bytes: must be > 0");
  }
  if (c.read_mode != "mmap" && c.read_mode != "pread") {
    return absl::InvalidArgumentError(
        absl::StrCat("read_mode: want mmap or pread, got '", c.read_mode, "'"));
  }
  return SetLogLevel(c.log_level);
}

Daemon::Daemon(DaemonConfig config) : config_(std::move(config)) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(DaemonConfig config) {
  GPUFEED_RETURN_IF_ERROR(ValidateConfig(config));
  std::unique_ptr<Daemon> d(new Daemon(std::move(config)));
  const DaemonConfig& c = d->config_;
  const std::string socket_path = *UnixPathOf(c.listen);
  if (UnixSocketInUse(socket_path)) {
    return absl::AlreadyExistsError(
        absl::StrCat("listen: socket ", socket_path, " is in use by another process"));
  }

  GPUFEED_ASSIGN_OR_RETURN(d->pool_, StagingPool::Create(c.staging_bytes, c.staging_slab_bytes));
#ifdef GPUFEED_WITH_CUDA
  GPUFEED_ASSIGN_OR_RETURN(d->devices_, CreateCudaBackend(c.device_bytes));
  if (!d->devices_->gpu_uuids().empty()) {
    // Pinned once at start-up (13.5 ms per 256 MiB measured): copies from it run at full
    // PCIe speed and asynchronously.
    for (int i = 0; i < d->pool_->num_slabs(); ++i) {
      GPUFEED_RETURN_IF_ERROR(PinHost(d->pool_->slab_data(i), d->pool_->slab_bytes(i)));
    }
    d->pinned_ = true;
  } else {
    spdlog::info("no CUDA device visible: serving host delivery only");
  }
#endif
  SessionManagerOptions options;
  options.threads = c.threads;
  options.max_sessions = c.max_sessions;
  options.default_ring_slots = c.default_ring_slots;
  options.attach_timeout = c.attach_timeout;
  FileSystem* fs = c.read_mode == "pread" ? PosixFileSystem() : MappedFileSystem();
  d->sessions_ = std::make_unique<SessionManager>(options, d->pool_.get(), fs, d->devices_.get());
  GPUFEED_ASSIGN_OR_RETURN(d->mem_server_,
                           MemServer::Start(c.mem_socket, d->sessions_.get(), d->pool_.get()));

  d->feed_service_ = std::make_unique<FeedService>(d->sessions_.get(), c.mem_socket);
  Daemon* raw = d.get();
  d->admin_service_ = std::make_unique<AdminService>(
      d->sessions_.get(),
      DaemonInfo{kVersion, absl::Now(), d->pool_.get(), [raw] { return raw->serving_.load(); }});

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(c.listen, grpc::InsecureServerCredentials());
  builder.RegisterService(d->feed_service_.get());
  builder.RegisterService(d->admin_service_.get());
  builder.SetMaxReceiveMessageSize(4 << 20);
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("listen: cannot serve on ", c.listen,
                                               " (is its directory there and writable?)"));
  }
  grpc::HealthCheckServiceInterface* health = d->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus("gpufeed.v1.Feed", true);
  d->serving_ = true;
  spdlog::info("gpufeedd {} serving on {} (memory socket {}), staging {} MiB, {} threads, "
               "{} reads",
               kVersion, c.listen, c.mem_socket, c.staging_bytes >> 20, c.threads, c.read_mode);
  return d;
}

void Daemon::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // In order: stop admitting and say so, end the sessions (their streams finish with
  // UNAVAILABLE), stop the server within the grace period, then the rest in reverse.
  serving_ = false;
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
  }
  if (sessions_ != nullptr) sessions_->Shutdown(absl::UnavailableError("gpufeedd is shutting down"));
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() +
                                            absl::ToChronoNanoseconds(config_.shutdown_grace));
  mem_server_.reset();
  spdlog::info("gpufeedd stopped");
}

Daemon::~Daemon() {
  Shutdown();
  server_.reset();
  admin_service_.reset();
  feed_service_.reset();
  sessions_.reset();  // frees the rings, host and device
  devices_.reset();   // joins the copy threads
#ifdef GPUFEED_WITH_CUDA
  if (pinned_) {
    for (int i = 0; i < pool_->num_slabs(); ++i) UnpinHost(pool_->slab_data(i));
  }
#endif
  pool_.reset();
}

}  // namespace gpufeed::server
