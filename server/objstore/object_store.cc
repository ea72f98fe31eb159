#include "server/objstore/object_store.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <sys/random.h>

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/objstore/s3_uri.h"

namespace gpufeed::objstore {
namespace {

// A credential field the daemon puts into a header or a form: printable ASCII only (a CR or
// LF would add headers, or a request, on a connection other tenants' requests use next), and
// bounded (AWS's own: key ids of 16 to 128 bytes, session tokens of a few KiB, web identity
// tokens of up to 20,000 bytes, role session names of 2 to 64).
absl::Status CheckField(absl::string_view field, absl::string_view value, size_t max_bytes) {
  if (value.size() > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("object_store.", field, ": longer than ", max_bytes, " bytes"));
  }
  for (char c : value) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(
          "object_store.", field, ": a byte outside printable ASCII (no spaces or controls)"));
    }
  }
  return absl::OkStatus();
}

// The caller's credentials as one salted SHA-256 (32 hex digits): feeds are shared only by
// callers presenting the very same credentials (a key pair with its token, or a web identity
// token with its role), so a caller's attach never rides on another's access; the salt, the
// daemon's own random bytes, keeps the digest from being tested against guessed secrets
// (it may be shown, as part of a feed's key).
std::string PrincipalOf(const ObjectStoreAccess& a, const std::string& salt) {
  if (a.anonymous) return "anonymous";
  std::string material = salt;
  for (const std::string* f : {&a.credentials.access_key_id, &a.credentials.secret_access_key,
                               &a.credentials.session_token, &a.web_identity_token, &a.role_arn}) {
    absl::StrAppend(&material, f->size(), ":", *f, ";");
  }
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(material.data()), material.size(), digest);
  OPENSSL_cleanse(material.data(), material.size());
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), 16));
}

// "http://host:9000/" and "http://host:9000" are one endpoint.
std::string NormalEndpoint(absl::string_view e) {
  while (absl::EndsWith(e, "/")) e.remove_suffix(1);
  return std::string(e);
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
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", EscapeForLog(path, 200), " is no s3:// path"));
  }
  absl::string_view rest = path.substr(5);
  const size_t slash = rest.find('/');
  S3Path out;
  out.bucket = std::string(rest.substr(0, slash));
  out.key = slash == absl::string_view::npos ? "" : std::string(rest.substr(slash + 1));
  if (!ValidBucket(out.bucket)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", EscapeForLog(path, 200), ": '", EscapeForLog(out.bucket, 80),
                     "' is no bucket name (3 to 63 lower-case letters, digits, '.', '-' or '_')"));
  }
  if (out.key.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", EscapeForLog(path, 80), "...: a key is at most 1024 bytes"));
  }
  // Sent as they are (CURLOPT_PATH_AS_IS), "." and ".." segments could be resolved by the
  // store (or a proxy) to another key than the one signed and named: refused.
  for (absl::string_view segment : absl::StrSplit(out.key, '/')) {
    if (segment == "." || segment == "..") {
      return absl::InvalidArgumentError(absl::StrCat(field, ": ", EscapeForLog(path, 200),
                                                     ": a key with a '", segment, "' segment"));
    }
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
  // The feed's order (its permutation): each block of the range hinted for eviction by
  // farthest next use, and fetched ahead unless resident.
  void WillRead(uint64_t offset, uint64_t length, uint64_t next_use) const override;
  bool takes_read_hints() const override;
  std::string version() const override { return info_.etag; }
  int64_t modified_ns() const override {
    return info_.last_modified == absl::InfinitePast() ? 0 : absl::ToUnixNanos(info_.last_modified);
  }

 private:
  ObjectId Id() const;
  BlockFetch Fetch() const;
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
  Source(ObjectStore* store, S3Client* client, S3Credentials credentials, std::string principal)
      : store_(store),
        client_(client),
        credentials_(std::move(credentials)),
        principal_(std::move(principal)) {}

  absl::StatusOr<std::vector<ObjectEntry>> List(absl::string_view bucket, absl::string_view prefix,
                                                const std::function<absl::Status()>& poll,
                                                size_t max_entries) const override {
    S3ListOptions options;
    options.delimiter = "/";
    options.max_keys = std::min(max_entries, kMaxListedObjects);
    options.page_size = static_cast<int>(std::min<size_t>(1000, options.max_keys + 1));
    options.poll = poll;
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
    // The ETag is the version every read insists on (If-Match) and the cache's key: without a
    // strong one, two versions could not be told apart.
    if (info.etag.empty() || absl::StartsWith(info.etag, "W/")) {
      return absl::FailedPreconditionError(absl::StrCat(
          S3Url(bucket, key), ": the store gave ",
          info.etag.empty() ? std::string("no ETag")
                            : absl::StrCat("a weak ETag (", EscapeForLog(info.etag, 80), ")"),
          ": its versions could not be told apart, so it is not read"));
    }
    return std::make_unique<File>(shared_from_this(), client_, std::string(bucket),
                                  std::string(key), std::move(info));
  }

  std::string Identity() const override {
    const S3Config& c = client_->config();
    return absl::StrCat("s3 ", c.endpoint.empty() ? "aws" : c.endpoint, " ", c.region);
  }
  std::string Principal() const override { return principal_; }

  const S3Credentials& credentials() const { return credentials_; }
  ObjectStore* store() const { return store_; }

 private:
  ObjectStore* const store_;
  S3Client* const client_;
  const S3Credentials credentials_;
  const std::string principal_;
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
  return cache->Read(Id(), info_.size, offset, dst, Fetch());
}

// The cache's key is this version (its ETag, as this caller's own HEAD saw it): a block
// another caller fetched is served only to a caller whose HEAD found the same version.
ObjectId ObjectStore::File::Id() const {
  return ObjectId{client_->config().endpoint, bucket_, key_, info_.etag};
}

// The fetch may run after the read that made it returns (read-ahead, prefetch): it holds the
// source (the caller's access) by a shared pointer.
BlockFetch ObjectStore::File::Fetch() const {
  return [source = source_, client = client_, bucket = bucket_, key = key_, etag = info_.etag](
             uint64_t at, std::span<std::byte> out) {
    return client->GetRange(source->credentials(), bucket, key, at, out, etag);
  };
}

bool ObjectStore::File::takes_read_hints() const { return source_->store()->cache_ != nullptr; }

void ObjectStore::File::WillRead(uint64_t offset, uint64_t length, uint64_t next_use) const {
  ObjectCache* cache = source_->store()->cache_.get();
  if (cache == nullptr || length == 0 || offset >= info_.size) return;
  const uint64_t block = cache->block_bytes();
  const uint64_t last = std::min(offset + length, info_.size) - 1;
  const ObjectId id = Id();
  for (uint64_t b = offset / block; b <= last / block; ++b) {
    cache->Hint(id, b, next_use);
    cache->Prefetch(id, info_.size, b, Fetch());
  }
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
    : options_(std::move(options)), client_(std::move(client)), cache_(std::move(cache)) {
  salt_.resize(32);
  for (size_t got = 0; got < salt_.size();) {
    const ssize_t n = ::getrandom(salt_.data() + got, salt_.size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
}

ObjectStore::~ObjectStore() = default;

const S3Counters& ObjectStore::counters() const { return client_->counters(); }

absl::StatusOr<std::shared_ptr<const ObjectSource>> ObjectStore::Bind(
    const ObjectStoreAccess& access) {
  const std::string mine = NormalEndpoint(options_.s3.endpoint);
  if (NormalEndpoint(access.endpoint) != mine) {
    return absl::InvalidArgumentError(absl::StrCat(
        "object_store.endpoint: the caller means ",
        access.endpoint.empty() ? std::string("AWS S3") : EscapeForLog(access.endpoint, 200),
        " but gpufeedd reads objects from ", mine.empty() ? std::string("AWS S3") : mine,
        " only (its --s3_endpoint): set AWS_ENDPOINT_URL_S3 to that, or ask the node's admin"));
  }
  GPUFEED_RETURN_IF_ERROR(CheckField("access_key_id", access.credentials.access_key_id, 128));
  GPUFEED_RETURN_IF_ERROR(
      CheckField("secret_access_key", access.credentials.secret_access_key, 256));
  GPUFEED_RETURN_IF_ERROR(CheckField("session_token", access.credentials.session_token, 16384));
  GPUFEED_RETURN_IF_ERROR(CheckField("web_identity_token", access.web_identity_token, 65536));
  GPUFEED_RETURN_IF_ERROR(CheckField("role_arn", access.role_arn, 2048));
  GPUFEED_RETURN_IF_ERROR(CheckField("role_session_name", access.role_session_name, 64));
  S3Client* client = client_.get();
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
    // What STS sent goes into headers too.
    GPUFEED_RETURN_IF_ERROR(CheckField("sts.access_key_id", credentials.access_key_id, 128));
    GPUFEED_RETURN_IF_ERROR(
        CheckField("sts.secret_access_key", credentials.secret_access_key, 256));
    GPUFEED_RETURN_IF_ERROR(CheckField("sts.session_token", credentials.session_token, 16384));
  } else if (credentials.anonymous()) {
    return absl::InvalidArgumentError(
        "object_store: no credentials came (set anonymous for a public bucket)");
  }
  return std::shared_ptr<const ObjectSource>(
      std::make_shared<Source>(this, client, std::move(credentials), PrincipalOf(access, salt_)));
}

}  // namespace gpufeed::objstore
