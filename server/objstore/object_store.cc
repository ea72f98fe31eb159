#include "server/objstore/object_store.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/objstore/s3_uri.h"

namespace gpufeed::objstore {
namespace {

// At most this many regions' clients (each keeps its own connections).
constexpr size_t kMaxRegions = 32;

bool ValidRegion(absl::string_view r) {
  if (r.empty() || r.size() > 32) return false;
  for (char c : r) {
    if (!absl::ascii_islower(c) && !absl::ascii_isdigit(c) && c != '-') return false;
  }
  return true;
}

// S3's bucket naming rules, the part that keeps a name out of a URL's structure: 3 to 63
// bytes of lower-case letters, digits, '.', '-' (and '_' for older buckets and other stores),
// starting and ending with a letter or digit.
bool ValidBucket(absl::string_view b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!absl::ascii_islower(c) && !absl::ascii_isdigit(c) && c != '.' && c != '-' && c != '_') {
      return false;
    }
  }
  return absl::ascii_isalnum(b.front()) && absl::ascii_isalnum(b.back());
}

}  // namespace

absl::StatusOr<S3Path> ParseS3Path(absl::string_view path, absl::string_view field) {
  if (!absl::StartsWith(path, "s3://")) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " is no s3:// path"));
  }
  absl::string_view rest = path.substr(5);
  const size_t slash = rest.find('/');
  S3Path out;
  out.bucket = std::string(rest.substr(0, slash));
  out.key = slash == absl::string_view::npos ? "" : std::string(rest.substr(slash + 1));
  if (!ValidBucket(out.bucket)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path, ": '", out.bucket,
                     "' is no bucket name (3 to 63 lower-case letters, digits, '.', '-' or '_')"));
  }
  if (out.key.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path.substr(0, 80), "...: a key is at most 1024 bytes"));
  }
  return out;
}

// One object of one caller: its version (size, ETag) as the caller's HEAD saw it.
class ObjectStore::File : public RandomAccessFile {
 public:
  File(std::shared_ptr<const Source> source, S3Client* client, std::string bucket, std::string key,
       S3ObjectInfo info)
      : source_(std::move(source)),
        client_(client),
        bucket_(std::move(bucket)),
        key_(std::move(key)),
        info_(std::move(info)),
        path_(S3Url(bucket_, key_)) {}

  uint64_t size() const override { return info_.size; }
  absl::Status ReadAt(uint64_t offset, std::span<std::byte> dst) const override;
  const std::string& path() const override { return path_; }
  int64_t modified_ns() const override {
    return info_.last_modified == absl::InfinitePast() ? 0 : absl::ToUnixNanos(info_.last_modified);
  }

 private:
  // Keeps the caller's access (and so its credentials) alive while the feed reads.
  const std::shared_ptr<const Source> source_;
  S3Client* const client_;
  const std::string bucket_, key_;
  const S3ObjectInfo info_;
  const std::string path_;
};

class ObjectStore::Source : public ObjectSource,
                            public std::enable_shared_from_this<ObjectStore::Source> {
 public:
  Source(ObjectStore* store, S3Client* client, S3Credentials credentials)
      : store_(store), client_(client), credentials_(std::move(credentials)) {}

  absl::StatusOr<std::vector<ObjectEntry>> List(absl::string_view bucket,
                                                absl::string_view prefix) const override {
    S3ListOptions options;
    options.delimiter = "/";
    options.max_keys = kMaxListedObjects;
    GPUFEED_ASSIGN_OR_RETURN(std::vector<S3ListEntry> listed,
                             client_->List(credentials_, bucket, prefix, options));
    std::vector<ObjectEntry> out;
    out.reserve(listed.size());
    for (S3ListEntry& e : listed) out.push_back({std::move(e.key), e.size});
    return out;
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> Open(absl::string_view bucket,
                                                         absl::string_view key) const override {
    GPUFEED_ASSIGN_OR_RETURN(S3ObjectInfo info, client_->Head(credentials_, bucket, key));
    return std::make_unique<File>(shared_from_this(), client_, std::string(bucket),
                                  std::string(key), std::move(info));
  }

  std::string Identity() const override {
    const S3Config& c = client_->config();
    return absl::StrCat("s3 ", c.endpoint.empty() ? "aws" : c.endpoint, " ", c.region);
  }

  const S3Credentials& credentials() const { return credentials_; }
  ObjectStore* store() const { return store_; }

 private:
  ObjectStore* const store_;
  S3Client* const client_;
  const S3Credentials credentials_;
};

absl::Status ObjectStore::File::ReadAt(uint64_t offset, std::span<std::byte> dst) const {
  if (offset > info_.size || dst.size() > info_.size - offset) {
    return absl::DataLossError(absl::StrCat(path_, ": a read of ", dst.size(), " bytes at ", offset,
                                            " runs past its ", info_.size, " bytes"));
  }
  ObjectCache* cache = source_->store()->cache_.get();
  if (cache == nullptr) {
    return client_->GetRange(source_->credentials(), bucket_, key_, offset, dst, info_.etag);
  }
  // The cache's key is this version (its ETag, as this caller's own HEAD saw it): a block
  // another caller fetched is served only to a caller whose HEAD found the same version.
  // The fetch may run after this read returns (read-ahead): it holds the source (the caller's
  // access) by a shared pointer.
  ObjectId id{client_->config().endpoint, bucket_, key_, info_.etag};
  return cache->Read(id, info_.size, offset, dst,
                     [source = source_, client = client_, bucket = bucket_, key = key_,
                      etag = info_.etag](uint64_t at, std::span<std::byte> out) {
                       return client->GetRange(source->credentials(), bucket, key, at, out, etag);
                     });
}

absl::StatusOr<std::unique_ptr<ObjectStore>> ObjectStore::Create(ObjectStoreOptions options) {
  GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> client, S3Client::Create(options.s3));
  std::unique_ptr<ObjectCache> cache;
  if (options.cache_bytes != 0) {
    ObjectCacheOptions o;
    o.dir = options.cache_dir;
    o.capacity_bytes = options.cache_bytes;
    o.block_bytes = options.cache_block_bytes;
    GPUFEED_ASSIGN_OR_RETURN(cache, ObjectCache::Create(std::move(o)));
  }
  return std::unique_ptr<ObjectStore>(
      new ObjectStore(std::move(options), std::move(client), std::move(cache)));
}

ObjectStore::ObjectStore(ObjectStoreOptions options, std::unique_ptr<S3Client> client,
                         std::unique_ptr<ObjectCache> cache)
    : options_(std::move(options)), client_(std::move(client)), cache_(std::move(cache)) {}

ObjectStore::~ObjectStore() = default;

const S3Counters& ObjectStore::counters() const { return client_->counters(); }

std::vector<std::pair<std::string, const S3Counters*>> ObjectStore::CountersByRegion() const {
  std::vector<std::pair<std::string, const S3Counters*>> out = {
      {client_->config().region, &client_->counters()}};
  absl::MutexLock lock(&mu_);
  for (const auto& c : regional_) out.emplace_back(c->config().region, &c->counters());
  return out;
}

absl::StatusOr<S3Client*> ObjectStore::ClientFor(const std::string& region) {
  if (region.empty() || region == options_.s3.region) return client_.get();
  absl::MutexLock lock(&mu_);
  for (const auto& c : regional_) {
    if (c->config().region == region) return c.get();
  }
  if (regional_.size() >= kMaxRegions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("object_store.region: gpufeedd already talks to ", kMaxRegions, " regions"));
  }
  S3Config config = options_.s3;
  config.region = region;
  GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> c, S3Client::Create(std::move(config)));
  regional_.push_back(std::move(c));
  return regional_.back().get();
}

absl::StatusOr<std::shared_ptr<const ObjectSource>> ObjectStore::Bind(
    const ObjectStoreAccess& access) {
  const std::string& mine = options_.s3.endpoint;
  if (access.endpoint != mine) {
    return absl::InvalidArgumentError(absl::StrCat(
        "object_store.endpoint: the caller means ",
        access.endpoint.empty() ? std::string("AWS S3") : access.endpoint,
        " but gpufeedd reads objects from ", mine.empty() ? std::string("AWS S3") : mine,
        " only (its --s3_endpoint): set AWS_ENDPOINT_URL_S3 to that, or ask the node's admin"));
  }
  if (!access.region.empty() && !ValidRegion(access.region)) {
    return absl::InvalidArgumentError(
        "object_store.region: lower-case letters, digits and '-', at most 32");
  }
  GPUFEED_ASSIGN_OR_RETURN(S3Client * client, ClientFor(access.region));
  S3Credentials credentials = access.credentials;
  if (access.anonymous) {
    credentials = S3Credentials();
  } else if (!access.web_identity_token.empty()) {
    std::string sts = options_.sts_endpoint;
    if (sts.empty()) {
      sts = mine.empty() ? absl::StrCat("https://sts.", client->config().region, ".amazonaws.com")
                         : mine;
    }
    absl::StatusOr<StsCredentials> temporary = client->AssumeRoleWithWebIdentity(
        sts, access.role_arn, access.web_identity_token,
        access.role_session_name.empty() ? "gpufeed" : access.role_session_name, absl::Hours(1));
    if (!temporary.ok()) {
      return absl::Status(
          temporary.status().code(),
          absl::StrCat("object_store: assuming role ", access.role_arn,
                       " with the caller's web identity: ", temporary.status().message()));
    }
    credentials.access_key_id = temporary->access_key_id;
    credentials.secret_access_key = temporary->secret_access_key;
    credentials.session_token = temporary->session_token;
  } else if (credentials.anonymous()) {
    return absl::InvalidArgumentError(
        "object_store: no credentials came (set anonymous for a public bucket)");
  }
  return std::shared_ptr<const ObjectSource>(
      std::make_shared<Source>(this, client, std::move(credentials)));
}

}  // namespace gpufeed::objstore
