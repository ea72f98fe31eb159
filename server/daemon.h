// gpufeedd as a library: one typed config, validated once, and the object that owns every
// part of the running daemon in start-up order (and destroys them in reverse).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace grpc {
class Server;
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

inline constexpr char kVersion[] = "0.1.0";

struct DaemonConfig {
  // "unix:///path" or "unix:path": the gRPC socket.
  std::string listen = "unix:///run/gpufeed/gpufeed.sock";
  // The memory socket; empty: beside the gRPC socket, "<name>.mem.sock".
  std::string mem_socket;
  uint64_t staging_bytes = uint64_t{1} << 30;
  uint64_t staging_slab_bytes = uint64_t{1} << 30;
  int threads = 0;  // 0: one per core
  int max_sessions = 256;
  int32_t default_ring_slots = 0;  // 0: auto (2..16 slots, up to 64 MiB a ring)
  absl::Duration attach_timeout = absl::Seconds(10);
  // Streams get this long to end at shutdown; the whole teardown, this plus 5 s, after which
  // main() exits regardless (a GPU stage that never returns must not keep a stopped daemon).
  absl::Duration shutdown_grace = absl::Seconds(2);
  // nvJPEG: the library ("" = the usual names) and interpolated chroma upsampling. Their
  // defaults come from $GPUFEED_NVJPEG_LIBRARY and $GPUFEED_NVJPEG_INTERPOLATION (0 = off),
  // read once by main(), so older deployments keep working.
  std::string nvjpeg_library;
  bool nvjpeg_interpolation = true;
  // Liveness from progress: stalled once one pipeline work item has run this long; zero: off.
  absl::Duration stall_timeout = absl::Seconds(60);
  std::string log_level = "info";
  // How readers copy samples from the page cache: "mmap" (memcpy from a mapping, guarded
  // against SIGBUS) or "pread". Both turn a shrunken file into DATA_LOSS.
  std::string read_mode = "mmap";
  // Device bytes all device rings on one GPU may hold together.
  uint64_t device_bytes = uint64_t{4} << 30;
  std::string log_format = "text";  // or "json"
  // TCP "host:port" for Prometheus' /metrics, and for grpc.health.v1 alone (Kubernetes'
  // gRPC probes cannot reach a Unix socket). Empty: off.
  std::string metrics_listen;
  std::string health_listen;
};

// Reads a gpufeed.v1.DaemonConfig (protobuf text format, or JSON when the file starts with
// '{') into `config`: the fields the file sets replace the defaults. NOT_FOUND for a missing
// file, INVALID_ARGUMENT naming the file, line and field otherwise.
absl::Status ApplyConfigFile(const std::string& path, DaemonConfig* config);

// INVALID_ARGUMENT naming the field. Fills derived fields (mem_socket, threads).
absl::Status ValidateConfig(DaemonConfig& config);

// The socket path of a "unix://" listen address.
absl::StatusOr<std::string> UnixPathOf(const std::string& listen);

class Daemon {
 public:
  // Binds both sockets and starts serving; fatal problems (socket in use, no memory) are
  // returned, naming what failed.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(DaemonConfig config);
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
  // daemon then stops itself so that systemd or Kubernetes restarts it), else 0.
  int exit_code() const { return exit_code_; }

 private:
  explicit Daemon(DaemonConfig config);

  DaemonConfig config_;
  std::atomic<bool> serving_{false};
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<DeviceBackend> devices_;  // null without CUDA support built in
  bool pinned_ = false;
  std::unique_ptr<SessionManager> sessions_;
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
  std::thread readiness_monitor_;  // re-evaluates readiness every second
  std::atomic<bool> stop_drain_watcher_{false};
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
