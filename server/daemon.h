// gpufeedd as a library: one typed config, validated once, and the object that owns every
// part of the running daemon in start-up order (and destroys them in reverse).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
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
  absl::Duration shutdown_grace = absl::Seconds(2);
  std::string log_level = "info";
  // How readers copy samples from the page cache: "mmap" (memcpy from a mapping, guarded
  // against SIGBUS) or "pread". Both turn a shrunken file into DATA_LOSS.
  std::string read_mode = "mmap";
  // Device bytes all device rings on one GPU may hold together.
  uint64_t device_bytes = uint64_t{4} << 30;
};

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

  const DaemonConfig& config() const { return config_; }

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
  bool shut_down_ = false;
};

}  // namespace gpufeed::server
