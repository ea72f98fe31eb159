// The Prometheus endpoint (--metrics_listen, /metrics): prometheus-cpp's exposer with one
// collector that reads the daemon's state at scrape time (sessions, feeds, staging and device
// memory, per-consumer stall) and its counters and stage histograms (common/metrics.h).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
}

namespace gpufeed::metrics {
class Counters;
}
namespace gpufeed::objstore {
class ObjectStore;
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
  // The per-consumer series' labels: job (the name), rank and uid (the owner's); false
  // (config metrics_job_labels' default): job is an opaque id per (uid, job), no uid.
  bool job_labels = false;
  // The daemon's decodes, delivered bytes and stage histograms (FeedLimits::counters).
  const metrics::Counters* counters = nullptr;
  // s3:// datasets' store and cache (--s3_endpoint); null: their families have no series.
  const objstore::ObjectStore* object_store = nullptr;
};

// The metrics HTTP server's bounds (docs/SECURITY.md section 4): civetweb worker threads,
// each serving one connection at a time, and how long a connection may take to send its
// request (or to read the reply) before it is closed. An idle or trickling client holds a
// worker for at most kMetricsRequestTimeoutMs.
inline constexpr int kMetricsHttpThreads = 16;
inline constexpr int kMetricsRequestTimeoutMs = 5000;

class MetricsServer {
 public:
  // Serves on `listen` ("host:port"); INVALID_ARGUMENT / UNAVAILABLE naming it.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              MetricsSources sources);
  ~MetricsServer();

  // The TCP port it listens on (the one bound when `listen` asked for port 0).
  int port() const;

 private:
  MetricsServer() = default;
  std::string host_;  // as given in `listen`, for the wake-up connections of ~MetricsServer
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<void> collector_;
};

}  // namespace gpufeed::server
