#include "server/daemon.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/os/file.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "gpufeed/v1/config.pb.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/notify.h"
#include "server/service/feed_service.h"
#include "server/service/health_service.h"
#include "server/service/mem_server.h"
#include "server/service/metrics.h"
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

namespace {

// Collects protobuf's text-format errors with their line and column.
class ParseErrors final : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first.empty()) first = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  std::string first;
};

absl::Status CheckHostPort(const std::string& field, const std::string& value) {
  const size_t colon = value.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(value.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": want HOST:PORT (e.g. 0.0.0.0:9090), got '", value, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyConfigFile(const std::string& path, DaemonConfig* c) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("config: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  const std::string body = text.str();
  v1::DaemonConfig file;
  const size_t first = body.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && body[first] == '{') {
    const auto parsed = google::protobuf::util::JsonStringToMessage(body, &file);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": ", std::string(parsed.message())));
    }
  } else {
    google::protobuf::TextFormat::Parser parser;
    ParseErrors errors;
    parser.RecordErrorsTo(&errors);
    if (!parser.ParseFromString(body, &file)) {
      return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", errors.first));
    }
  }
  if (file.has_listen()) c->listen = file.listen();
  if (file.has_mem_socket()) c->mem_socket = file.mem_socket();
  if (file.has_staging_bytes()) c->staging_bytes = file.staging_bytes();
  if (file.has_device_bytes()) c->device_bytes = file.device_bytes();
  if (file.has_threads()) c->threads = file.threads();
  if (file.has_max_sessions()) c->max_sessions = file.max_sessions();
  if (file.has_ring_slots()) c->default_ring_slots = file.ring_slots();
  if (file.has_attach_timeout_ms()) c->attach_timeout = absl::Milliseconds(file.attach_timeout_ms());
  if (file.has_stall_timeout_ms()) c->stall_timeout = absl::Milliseconds(file.stall_timeout_ms());
  if (file.has_nvjpeg_library()) c->nvjpeg_library = file.nvjpeg_library();
  if (file.has_nvjpeg_interpolation()) c->nvjpeg_interpolation = file.nvjpeg_interpolation();
  if (file.has_shutdown_grace_ms()) {
    c->shutdown_grace = absl::Milliseconds(file.shutdown_grace_ms());
  }
  if (file.has_read_mode()) c->read_mode = file.read_mode();
  if (file.has_log_level()) c->log_level = file.log_level();
  if (file.has_log_format()) c->log_format = file.log_format();
  if (file.has_metrics_listen()) c->metrics_listen = file.metrics_listen();
  if (file.has_health_listen()) c->health_listen = file.health_listen();
  return absl::OkStatus();
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
  if (c.stall_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("stall_timeout: must be >= 0 (0 = off)");
  }
  if (c.shutdown_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("shutdown_grace: must be >= 0");
  }
  if (c.attach_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("attach_timeout: must be > 0");
  }
  if (!c.metrics_listen.empty()) GPUFEED_RETURN_IF_ERROR(CheckHostPort("metrics_listen", c.metrics_listen));
  if (!c.health_listen.empty()) GPUFEED_RETURN_IF_ERROR(CheckHostPort("health_listen", c.health_listen));
  GPUFEED_RETURN_IF_ERROR(SetLogFormat(c.log_format));
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
  CudaBackendOptions cuda;
  cuda.budget_bytes = c.device_bytes;
  cuda.nvjpeg_library = c.nvjpeg_library;
  cuda.nvjpeg_interpolation = c.nvjpeg_interpolation;
  GPUFEED_ASSIGN_OR_RETURN(d->devices_, CreateCudaBackend(cuda));
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
  DaemonInfo info;
  info.version = kVersion;
  info.started = absl::Now();
  info.pool = d->pool_.get();
  info.serving = [raw] { return raw->serving_.load(); };
  info.draining = [raw] { return raw->sessions_->draining(); };
  // A drain requested over gRPC ends the process as SIGTERM does: the main thread's sigwait
  // takes it and shuts down in order.
  info.drain = [raw](absl::Duration timeout) {
    return raw->Drain(timeout, [] { ::kill(::getpid(), SIGTERM); });
  };
  d->admin_service_ = std::make_unique<AdminService>(d->sessions_.get(), std::move(info));

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
  // Owner and group may connect (systemd's Group=gpufeed, the DaemonSet's group), whatever the
  // umask; the memory socket is 0660 as well.
  if (::chmod(socket_path.c_str(), 0660) != 0) {
    spdlog::warn("chmod 0660 of {}: {}", socket_path, std::strerror(errno));
  }
  if (!c.health_listen.empty()) {
    // A server of its own, with the health service alone: the TCP port must not expose Feed
    // or Admin (no authentication there; the Unix socket's permissions are the access control).
    d->tcp_health_ = std::make_unique<TcpHealthService>(
        [raw] { return raw->serving_.load() && !raw->stalled_; },
        [raw] { return raw->Ready(); });
    grpc::ServerBuilder health;
    health.AddListeningPort(c.health_listen, grpc::InsecureServerCredentials(), &d->health_port_);
    health.RegisterService(d->tcp_health_.get());
    // This server has its own health service; gRPC's default one would clash with it.
    grpc::EnableDefaultHealthCheckService(false);
    d->health_server_ = health.BuildAndStart();
    grpc::EnableDefaultHealthCheckService(true);
    if (d->health_server_ == nullptr || d->health_port_ == 0) {
      return absl::UnavailableError(absl::StrCat("health_listen: cannot serve on ", c.health_listen));
    }
  }
  if (!c.metrics_listen.empty()) {
    MetricsSources sources{kVersion, d->devices_ != nullptr, d->sessions_.get(), d->pool_.get(),
                           d->devices_.get()};
    GPUFEED_ASSIGN_OR_RETURN(d->metrics_, MetricsServer::Start(c.metrics_listen, sources));
  }
  // Liveness ("") and readiness ("gpufeed.v1.Feed") go SERVING once both sockets are bound and
  // the GPUs initialised, on the Unix socket and the TCP health port alike.
  d->SetServing(true);
  const std::string status = absl::StrCat("serving on ", c.listen, ", staging ",
                                          c.staging_bytes >> 20, " MiB, ", c.threads, " threads");
  spdlog::info("gpufeedd {} serving on {} (memory socket {}), staging {} MiB, {} threads, "
               "{} reads{}{}",
               kVersion, c.listen, c.mem_socket, c.staging_bytes >> 20, c.threads, c.read_mode,
               c.metrics_listen.empty() ? "" : absl::StrCat(", metrics on ", c.metrics_listen),
               c.health_listen.empty() ? "" : absl::StrCat(", health on ", c.health_listen));
  d->notifier_ = std::make_unique<SystemdNotifier>();
  d->notifier_->Ready(status, [raw] { return !raw->stalled_; });
  // A GPU context can break at any time (an illegal address in a kernel): every later CUDA
  // call fails, so readiness goes NOT_SERVING and the daemon stops itself with exit code 1
  // for its supervisor (systemd's Restart=on-failure, Kubernetes) to start a fresh one.
  d->readiness_monitor_ = std::thread([raw] {
    while (!raw->stop_drain_watcher_) {
      absl::SleepFor(absl::Milliseconds(250));
      raw->CheckProgress();
      if (raw->devices_ != nullptr && !raw->devices_->healthy() && raw->exit_code_ == 0) {
        spdlog::error("a GPU's CUDA context failed for good: readiness NOT_SERVING, exiting "
                      "with status 1 to be restarted");
        raw->exit_code_ = 1;
        raw->SetServing(true);  // live, not ready, until the shutdown
        ::kill(::getpid(), SIGTERM);
        return;
      }
    }
  });
  return d;
}

void Daemon::CheckProgress() {
  if (config_.stall_timeout <= absl::ZeroDuration()) return;
  std::vector<const BusyMark*> marks = sessions_->busy_marks();
  if (devices_ != nullptr) {
    for (const BusyMark* m : devices_->busy_marks()) marks.push_back(m);
  }
  const absl::Time now = absl::Now();
  const BusyMark* stuck = nullptr;
  absl::Duration longest;
  for (const BusyMark* m : marks) {
    const absl::Duration busy = m->BusyFor(now);
    if (busy > longest) {
      longest = busy;
      stuck = m;
    }
  }
  const bool stalled = longest >= config_.stall_timeout;
  if (stalled == stalled_) return;
  stalled_ = stalled;
  if (stalled) {
    spdlog::error("stalled: thread {} has been in one work item for {} (--stall_timeout {}): "
                  "liveness NOT_SERVING, systemd watchdog pings stop",
                  stuck->name(), absl::FormatDuration(longest),
                  absl::FormatDuration(config_.stall_timeout));
  } else {
    spdlog::warn("progress again: liveness SERVING");
  }
  SetServing(serving_);
}

void Daemon::SetServing(bool serving) {
  serving_ = serving;
  // The TCP health port reads serving_ and the drain itself.
  if (server_ != nullptr) {
    grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
    health->SetServingStatus("", serving && !stalled_);
    // Readiness: not while draining, nor after a sticky CUDA error.
    health->SetServingStatus("gpufeed.v1.Feed", serving && Ready());
  }
}

bool Daemon::Ready() const {
  return serving_ && !stalled_ && !sessions_->draining() &&
         (devices_ == nullptr || devices_->healthy());
}

int Daemon::metrics_port() const { return metrics_ == nullptr ? 0 : metrics_->port(); }

int Daemon::Drain(absl::Duration timeout, std::function<void()> on_drained) {
  const int sessions = sessions_->num_sessions();
  absl::MutexLock lock(&drain_mu_);
  if (stopping_ || sessions_->draining()) return sessions;  // already, or shutting down anyway
  sessions_->BeginDrain();
  SetServing(serving_);
  if (notifier_ != nullptr) notifier_->Status(absl::StrCat("draining, ", sessions, " sessions"));
  spdlog::info("drain: readiness NOT_SERVING, {} sessions run on{}", sessions,
               timeout > absl::ZeroDuration()
                   ? absl::StrCat(", at most ", absl::FormatDuration(timeout))
                   : std::string());
  const absl::Time deadline =
      timeout > absl::ZeroDuration() ? absl::Now() + timeout : absl::InfiniteFuture();
  drain_watcher_ = std::thread([this, deadline, on_drained = std::move(on_drained)] {
    while (!stop_drain_watcher_) {
      const int left = sessions_->num_sessions();
      if (left == 0 || absl::Now() >= deadline) {
        spdlog::info("drain: {}", left == 0 ? "the last session has ended"
                                            : absl::StrCat("deadline passed with ", left,
                                                           " sessions attached"));
        on_drained();
        return;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  return sessions;
}

void Daemon::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  // In order: stop admitting and say so, end the sessions (their streams finish with
  // UNAVAILABLE), stop the server within the grace period, then the rest in reverse.
  if (notifier_ != nullptr) notifier_->Stopping("shutting down");
  {
    absl::MutexLock lock(&drain_mu_);
    stopping_ = true;  // no Drain starts a watcher from now on
  }
  stop_drain_watcher_ = true;
  if (drain_watcher_.joinable()) drain_watcher_.join();
  if (readiness_monitor_.joinable()) readiness_monitor_.join();
  SetServing(false);
  if (sessions_ != nullptr) sessions_->Shutdown(absl::UnavailableError("gpufeedd is shutting down"));
  if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now() +
                                            absl::ToChronoNanoseconds(config_.shutdown_grace));
  if (health_server_ != nullptr) {
    health_server_->Shutdown(std::chrono::system_clock::now() +
                             absl::ToChronoNanoseconds(config_.shutdown_grace));
  }
  metrics_.reset();
  mem_server_.reset();
  spdlog::info("gpufeedd stopped");
}

Daemon::~Daemon() {
  Shutdown();
  health_server_.reset();
  tcp_health_.reset();
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
