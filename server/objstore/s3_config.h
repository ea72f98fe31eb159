// Where an S3-compatible store is and how to talk to it (S3Config), and whose keys sign the
// requests (S3Credentials). The config is the daemon's, validated once at start-up; the
// credentials are a caller's, handed in per request (issue #36: a session's keys are its own,
// never stored by the client and never logged).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gpufeed::objstore {

struct S3Config {
  // "" for AWS itself (https://s3.REGION.amazonaws.com); else the base URL of an S3-compatible
  // store, http or https, with an optional port and no path: MinIO "http://10.0.0.5:9000",
  // Ceph RGW, GCS's XML API "https://storage.googleapis.com", a test's moto.
  std::string endpoint;
  // The region the signatures are scoped to. MinIO and moto accept us-east-1; GCS's XML API
  // wants "auto".
  std::string region = "us-east-1";
  // Path-style URLs (ENDPOINT/BUCKET/KEY) rather than virtual-host ones
  // (BUCKET.s3.REGION.amazonaws.com/KEY). Stores behind an endpoint override mostly serve only
  // path-style, so it is forced on there; AWS takes virtual-host, and a bucket with a dot
  // goes path-style there too (its name would break the wildcard TLS certificate).
  bool path_style = false;
  // Per attempt: establishing a connection, and the whole exchange (headers and body).
  absl::Duration connect_timeout = absl::Seconds(5);
  absl::Duration request_timeout = absl::Seconds(60);
  // Requests in flight at once, each on its own connection (kept open between requests):
  // every call beyond waits for a free one.
  int max_connections = 16;
  // Attempts per call, the first included; and the backoff between them: retry n (from 1)
  // first waits a uniform random time in [0, min(backoff_max, backoff_base * 2^(n-1))] ("full
  // jitter", so that many readers that failed together do not retry together).
  int max_attempts = 5;
  absl::Duration backoff_base = absl::Milliseconds(100);
  absl::Duration backoff_max = absl::Seconds(5);
  // Verify the server's TLS certificate (https). Off only for a test store with a self-signed
  // certificate.
  bool verify_tls = true;
};

// The config's problems, each naming its field (s3.endpoint, s3.max_attempts, ...).
absl::Status ValidateS3Config(const S3Config& config);

// A caller's keys. Empty access_key_id: anonymous requests (a public bucket), unsigned.
// No operator<< and no AbslStringify on purpose: a credential must never reach a log line by
// accident. DebugString() shows the key id (not a secret, it names the key in AWS's own logs)
// and redacts the rest.
struct S3Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // temporary credentials (STS) only

  bool anonymous() const { return access_key_id.empty(); }
  std::string DebugString() const;
};

}  // namespace gpufeed::objstore
