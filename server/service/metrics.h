// The Prometheus endpoint (--metrics_listen, /metrics): prometheus-cpp's exposer with one
// collector that reads the daemon's state at scrape time (sessions, feeds, staging and device
// memory, per-consumer stall) and the stage histograms of common/metrics.h.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
}

namespace gpufeed::server {

class SessionManager;
class StagingPool;
class DeviceBackend;

struct MetricsSources {
  std::string version;
  bool cuda = false;
  const SessionManager* sessions = nullptr;
  const StagingPool* pool = nullptr;
  const DeviceBackend* devices = nullptr;  // may be null
};

class MetricsServer {
 public:
  // Serves on `listen` ("host:port"); INVALID_ARGUMENT / UNAVAILABLE naming it.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              MetricsSources sources);
  ~MetricsServer();

  // The TCP port it listens on (the one bound when `listen` asked for port 0).
  int port() const;

  // The text a scrape returns (for tests and gpufeedctl).
  static std::string Render(const MetricsSources& sources);

 private:
  MetricsServer() = default;
  std::string host_;  // as given in `listen`, for the wake-up connections of ~MetricsServer
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<void> collector_;
};

}  // namespace gpufeed::server
