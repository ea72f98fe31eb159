// The node's object store (docs/howto/object-storage.md): one S3 client and one cache for every
// job and rank, and, per caller, a binding of that caller's own access through which its feed
// lists and reads objects.
//
// Who may read what: a caller's access (ObjectStoreAccess, passed by its client library on the
// memory socket) is bound once, at Attach (ObjectStore::Bind); every object the feed opens is
// first HEADed with that access, so an object already cached for another uid is served to
// this caller only after its own credentials succeed on that very version (the HEAD's ETag is
// the cache key's). The access lives in the binding, held by the feed's files: never logged,
// never written, gone with the feed.
//
// Where the daemon fetches from is the admin's (ObjectStoreOptions::s3.endpoint), never the
// caller's: a caller names the endpoint it means and Bind refuses another, so a hostile caller
// cannot make the daemon fetch from an address of its choosing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/os/file.h"
#include "server/objstore/object_cache.h"
#include "server/objstore/s3_client.h"
#include "server/objstore/s3_config.h"

namespace gpufeed::objstore {

// A caller's access, as the memory socket passed it (proto ObjectStoreAccess).
struct ObjectStoreAccess {
  S3Credentials credentials;  // empty with a web identity (exchanged at Bind) or anonymous
  std::string web_identity_token;
  std::string role_arn;
  std::string role_session_name;
  std::string region;    // the caller's; unused: requests are signed for the daemon's region
  std::string endpoint;  // what the caller means; must be the daemon's
  bool anonymous = false;
};

// The most objects one listing of a dataset's prefix may return.
inline constexpr size_t kMaxListedObjects = size_t{1} << 20;

// One object of a listing.
struct ObjectEntry {
  std::string key;
  uint64_t size = 0;
};

// What a dataset reader sees of the object store: listings and objects, read with one caller's
// access. The reader (server/reader/object_datasets.cc) knows nothing more of S3.
class ObjectSource {
 public:
  virtual ~ObjectSource() = default;
  // The objects whose keys start with `prefix` and hold no '/' after it (a directory's
  // entries), in key order; RESOURCE_EXHAUSTED past `max_entries` (at most
  // kMaxListedObjects). `poll` runs before each page of the listing (a deadline, shutdown).
  virtual absl::StatusOr<std::vector<ObjectEntry>> List(
      absl::string_view bucket, absl::string_view prefix,
      const std::function<absl::Status()>& poll = nullptr,
      size_t max_entries = kMaxListedObjects) const = 0;
  // The object, HEADed now with the caller's access (NOT_FOUND, PERMISSION_DENIED naming
  // s3://bucket/key); its reads are of that version only (FAILED_PRECONDITION once it
  // changed), through the node's cache.
  virtual absl::StatusOr<std::unique_ptr<RandomAccessFile>> Open(absl::string_view bucket,
                                                                 absl::string_view key) const = 0;
  // What the feed's key and fingerprint name this source by: the endpoint (not the caller).
  virtual std::string Identity() const = 0;
  // Whose access this is, for the feed's key only: a salted digest of the credentials (never
  // the credentials), "anonymous" for none.
  virtual std::string Principal() const = 0;
};

struct ObjectStoreOptions {
  S3Config s3;
  // STS for web identities: "" derives https://sts.REGION.amazonaws.com (AWS) or the endpoint.
  std::string sts_endpoint;
  // The cache: bytes 0 reads every block from the store (no cache).
  std::string cache_dir;
  uint64_t cache_bytes = 0;
  uint64_t cache_block_bytes = 8 << 20;
};

class ObjectStore {
 public:
  // INVALID_ARGUMENT naming the option (s3.endpoint, cache_dir, ...).
  static absl::StatusOr<std::unique_ptr<ObjectStore>> Create(ObjectStoreOptions options);
  ~ObjectStore();

  // The caller's source: INVALID_ARGUMENT when its endpoint is not this daemon's (naming both)
  // or a credential field holds a byte outside printable ASCII or is too long; a web identity
  // exchanged for temporary credentials here (PERMISSION_DENIED naming the role when STS
  // refuses it). Requests are signed for the daemon's region (--s3_region): one client, one
  // bound on connections, whatever the callers' AWS_REGION.
  absl::StatusOr<std::shared_ptr<const ObjectSource>> Bind(const ObjectStoreAccess& access);

  const S3Counters& counters() const;
  // Null without a cache (cache_bytes 0).
  const ObjectCache* cache() const { return cache_.get(); }
  const ObjectStoreOptions& options() const { return options_; }

 private:
  class Source;
  class File;
  ObjectStore(ObjectStoreOptions options, std::unique_ptr<S3Client> client,
              std::unique_ptr<ObjectCache> cache);

  const ObjectStoreOptions options_;
  std::string salt_;  // PrincipalOf's, random per daemon
  std::unique_ptr<S3Client> client_;
  // Last: destroyed first, its running read-ahead fetches finishing while the client lives.
  std::unique_ptr<ObjectCache> cache_;
};

// "s3://bucket/rest" -> {bucket, rest}; INVALID_ARGUMENT naming `field` for anything else
// (no bucket, a bucket name S3 would refuse).
struct S3Path {
  std::string bucket;
  std::string key;  // may be "" (the bucket's root) or end in "/" (a prefix)
};
absl::StatusOr<S3Path> ParseS3Path(absl::string_view path, absl::string_view field);

}  // namespace gpufeed::objstore
