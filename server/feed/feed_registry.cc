#include "server/feed/feed.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "common/status.h"
#include "server/reader/shards.h"

namespace gpufeed::server {

FeedRegistry::FeedRegistry(FileSystem* fs, FeedAccessOptions access, const FeedLimits& limits,
                           Clock clock)
    : fs_(fs),
      access_(std::move(access)),
      limits_(limits),
      handles_(access_.handles, std::move(clock)) {}

namespace {

// Whether `path` (resolved) lies beneath one of `roots`.
bool Beneath(const std::string& path, const std::vector<std::string>& roots) {
  for (std::string root : roots) {
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    if (root == "/" || path == root || absl::StartsWith(path, absl::StrCat(root, "/"))) {
      return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<std::string> FeedRegistry::AddObjectStoreHandle(objstore::ObjectStoreAccess access,
                                                               const PeerCred& from,
                                                               UniqueFd lifeline) {
  if (access_.object_store == nullptr) {
    return absl::FailedPreconditionError(
        "open_dataset: this gpufeedd serves no s3:// datasets (its admin starts it with "
        "--s3_endpoint)");
  }
  return handles_.Add(std::make_shared<const objstore::ObjectStoreAccess>(std::move(access)),
                      from.uid, std::move(lifeline));
}

absl::StatusOr<std::string> FeedRegistry::AddDatasetHandle(UniqueFd fd, const PeerCred& from,
                                                           UniqueFd lifeline) {
  // Only a descriptor the sender could read through: not O_PATH (which needs no read
  // permission on the file itself) and not write-only.
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0) return ErrnoToStatus(errno, "open_dataset: fcntl");
  if ((flags & O_PATH) != 0 || (flags & O_ACCMODE) == O_WRONLY) {
    return absl::InvalidArgumentError(
        "open_dataset: the descriptor passed is not open for reading (O_PATH or O_WRONLY); "
        "open the dataset with O_RDONLY");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "open_dataset: stat");
  if (!S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "open_dataset: the descriptor passed is ", FileTypeName(st.st_mode),
        ", not a regular file or a directory"));
  }
  return handles_.Add(std::move(fd), from.uid, std::move(lifeline));
}

absl::Status FeedRegistry::Resolve(const Caller& caller, FeedSpec* spec, UniqueFd* fd,
                                   std::string* key) const {
  DatasetSpec& d = spec->dataset;
  std::string resolved;
  struct stat st {};
  // An explicit list's files, beneath d.path (ValidateShardPaths, at the edge).
  std::vector<std::string> relative;
  for (const std::string& p : d.paths) {
    relative.push_back(p.substr(std::min(p.size(), d.path == "/" ? 1 : d.path.size() + 1)));
  }
  if (absl::StartsWith(d.path, "s3://")) {
    // An object store's dataset (docs/howto/object-storage.md): read with the caller's own
    // access, which came with the handle; shared only by callers of one uid (each feed's
    // objects are HEADed with its first caller's access).
    if (access_.object_store == nullptr) {
      return absl::FailedPreconditionError(
          "dataset.path: this gpufeedd serves no s3:// datasets (its admin starts it with "
          "--s3_endpoint)");
    }
    if (d.kind != DatasetKind::kTokens && d.kind != DatasetKind::kWebDataset &&
        d.kind != DatasetKind::kRecords) {
      return absl::InvalidArgumentError(
          "dataset.path: an s3:// dataset is of kind tokens, webdataset or records");
    }
    if (d.handle.empty()) {
      return absl::InvalidArgumentError(
          "dataset.handle: an s3:// dataset is read with the caller's own access, which the "
          "client library passes on the memory socket: attach through it");
    }
    GPUFEED_ASSIGN_OR_RETURN(std::shared_ptr<const objstore::ObjectStoreAccess> access,
                             handles_.TakeAccess(d.handle, caller.uid()));
    GPUFEED_ASSIGN_OR_RETURN(d.objects, access_.object_store->Bind(*access));
    d.walk = access_.walk;
    d.walk.cancel = &cancel_;
    if (!caller.admin) d.walk.charge_uid = caller.uid();
    // One feed per uid and credentials: a caller whose own access was never tried on the
    // objects (another secret, none) never joins a feed another caller's access opened.
    std::string identity = absl::StrCat(";", d.objects->Identity(), ";uid=", caller.uid(),
                                        ";principal=", d.objects->Principal());
    *key = FeedKeyOf(absl::StrCat(spec->Canonical(), identity));
    d.resolved = std::move(identity);
    return absl::OkStatus();
  }
  if (!d.handle.empty()) {
    GPUFEED_ASSIGN_OR_RETURN(*fd, handles_.Take(d.handle, caller.uid()));
    d.fd = fd->get();
    if (::fstat(d.fd, &st) != 0) return ErrnoToStatus(errno, "dataset.handle: stat");
    // A folder's files (images, token shards, tar shards) are opened by the daemon beneath
    // it: with the caller's mode-bit rights.
    if (d.kind == DatasetKind::kImageFolder || S_ISDIR(st.st_mode)) d.reader = caller.cred;
    if (!access_.dataset_roots.empty()) {
      GPUFEED_ASSIGN_OR_RETURN(resolved, ResolvedPathOf(d.fd));
    }
  } else {
    if (!caller.admin) {
      return absl::PermissionDeniedError(
          "dataset.handle: attach through the client library, which opens the dataset with "
          "your rights and passes it to gpufeedd; attach by path is for admins");
    }
    // Canonicalise the path so "/data/x" and "/data/./x" share a feed.
    if (!d.path.empty() && d.path[0] == '/') {
      char real[PATH_MAX];
      if (::realpath(d.path.c_str(), real) == nullptr) {
        return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", d.path));
      }
      d.path = real;
      resolved = real;
      if (::stat(real, &st) != 0) st = {};
      for (size_t i = 0; i < relative.size(); ++i) {
        d.paths[i] = absl::StrCat(d.path == "/" ? "" : d.path, "/", relative[i]);
      }
    }
  }
  if (!access_.dataset_roots.empty()) {
    const auto outside = [&](absl::string_view field, absl::string_view name) {
      return absl::PermissionDeniedError(
          absl::StrCat(field, ": ", name, " lies outside the directories gpufeedd serves ",
                       "(dataset_roots: ", absl::StrJoin(access_.dataset_roots, ", "), ")"));
    };
    if (relative.empty() && !Beneath(resolved, access_.dataset_roots)) {
      return outside("dataset.path", d.path);
    }
    // A list's directory may be far above its files (their deepest common one): each file's
    // place decides.
    for (size_t i = 0; i < relative.size(); ++i) {
      const std::string place = absl::StrCat(resolved == "/" ? "" : resolved, "/", relative[i]);
      if (!Beneath(place, access_.dataset_roots)) {
        return outside(absl::StrCat("dataset.paths[", i, "]"), d.paths[i]);
      }
    }
  }
  d.walk = access_.walk;
  d.walk.cancel = &cancel_;
  if (!caller.admin) d.walk.charge_uid = caller.uid();
  // Two descriptors of one file share a feed as two paths of it do. A folder's files are read
  // with its reader's rights: only callers of the same uid and groups share its feed.
  std::string identity = absl::StrCat(";dev=", st.st_dev, ";ino=", st.st_ino);
  if (d.reader.has_value()) {
    std::vector<uint32_t> groups = d.reader->groups;
    std::sort(groups.begin(), groups.end());
    absl::StrAppend(&identity, ";reader=", d.reader->uid, ":", d.reader->gid, ":",
                    absl::StrJoin(groups, ","));
  }
  *key = FeedKeyOf(absl::StrCat(spec->Canonical(), identity));
  d.resolved = std::move(identity);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Feed>> FeedRegistry::GetOrCreate(const FeedSpec& requested,
                                                                const Caller& caller) {
  FeedSpec spec = requested;
  UniqueFd fd;  // the caller's descriptor, open until the dataset holds its own dup
  std::string key;
  GPUFEED_RETURN_IF_ERROR(Resolve(caller, &spec, &fd, &key));
  return GetOrCreateResolved(spec, key);
}

absl::StatusOr<std::shared_ptr<Feed>> FeedRegistry::GetOrCreate(const FeedSpec& requested) {
  Caller daemon;
  daemon.admin = true;
  return GetOrCreate(requested, daemon);
}

absl::StatusOr<std::shared_ptr<Feed>> FeedRegistry::GetOrCreateResolved(const FeedSpec& spec,
                                                                        const std::string& key) {
  {
    absl::MutexLock lock(&mu_);
    auto it = feeds_.find(key);
    if (it != feeds_.end()) {
      if (std::shared_ptr<Feed> feed = it->second.lock()) return feed;
    }
  }
  GPUFEED_ASSIGN_OR_RETURN(std::shared_ptr<Feed> feed, Feed::Create(spec, fs_, limits_, key));
  absl::MutexLock lock(&mu_);
  // Two attaches may have raced to create it: keep the first, so both share one feed.
  auto& slot = feeds_[key];
  if (std::shared_ptr<Feed> existing = slot.lock()) return existing;
  slot = feed;
  // Drop entries of feeds nobody uses any more.
  absl::erase_if(feeds_, [](const auto& entry) { return entry.second.expired(); });
  return feed;
}

std::vector<std::shared_ptr<Feed>> FeedRegistry::List() const {
  std::vector<std::shared_ptr<Feed>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, weak] : feeds_) {
    if (std::shared_ptr<Feed> feed = weak.lock()) out.push_back(std::move(feed));
  }
  return out;
}


}  // namespace gpufeed::server
