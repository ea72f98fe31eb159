#include "tests/testing/test_daemon.h"

#include <utility>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "spdlog/common.h"
#include "tests/testing/eventually.h"

namespace gpufeed::testing {

server::DaemonConfig TestDaemon::Config(const std::string& dir) {
  server::DaemonConfig c;
  c.listen = "unix://" + dir + "/gpufeed.sock";
  c.mem_socket = dir + "/gpufeed.mem.sock";
  c.staging_bytes = uint64_t{64} << 20;
  c.staging_slab_bytes = uint64_t{64} << 20;
  c.threads = 2;
  c.attach_threads = 2;
  c.shutdown_grace = absl::Seconds(1);
  c.log_level = spdlog::level::warn;
  return c;
}

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(TestDaemonOptions options) {
  // The temp dir is the daemon's: made first, so the config can name it.
  std::unique_ptr<TestDaemon> t(new TestDaemon());
  server::DaemonConfig config = Config(t->dir_.path());
  if (options.configure) options.configure(config);
  absl::Status valid = server::ValidateConfig(config);
  if (!valid.ok()) return valid;
  return Start(std::move(t), std::move(config), std::move(options));
}

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(server::DaemonConfig config,
                                                              TestDaemonOptions options) {
  return Start(std::unique_ptr<TestDaemon>(new TestDaemon()), std::move(config),
               std::move(options));
}

absl::StatusOr<std::unique_ptr<TestDaemon>> TestDaemon::Start(std::unique_ptr<TestDaemon> t,
                                                              server::DaemonConfig config,
                                                              TestDaemonOptions options) {
  absl::StatusOr<std::string> socket = server::UnixPathOf(config.listen);
  if (!socket.ok()) return socket.status();
  t->socket_path_ = *socket;
  t->config_ = config;
  server::DaemonDeps deps;
  deps.fs = options.fs;
  deps.devices = std::move(options.devices);
  deps.clock = std::move(options.clock);
  std::shared_ptr<StopLog> stops = t->stops_;
  absl::StatusOr<std::unique_ptr<server::Daemon>> daemon = server::Daemon::Start(
      std::move(config),
      [stops](server::Daemon::StopReason reason) {
        absl::MutexLock lock(&stops->mu);
        stops->reasons.push_back(reason);
      },
      std::move(deps));
  if (!daemon.ok()) return daemon.status();
  t->daemon_ = *std::move(daemon);
  return t;
}

absl::StatusOr<std::unique_ptr<client::Session>> TestDaemon::Attach(
    client::AttachOptions options) const {
  options.socket = socket_path_;
  return client::Session::Attach(options);
}

absl::StatusOr<std::unique_ptr<client::AdminClient>> TestDaemon::Admin() const {
  return client::AdminClient::Connect(socket_path_);
}

std::shared_ptr<grpc::Channel> TestDaemon::Channel() const {
  return grpc::CreateChannel("unix://" + socket_path_, grpc::InsecureChannelCredentials());
}

std::vector<server::Daemon::StopReason> TestDaemon::stop_requests() const {
  absl::MutexLock lock(&stops_->mu);
  return stops_->reasons;
}

bool TestDaemon::WaitForStopRequest(server::Daemon::StopReason reason,
                                    absl::Duration timeout) const {
  return Eventually(
      [&] {
        for (server::Daemon::StopReason r : stop_requests()) {
          if (r == reason) return true;
        }
        return false;
      },
      timeout);
}

void TestDaemon::Stop() {
  if (daemon_ == nullptr) return;
  daemon_->Shutdown();
  daemon_.reset();
}

}  // namespace gpufeed::testing
