// An in-process gpufeedd (as tf.data's TestCluster): the real server::Daemon, started in the
// test process on sockets in a TempDir of its own, with the file system, the device backend
// and the clock injectable (server::DaemonDeps). Tests reach it as clients do: the C++ client
// library (`Attach`, `Admin`) or a gRPC channel of their own (`Channel`). In-process, every
// caller has the daemon's own uid, so it is an admin (docs/SECURITY.md section 1).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "gpufeed/client.h"
#include "grpcpp/channel.h"
#include "server/config.h"
#include "server/daemon.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::testing {

struct TestDaemonOptions {
  // server::DaemonDeps: null / empty mean gpufeedd's own (the POSIX file system, no GPUs
  // without CUDA, absl::Now).
  FileSystem* fs = nullptr;  // must outlive the daemon
  std::unique_ptr<server::DeviceBackend> devices;
  Clock clock = RealClock();
  // Changes TestDaemon::Config's settings before the daemon starts (validated again then).
  std::function<void(server::DaemonConfig&)> configure;
};

class TestDaemon {
 public:
  // A validated configuration for a daemon on sockets in `dir`: gpufeed.sock and
  // gpufeed.mem.sock, 64 MiB of staging, 2 fill threads, warnings only in the log.
  static server::DaemonConfig Config(const std::string& dir);

  // Starts a daemon on Config(its own temp dir), changed by options.configure; the error
  // ValidateConfig or Daemon::Start returned.
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(TestDaemonOptions options = {});
  // Starts a daemon on `config` as given (e.g. from LoadConfig): Daemon::Start's error.
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(server::DaemonConfig config,
                                                           TestDaemonOptions options);

  TestDaemon(const TestDaemon&) = delete;
  TestDaemon& operator=(const TestDaemon&) = delete;
  ~TestDaemon() { Stop(); }

  // The daemon's temp dir (datasets may be written here too) and sockets.
  const TempDir& dir() const { return dir_; }
  const std::string& socket_path() const { return socket_path_; }
  const std::string& mem_socket_path() const { return config_.mem_socket; }
  const server::DaemonConfig& config() const { return config_; }
  // Null after Stop().
  server::Daemon* daemon() const { return daemon_.get(); }

  // `options` with this daemon's socket, attached through the client library.
  absl::StatusOr<std::unique_ptr<client::Session>> Attach(client::AttachOptions options) const;
  absl::StatusOr<std::unique_ptr<client::AdminClient>> Admin() const;
  // A gRPC channel to the daemon's socket, for requests the client library never makes.
  std::shared_ptr<grpc::Channel> Channel() const;

  // The stop requests the daemon made (Daemon::Start's request_stop), in order.
  std::vector<server::Daemon::StopReason> stop_requests() const;
  // Whether the daemon requested a stop for `reason` within `timeout` (polled).
  bool WaitForStopRequest(server::Daemon::StopReason reason,
                          absl::Duration timeout = absl::Seconds(10)) const;

  // Shuts the daemon down in order and destroys it (its sockets go). Idempotent.
  void Stop();

 private:
  struct StopLog {
    mutable absl::Mutex mu;
    std::vector<server::Daemon::StopReason> reasons ABSL_GUARDED_BY(mu);
  };
  TestDaemon() = default;
  static absl::StatusOr<std::unique_ptr<TestDaemon>> Start(std::unique_ptr<TestDaemon> t,
                                                           server::DaemonConfig config,
                                                           TestDaemonOptions options);

  TempDir dir_;
  server::DaemonConfig config_;
  std::string socket_path_;
  const std::shared_ptr<StopLog> stops_ = std::make_shared<StopLog>();
  std::unique_ptr<server::Daemon> daemon_;
};

}  // namespace gpufeed::testing
