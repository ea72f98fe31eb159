// An S3 client's measurements, which the daemon's metrics endpoint will export (issue #36:
// remote bytes, GET latency, retries). Plain atomics, as common/metrics.h: no dependency on
// Prometheus here, and recording costs a few relaxed adds.
#pragma once

#include <atomic>
#include <cstdint>

#include "common/metrics.h"

namespace gpufeed::objstore {

// Why an attempt failed. One count per failed attempt, retried or not, so that a store that
// throttles shows up even when every call succeeds in the end.
enum class S3ErrorKind {
  kConnect,    // no connection, reset, TLS handshake, DNS
  kTimeout,    // connect or request timeout
  kTruncated,  // the body ended before its Content-Length, or a range came back short
  kThrottled,  // 429, 503 (S3's SlowDown)
  kServer,     // other 5xx
  kClient,     // 4xx other than 429: not found, denied, bad request, precondition
  kOther,      // anything else: an unexpected status, a malformed response
};
inline constexpr int kNumS3ErrorKinds = 7;
inline constexpr const char* kS3ErrorKindNames[kNumS3ErrorKinds] = {
    "connect", "timeout", "truncated", "throttled", "server", "client", "other"};

class S3Counters {
 public:
  // HTTP requests sent (every attempt), and those that were retries of a failed one.
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> retries{0};
  // Body bytes received from the store by successful and failed attempts alike: what crossed
  // the network.
  std::atomic<uint64_t> bytes_received{0};
  // Calls (Head, GetRange, List pages) that returned an error after all their attempts.
  std::atomic<uint64_t> failed_calls{0};
  // Seconds per successful ranged GET attempt, from its start to the last byte of its body
  // (the failed ones are counted in errors()).
  metrics::StageHistogram get_latency;

  std::atomic<uint64_t>& errors(S3ErrorKind kind) { return errors_[static_cast<int>(kind)]; }
  uint64_t errors(S3ErrorKind kind) const {
    return errors_[static_cast<int>(kind)].load(std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> errors_[kNumS3ErrorKinds]{};
};

}  // namespace gpufeed::objstore
