#include "server/daemon.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "common/os/file.h"
#include "common/os/runtime_dir.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_posix.h"
#include "server/service/access_policy.h"
#include "server/notify.h"
#include "server/service/feed_service.h"
#include "server/service/health_service.h"
#include "server/service/mem_server.h"
#include "server/service/metrics.h"
#include "server/service/peer_listener.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "spdlog/spdlog.h"
#ifdef GPUFEED_WITH_CUDA
#include "server/device/cuda_backend.h"
#endif

namespace gpufeed::server {
namespace {

// GRPC_ARG_MAX_CONCURRENT_STREAMS: a training process has a few calls at a time on its
// connection (a Stream per session, an Attach, a GetPosition).
constexpr int kMaxCallsPerConnection = 128;

// The connections' cap should fit in the process's descriptors, with room for the memory
// socket's 64, datasets and gRPC's own; past the limit, accepts wait (EMFILE) instead.
void WarnIfFewDescriptors(const DaemonConfig& c) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return;
  const uint64_t wanted = static_cast<uint64_t>(c.max_connections) + 256;
  if (limit.rlim_cur < wanted) {
    spdlog::warn(
        "max_connections {} needs about {} descriptors, RLIMIT_NOFILE is {}: past it "
        "new connections wait (raise LimitNOFILE, or lower max_connections)",
        c.max_connections, wanted, limit.rlim_cur);
  }
}

}  // namespace

Daemon::Daemon(DaemonConfig config, std::function<void(StopReason)> request_stop)
    : config_(std::move(config)), request_stop_(std::move(request_stop)) {}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(
    DaemonConfig config, std::function<void(StopReason)> request_stop, DaemonDeps deps) {
  ConfigureLogging(config.log_level, config.log_format);
  std::unique_ptr<Daemon> d(new Daemon(std::move(config), std::move(request_stop)));
  d->clock_ = deps.clock;
  const DaemonConfig& c = d->config_;
  // No --listen: both sockets in the runtime directory, made now (so a bare gpufeedd
  // starts), or in $XDG_RUNTIME_DIR/gpufeed where the daemon may not make it.
  std::string runtime_note;
  if (c.listen.empty()) {
    GPUFEED_ASSIGN_OR_RETURN(
        const RuntimeDir dir,
        PrepareRuntimeDir(c.runtime_dir,
                          c.xdg_runtime_dir.empty() ? nullptr : c.xdg_runtime_dir.c_str(),
                          ::geteuid()));
    d->config_.listen = absl::StrCat("unix://", dir.path, "/", kSocketName);
    if (c.mem_socket.empty()) d->config_.mem_socket = absl::StrCat(dir.path, "/", kMemSocketName);
    if (c.mem_socket == absl::StrCat(dir.path, "/", kSocketName)) {
      return absl::InvalidArgumentError("mem_socket: must differ from the listen socket");
    }
    runtime_note = absl::StrCat("; ", dir.how);
  }
  GPUFEED_ASSIGN_OR_RETURN(const std::string socket_path, UnixPathOf(c.listen));
  // The gRPC socket is ours (peer credentials, docs/SECURITY.md section 1): bound now, so a
  // socket in use is fatal before anything else starts; accepting starts with the server.
  // "listen: socket PATH is in use by another process".
  {
    absl::StatusOr<std::unique_ptr<PeerListener>> listener = PeerListener::Bind(socket_path);
    if (!listener.ok()) return Annotate(listener.status(), "listen");
    d->listener_ = *std::move(listener);
  }

  GPUFEED_ASSIGN_OR_RETURN(d->pool_, StagingPool::Create(c.staging_bytes, c.staging_slab_bytes));
  d->devices_ = std::move(deps.devices);
#ifdef GPUFEED_WITH_CUDA
  if (d->devices_ == nullptr) {
    CudaBackendOptions cuda;
    cuda.budget_bytes = c.device_bytes;
    cuda.nvjpeg_library = c.nvjpeg_library;
    cuda.nvjpeg_interpolation = c.nvjpeg_interpolation;
    GPUFEED_ASSIGN_OR_RETURN(d->devices_, CreateCudaBackend(cuda));
    if (!d->devices_->gpu_uuids().empty()) {
      // Pinned once at start-up (docs/benchmarks.md, Device delivery): copies from it run at full
      // PCIe speed and asynchronously. Only the slabs: device sessions stage there. Host rings
      // (their own memfds) are not pinned: the daemon never copies from one to a GPU, and a
      // registration is the daemon's own (its CUDA context), so it would not speed up a
      // consumer's copies from its mapping, only cost time per Attach and locked memory.
      for (int i = 0; i < d->pool_->num_slabs(); ++i) {
        GPUFEED_RETURN_IF_ERROR(PinHost(d->pool_->slab_data(i), d->pool_->slab_bytes(i)));
      }
      d->pinned_ = true;
    } else {
      spdlog::info("no CUDA device visible: serving host delivery only");
    }
  }
#endif
  if (!c.s3_endpoint.empty()) {
    objstore::ObjectStoreOptions store;
    store.s3.endpoint = c.s3_endpoint == "aws" ? "" : c.s3_endpoint;
    store.s3.region = c.s3_region;
    store.s3.path_style = !store.s3.endpoint.empty();
    store.s3.max_connections = c.s3_max_connections;
    store.cache_dir = c.cache_dir;
    store.cache_bytes = c.cache_bytes;
    absl::StatusOr<std::unique_ptr<objstore::ObjectStore>> created =
        objstore::ObjectStore::Create(std::move(store));
    if (!created.ok()) {
      return absl::Status(created.status().code(),
                          absl::StrCat("s3_endpoint: ", created.status().message()));
    }
    d->object_store_ = *std::move(created);
    spdlog::info("serving s3:// datasets from {}{}", c.s3_endpoint,
                 c.cache_bytes == 0
                     ? std::string(" (no cache)")
                     : absl::StrCat(" through a cache of ", c.cache_bytes, " bytes in ",
                                    c.cache_dir.empty() ? "memory" : c.cache_dir));
  }
  SessionManagerOptions options;
  options.access.object_store = d->object_store_.get();
  options.threads = c.threads;
  options.max_sessions = c.max_sessions;
  options.default_ring_slots = c.ring_slots;
  options.adaptive_decode = c.adaptive_decode;
  options.cheapest_cpu_rows = c.cheapest_cpu_rows;
  options.share_cache_bytes = c.share_cache_bytes;
  options.share_groups_across_uids = c.share_groups_across_uids;
  options.max_batch_time = c.max_batch_time;
  options.attach_timeout = c.attach_timeout;
  options.feed_limits.max_samples = c.max_samples_per_feed;
  options.feed_limits.max_image_bytes = c.max_image_bytes;
  options.feed_limits.max_image_pixels = c.max_image_pixels;
  options.feed_limits.region_decode = c.region_decode;
  d->counters_ = std::make_shared<metrics::Counters>();
  options.feed_limits.counters = d->counters_;
  options.max_ids_bytes = c.max_ids_bytes;
  options.max_ids_bytes_per_uid = c.max_ids_bytes_per_uid;
  options.access.walk.index_bytes = ByteBudget::Create(
      "max_index_bytes", c.max_index_bytes, "max_index_bytes_per_uid", c.max_index_bytes_per_uid,
      "use fewer or smaller shards (or folders), or ask the node's admin to raise it");
  options.access.dataset_roots = c.dataset_roots;
  options.access.walk.max_entries = c.max_folder_entries;
  options.access.walk.timeout = c.folder_walk_timeout;
  options.max_sessions_per_uid = c.max_sessions_per_uid;
  options.max_staging_bytes_per_uid = StagingBytesPerUid(c);
  options.idle_lease_timeout = c.idle_lease_timeout;
  options.clock = d->clock_;
  FileSystem* fs = deps.fs != nullptr                 ? deps.fs
                   : c.read_mode == ReadMode::kPread ? PosixFileSystem()
                                                     : MappedFileSystem();
  d->sessions_ = std::make_unique<SessionManager>(options, d->pool_.get(), fs, d->devices_.get());
  MemServerOptions mem_options{c.mem_request_timeout};
  // Root and the daemon's uid skip the per-uid connection cap only where they are admins by
  // themselves: where a root pod reaches the socket (root_is_admin false) it is capped.
  mem_options.exempt_root_and_daemon = c.root_is_admin && c.daemon_uid_is_admin;
  GPUFEED_ASSIGN_OR_RETURN(d->mem_server_,
                           MemServer::Start(c.mem_socket, d->sessions_.get(), mem_options));

  AccessPolicy policy;
  policy.allow_uids = c.allow_uids;
  policy.allow_gids = c.allow_gids;
  policy.admin_uids = c.admin_uids;
  policy.admin_gids = c.admin_gids;
  policy.daemon_uid = static_cast<uint32_t>(::geteuid());
  policy.root_is_admin = c.root_is_admin;
  policy.daemon_uid_is_admin = c.daemon_uid_is_admin;
  PeerListener* listener = d->listener_.get();
  d->callers_ = std::make_unique<CallerResolver>(
      [listener](absl::string_view peer) { return listener->Lookup(peer); }, std::move(policy));
  d->feed_service_ = std::make_unique<FeedService>(
      d->sessions_.get(), d->callers_.get(), c.mem_socket, c.attach_threads,
      UnopenedStreamLimits{c.max_connections_per_uid, c.max_connections, c.stream_open_timeout});
  Daemon* raw = d.get();
  DaemonInfo info;
  info.version = kVersion;
  info.started = absl::Now();
  info.pool = d->pool_.get();
  info.mem_socket = c.mem_socket;
  if (d->devices_ != nullptr) {
    info.gpus = d->devices_->gpu_uuids();
    info.mps_gpus = d->devices_->mps_gpu_uuids();
  }
  info.serving = [raw] { return raw->serving_.load(); };
  info.draining = [raw] { return raw->sessions_->draining(); };
  // A drain requested over gRPC ends the process as SIGTERM does: the owner shuts down in
  // order.
  info.drain = [raw](absl::Duration timeout) {
    return raw->Drain(timeout, [raw] {
      if (raw->request_stop_) raw->request_stop_(StopReason::kDrained);
    });
  };
  d->admin_service_ =
      std::make_unique<AdminService>(d->sessions_.get(), d->callers_.get(), std::move(info));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // No listening port: the listener hands every accepted connection over, once its peer's
  // credentials are recorded.
  builder.RegisterService(d->feed_service_.get());
  builder.RegisterService(d->admin_service_.get());
  builder.SetMaxReceiveMessageSize(4 << 20);
  // Clients ping every AttachOptions.keepalive (10 s by default, at least 1 s) to find a
  // daemon that stopped answering (SIGSTOP, a hang); gRPC's defaults would answer pings more
  // often than every 5 minutes on a quiet connection with GOAWAY (too_many_pings).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Bounded cost (docs/SECURITY.md section 4). These apply to the connections the listener
  // hands over too (AddInsecureChannelFromFd builds their transport and filters from the
  // server's channel args). Calls one connection may have in progress: a call whose request
  // never comes holds gRPC's state unseen by the services (a client waits for a free one).
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxCallsPerConnection);
  // A connection with no call in progress this long gets a GOAWAY and is closed; a client
  // reconnects on its next call. Pings do not count as calls.
  if (c.connection_idle_timeout > absl::ZeroDuration()) {
    builder.AddChannelArgument(
        GRPC_ARG_MAX_CONNECTION_IDLE_MS,
        static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(c.connection_idle_timeout),
                                           std::numeric_limits<int>::max())));
  }
  d->server_ = builder.BuildAndStart();
  if (d->server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat("listen: cannot serve on ", c.listen));
  }
  // The socket is mode 0660 (PeerListener::Bind): owner and group may connect (systemd's
  // Group=gpufeed, the DaemonSet's group), whatever the umask; the memory socket as well.
  grpc::Server* server = d->server_.get();
  PeerListenerOptions limits;
  limits.max_connections_per_uid = c.max_connections_per_uid;
  limits.max_connections = c.max_connections;
  const CallerResolver* callers = d->callers_.get();
  limits.exempt = [callers](const PeerCred& cred) {
    return MakeCaller(cred, callers->policy()).admin;
  };
  WarnIfFewDescriptors(c);
  d->listener_->Start([server](int fd) { grpc::AddInsecureChannelFromFd(server, fd); },
                      std::move(limits));
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
                           d->devices_.get(), c.metrics_job_labels};
    sources.counters = d->counters_.get();
    sources.object_store = d->object_store_.get();
    GPUFEED_ASSIGN_OR_RETURN(d->metrics_, MetricsServer::Start(c.metrics_listen, sources));
  }
  // Liveness ("") and readiness ("gpufeed.v1.Feed") go SERVING once both sockets are bound and
  // the GPUs initialised, on the Unix socket and the TCP health port alike.
  d->SetServing(true);
  const std::string status = absl::StrCat("serving on ", c.listen, ", staging ",
                                          c.staging_bytes >> 20, " MiB, ", c.threads, " threads");
  spdlog::info("gpufeedd {} serving on {} (memory socket {}{}), staging {} MiB, {} threads, "
               "{} reads{}{}",
               kVersion, c.listen, c.mem_socket, runtime_note, c.staging_bytes >> 20, c.threads,
               ReadModeName(c.read_mode),
               c.metrics_listen.empty() ? "" : absl::StrCat(", metrics on ", c.metrics_listen),
               c.health_listen.empty() ? "" : absl::StrCat(", health on ", c.health_listen));
  {
    const AccessPolicy& p = d->callers_->policy();
    spdlog::info(
        "access: consumers {}; admins {}{}{}; per uid at most {} sessions and {} "
        "bytes of staging; idle leases end after {}; connections at most {} per uid and {} in "
        "all, idle ones closed after {}; a stream's open within {}",
        p.allow_uids.empty() && p.allow_gids.empty()
            ? std::string("anyone who can connect")
            : absl::StrCat("uids [", absl::StrJoin(p.allow_uids, ","), "] and groups [",
                           absl::StrJoin(p.allow_gids, ","), "]"),
        absl::StrCat(p.root_is_admin ? "root" : "not root (root_is_admin: false)",
                     p.daemon_uid == 0 ? ""
                     : p.daemon_uid_is_admin
                         ? absl::StrCat(", uid ", p.daemon_uid, " (the daemon's)")
                         : absl::StrCat(", not the daemon's uid ", p.daemon_uid,
                                        " (daemon_uid_is_admin: false)")),
        p.admin_uids.empty() ? "" : absl::StrCat(", uids ", absl::StrJoin(p.admin_uids, ",")),
        p.admin_gids.empty() ? "" : absl::StrCat(", groups ", absl::StrJoin(p.admin_gids, ",")),
        c.max_sessions_per_uid, StagingBytesPerUid(c),
        c.idle_lease_timeout > absl::ZeroDuration() ? absl::FormatDuration(c.idle_lease_timeout)
                                                    : std::string("never"),
        c.max_connections_per_uid, c.max_connections,
        c.connection_idle_timeout > absl::ZeroDuration()
            ? absl::FormatDuration(c.connection_idle_timeout)
            : std::string("never"),
        absl::FormatDuration(c.stream_open_timeout));
  }
  d->notifier_ = std::make_unique<SystemdNotifier>();
  d->notifier_->Ready(status, [raw] { return !raw->stalled_; });
  // A GPU context can break at any time (an illegal address in a kernel): every later CUDA
  // call fails, so readiness goes NOT_SERVING and the daemon asks to be stopped, with exit code
  // 1 for its supervisor (systemd's Restart=on-failure, Kubernetes) to start a fresh one.
  d->readiness_monitor_ = std::thread([raw] {
    while (!raw->stop_threads_.WaitForNotificationWithTimeout(absl::Milliseconds(250))) {
      raw->CheckProgress();
      if (raw->devices_ != nullptr && !raw->devices_->healthy() && raw->exit_code_ == 0) {
        spdlog::error("a GPU's CUDA context failed for good: readiness NOT_SERVING, exiting "
                      "with status 1 to be restarted");
        raw->exit_code_ = 1;
        raw->SetServing(true);  // live, not ready, until the shutdown
        if (raw->request_stop_) raw->request_stop_(StopReason::kGpuFailed);
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
  const std::optional<Stall> stall = FindStall(marks, absl::Now(), config_.stall_timeout);
  const bool stalled = stall.has_value();
  if (stalled == stalled_) return;
  stalled_ = stalled;
  if (stalled) {
    spdlog::error("stalled: thread {} has been in one work item for {} (--stall_timeout {}): "
                  "liveness NOT_SERVING, systemd watchdog pings stop",
                  stall->mark->name(), absl::FormatDuration(stall->busy),
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
      timeout > absl::ZeroDuration() ? clock_() + timeout : absl::InfiniteFuture();
  drain_watcher_ = std::thread([this, deadline, on_drained = std::move(on_drained)] {
    // The session count is looked at every 20 ms (a lock and a map size); the deadline is
    // kept to within that too, by the daemon's clock.
    do {
      const int left = sessions_->num_sessions();
      if (left == 0 || clock_() >= deadline) {
        spdlog::info("drain: {}", left == 0 ? "the last session has ended"
                                            : absl::StrCat("deadline passed with ", left,
                                                           " sessions attached"));
        on_drained();
        return;
      }
    } while (!stop_threads_.WaitForNotificationWithTimeout(
        std::min(absl::Milliseconds(20), deadline - clock_())));
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
  if (!stop_threads_.HasBeenNotified()) stop_threads_.Notify();
  if (drain_watcher_.joinable()) drain_watcher_.join();
  if (readiness_monitor_.joinable()) readiness_monitor_.join();
  SetServing(false);
  if (sessions_ != nullptr) sessions_->Shutdown(absl::UnavailableError("gpufeedd is shutting down"));
  // No connection is handed to the server once it shuts down.
  if (listener_ != nullptr) listener_->Stop();
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
  listener_.reset();  // removes the socket file
  admin_service_.reset();
  feed_service_.reset();
  callers_.reset();
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
