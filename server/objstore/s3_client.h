// An S3 client for the reader (issue #36): HEAD, ranged GET and ListObjectsV2 against AWS or
// an S3-compatible store (MinIO, Ceph RGW, GCS's XML API), plus STS's
// AssumeRoleWithWebIdentity for web-identity credentials.
//
// Design notes.
//
// Why libcurl and not the AWS SDK for C++ (or its CRT): neither is packaged by Debian 12 or
// Ubuntu 24.04, and building either pulls in tens of thousands of lines for the three calls a
// reader makes. libcurl is in both distributions (libcurl4-openssl-dev), is already on every
// node, and speaks HTTP/1.1 keep-alive and TLS as well as anything.
//
// Why libcurl's own SigV4 (CURLOPT_AWS_SIGV4): signing stays in a library audited and used at
// large, and we write no HMAC code. What it leaves to us, read from curl 7.88's
// lib/http_aws_sigv4.c and checked against moto with signatures enforced:
//   - it signs the URL's path and query exactly as given (7.88 neither encodes nor sorts;
//     8.x sorts the query), so we build them canonical (s3_uri.h);
//   - it signs x-amz-content-sha256 only when we send one, and S3 refuses a request without
//     it (7.88 adds none; 8.x adds one for service s3), so every request carries the hash of
//     its (empty) payload;
//   - it signs every header we add (Range, If-Match, x-amz-security-token), which S3 accepts.
// The key id and secret go in CURLOPT_USERNAME / CURLOPT_PASSWORD, not CURLOPT_USERPWD, so a
// secret holding ':' is not split.
//
// Retries: every call makes at most max_attempts attempts, waiting a full-jitter exponential
// backoff between them (S3Config). Retried: connection failures, timeouts, 5xx, 429, 503
// SlowDown, 400 RequestTimeout and bodies that end early. Not retried: the other 4xx (a
// missing key, a denied or malformed request, a changed object), which no retry can change. A
// ranged GET that broke off resumes where it stopped, under If-Match on the ETag of the first
// response, so that the bytes of two versions of an object are never joined. A final failure
// names the object, the HTTP status with S3's error Code and Message, and the attempts:
//   NOT_FOUND: s3://b/k: 404 NoSuchKey (The specified key does not exist.) after 1 attempt
// with the canonical code that fits: 404 NOT_FOUND, 403 PERMISSION_DENIED, 412
// FAILED_PRECONDITION, 416 OUT_OF_RANGE, 5xx and 429 UNAVAILABLE, a timeout DEADLINE_EXCEEDED.
//
// Connections: at most max_connections requests are in flight; each runs on a curl easy
// handle from a pool, which keeps its connection open for the next request (HTTP keep-alive),
// so a steady reader pays no TCP or TLS handshake per GET. A caller beyond the limit waits for a
// handle; the backoff between attempts holds none.
//
// Credentials are a caller's and passed to every call: one client (one pool) serves every
// session of the daemon, each with its own keys. They are never stored or logged here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/objstore/s3_config.h"
#include "server/objstore/s3_metrics.h"
#include "server/objstore/s3_xml.h"

namespace gpufeed::objstore {

class CurlHandlePool;

struct S3ObjectInfo {
  uint64_t size = 0;
  std::string etag;  // as the store sends it, quotes included: what If-Match wants back
  absl::Time last_modified = absl::InfinitePast();  // InfinitePast where the store sent none
};

struct S3ListOptions {
  // Keys per ListObjectsV2 page, 1 to 1000 (S3's most). Smaller pages only in tests.
  int page_size = 1000;
  // "/": only the keys directly under the prefix (S3 rolls deeper ones into common prefixes,
  // which are not returned); "": every key under it.
  std::string delimiter;
  // More keys than this is RESOURCE_EXHAUSTED naming the prefix (a caller cannot make the
  // daemon page through a bucket of billions); 0: no bound. With a delimiter, pages of only
  // common prefixes count too: more pages than max_keys / page_size + 2 is the same error.
  size_t max_keys = 0;
  // Called before each page: its error (a deadline passed, shutdown) ends the listing.
  std::function<absl::Status()> poll;
};

class S3Client {
 public:
  // INVALID_ARGUMENT naming the field for a bad config (ValidateS3Config).
  static absl::StatusOr<std::unique_ptr<S3Client>> Create(S3Config config);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  // Every call is thread-safe.

  // The object's size, ETag and modification time.
  absl::StatusOr<S3ObjectInfo> Head(const S3Credentials& credentials, absl::string_view bucket,
                                    absl::string_view key);

  // Bytes [offset, offset + out.size()) of the object, into `out`, exactly: a body that ends
  // early is retried (from where it stopped), one that is longer than asked is an error. A
  // non-empty `if_match_etag` (an ETag from Head or List) makes the read fail with
  // FAILED_PRECONDITION, naming the object, once the object is no longer that version.
  // OUT_OF_RANGE where the range runs past the object's end. An empty `out` reads nothing.
  absl::Status GetRange(const S3Credentials& credentials, absl::string_view bucket,
                        absl::string_view key, uint64_t offset, std::span<std::byte> out,
                        const std::string& if_match_etag = "");

  // Every object whose key starts with `prefix`, in the store's order (UTF-8 binary order on
  // S3), with sizes and ETags; pages through ListObjectsV2's continuation tokens.
  absl::StatusOr<std::vector<S3ListEntry>> List(const S3Credentials& credentials,
                                                absl::string_view bucket,
                                                absl::string_view prefix,
                                                const S3ListOptions& options = {});

  // Temporary credentials for `role_arn` in exchange for a web-identity token (a Kubernetes
  // service account's, an OIDC provider's): STS's AssumeRoleWithWebIdentity, an unsigned POST
  // to `sts_endpoint` ("https://sts.amazonaws.com", a regional one, or a test's).
  absl::StatusOr<StsCredentials> AssumeRoleWithWebIdentity(absl::string_view sts_endpoint,
                                                           absl::string_view role_arn,
                                                           absl::string_view web_identity_token,
                                                           absl::string_view session_name,
                                                           absl::Duration duration);

  const S3Counters& counters() const { return counters_; }
  const S3Config& config() const { return config_; }

 private:
  S3Client(S3Config config, std::unique_ptr<CurlHandlePool> pool);

  S3Config config_;
  std::unique_ptr<CurlHandlePool> pool_;
  S3Counters counters_;
};

}  // namespace gpufeed::objstore
