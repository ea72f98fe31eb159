// gpufeedd as a library: the object that owns every part of the running daemon in start-up
// order (and destroys them in reverse). Its configuration is server/config.h's.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/version.h"
#include "server/config.h"
#include "server/device/device_backend.h"
#include "server/objstore/object_store.h"

namespace grpc {
class Server;
}

namespace gpufeed {
class FileSystem;
}

namespace gpufeed::metrics {
class Counters;
}

namespace gpufeed::server {

class StagingPool;
class SessionManager;
class MemServer;
class FeedService;
class AdminService;
class DeviceBackend;
class MetricsServer;
class TcpHealthService;
class SystemdNotifier;
class PeerListener;
class CallerResolver;

// What the daemon would otherwise make for itself (docs/STYLE.md rule 8); the defaults are
// gpufeedd's. Tests inject fakes (tests/testing/test_daemon.h).
struct DaemonDeps {
  // The file system datasets are read through; null: the POSIX one of config.read_mode.
  // Must outlive the daemon.
  FileSystem* fs = nullptr;
  // The GPUs; null: the CUDA backend where built with CUDA (else none: host delivery only).
  // A given backend is used as it is: the staging slabs are not pinned for it.
  std::unique_ptr<DeviceBackend> devices;
  // "Now" for the lease decisions (SessionManagerOptions::clock) and drain deadlines.
  Clock clock = RealClock();
};

class Daemon {
 public:
  // Why the daemon asks the process to stop (see Start's `request_stop`).
  enum class StopReason {
    kDrained,    // a drain ended: the last session left or its timeout passed; exit 0
    kGpuFailed,  // a GPU's CUDA context broke for good; exit 1 (exit_code())
  };

  // Configures logging, binds both sockets and starts serving; fatal problems (socket in use,
  // no memory) are returned, naming what failed. `config` as LoadConfig returns it: validated.
  // The daemon calls `request_stop`, from a thread of its own, when it wants the process to
  // stop (once per reason at most); the owner then calls Shutdown() from another thread, as it
  // does for SIGTERM.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(
      DaemonConfig config, std::function<void(StopReason)> request_stop, DaemonDeps deps = {});
  ~Daemon();

  // Health NOT_SERVING, sessions end with UNAVAILABLE, the server stops within the grace
  // period. Idempotent.
  void Shutdown();

  // Readiness NOT_SERVING and new sessions refused; `on_drained` runs (once, on a thread of
  // the daemon's) when the last session has ended or `timeout` has passed (zero: no limit).
  // Returns the sessions attached when the drain began.
  int Drain(absl::Duration timeout, std::function<void()> on_drained);

  // The port --metrics_listen / --health_listen bound (for port 0), or 0 when off.
  int metrics_port() const;
  int health_port() const { return health_port_; }

  const DaemonConfig& config() const { return config_; }
  // Whether a pipeline thread has been stuck in one work item for --stall_timeout (liveness
  // NOT_SERVING, systemd watchdog pings stop).
  bool stalled() const { return stalled_; }
  // What the process should exit with: 1 once a GPU's CUDA context broke for good (the
  // daemon then requests a stop, so that systemd or Kubernetes restarts it), else 0.
  int exit_code() const { return exit_code_; }

 private:
  Daemon(DaemonConfig config, std::function<void(StopReason)> request_stop);

  DaemonConfig config_;
  const std::function<void(StopReason)> request_stop_;
  Clock clock_ = RealClock();
  std::atomic<bool> serving_{false};
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<DeviceBackend> devices_;  // null without CUDA support built in or injected
  bool pinned_ = false;
  // This daemon's measurements, recorded by its feeds and sessions and exported by metrics_.
  std::shared_ptr<metrics::Counters> counters_;
  // s3:// datasets' store and cache (--s3_endpoint); before sessions_: feeds hold its sources.
  std::unique_ptr<objstore::ObjectStore> object_store_;
  std::unique_ptr<SessionManager> sessions_;
  // The gRPC socket's listener (thread `accept`, peer credentials) and the services' view
  // of them.
  std::unique_ptr<PeerListener> listener_;
  std::unique_ptr<CallerResolver> callers_;
  std::unique_ptr<FeedService> feed_service_;
  std::unique_ptr<AdminService> admin_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MemServer> mem_server_;
  std::unique_ptr<TcpHealthService> tcp_health_;
  std::unique_ptr<grpc::Server> health_server_;  // TCP, grpc.health.v1 only
  int health_port_ = 0;
  std::unique_ptr<MetricsServer> metrics_;
  std::unique_ptr<SystemdNotifier> notifier_;
  std::thread drain_watcher_;
  std::thread readiness_monitor_;  // re-evaluates readiness every 250 ms
  // Notified by Shutdown: the drain watcher and the readiness monitor end at once, not after
  // their next sleep (a SIGTERM or drain ends the process sooner, so consumers re-attach
  // sooner).
  absl::Notification stop_threads_;
  absl::Mutex drain_mu_;  // orders Drain's watcher start against Shutdown's join
  bool stopping_ ABSL_GUARDED_BY(drain_mu_) = false;
  std::atomic<int> exit_code_{0};
  std::atomic<bool> stalled_{false};
  // Re-evaluates stalled_ from the pipeline threads' progress marks; logs changes.
  void CheckProgress();
  bool shut_down_ = false;

  void SetServing(bool serving);
  // Ready: serving, not draining, and no GPU context broken for good.
  bool Ready() const;
};

}  // namespace gpufeed::server
