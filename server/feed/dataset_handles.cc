#include "server/feed/dataset_handles.h"

#include <sys/random.h>

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

constexpr size_t kHandleBytes = 16;

std::string NewHandle() {
  unsigned char bytes[kHandleBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(bytes), sizeof(bytes)));
}

bool WellFormed(const std::string& handle) {
  if (handle.size() != 2 * kHandleBytes) return false;
  for (char c : handle) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

}  // namespace

void DatasetHandles::DropExpired(absl::Time now, std::vector<UniqueFd>* dropped) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.expiry > now) {
      ++it;
      continue;
    }
    if (--per_uid_[it->second.uid] == 0) per_uid_.erase(it->second.uid);
    dropped->push_back(std::move(it->second.fd));
    if (it->second.lifeline.valid()) dropped->push_back(std::move(it->second.lifeline));
    entries_.erase(it++);
  }
}

absl::StatusOr<std::string> DatasetHandles::Add(UniqueFd fd, uint32_t uid, UniqueFd lifeline) {
  Entry e;
  e.fd = std::move(fd);
  e.uid = uid;
  e.lifeline = std::move(lifeline);
  return AddEntry(std::move(e));
}

absl::StatusOr<std::string> DatasetHandles::Add(
    std::shared_ptr<const objstore::ObjectStoreAccess> access, uint32_t uid, UniqueFd lifeline) {
  Entry e;
  e.access = std::move(access);
  e.uid = uid;
  e.lifeline = std::move(lifeline);
  return AddEntry(std::move(e));
}

absl::StatusOr<std::string> DatasetHandles::AddEntry(Entry entry) {
  std::vector<UniqueFd> dropped;  // closed after the lock is released
  const absl::Time now = clock_();
  std::string handle = NewHandle();
  const uint32_t uid = entry.uid;
  absl::MutexLock lock(&mu_);
  DropExpired(now, &dropped);
  if (entries_.size() >= options_.max_handles) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "gpufeedd holds ", options_.max_handles, " dataset handles not attached yet; retry later"));
  }
  if (auto it = per_uid_.find(uid); it != per_uid_.end() && it->second >= options_.max_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "uid ", uid, " holds ", options_.max_per_uid,
        " dataset handles not attached yet: attach with them or wait ",
        absl::FormatDuration(options_.lifetime), " for them to expire"));
  }
  ++per_uid_[uid];
  entry.expiry = now + options_.lifetime;
  entries_[handle] = std::move(entry);
  return handle;
}

UniqueFd DatasetHandles::TakeLifeline(const std::string& handle, uint32_t uid) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(handle);
  if (it == entries_.end() || it->second.uid != uid || it->second.expiry <= clock_()) {
    return UniqueFd();
  }
  return std::move(it->second.lifeline);
}

absl::StatusOr<DatasetHandles::Entry> DatasetHandles::TakeEntry(const std::string& handle,
                                                                uint32_t uid) {
  if (!WellFormed(handle)) {
    return absl::InvalidArgumentError(
        "dataset.handle: must be the 32 hex digits the memory socket gave (open_dataset)");
  }
  std::vector<UniqueFd> dropped;
  const absl::Time now = clock_();
  absl::MutexLock lock(&mu_);
  DropExpired(now, &dropped);
  auto it = entries_.find(handle);
  if (it == entries_.end() || it->second.uid != uid) {
    return absl::NotFoundError(absl::StrCat(
        "dataset.handle: no such handle (handles are single use, belong to the uid that opened "
        "the dataset and expire after ", absl::FormatDuration(options_.lifetime),
        "): open the dataset again"));
  }
  Entry e = std::move(it->second);
  if (--per_uid_[uid] == 0) per_uid_.erase(uid);
  entries_.erase(it);
  return e;
}

absl::StatusOr<UniqueFd> DatasetHandles::Take(const std::string& handle, uint32_t uid) {
  GPUFEED_ASSIGN_OR_RETURN(Entry e, TakeEntry(handle, uid));
  if (e.access != nullptr) {
    return absl::InvalidArgumentError(
        "dataset.handle: names object store access, which is for an s3:// dataset.path");
  }
  return std::move(e.fd);
}

absl::StatusOr<std::shared_ptr<const objstore::ObjectStoreAccess>> DatasetHandles::TakeAccess(
    const std::string& handle, uint32_t uid) {
  GPUFEED_ASSIGN_OR_RETURN(Entry e, TakeEntry(handle, uid));
  if (e.access == nullptr) {
    return absl::InvalidArgumentError(
        "dataset.handle: names an opened file, but dataset.path is an s3:// path");
  }
  return std::move(e.access);
}

size_t DatasetHandles::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace gpufeed::server
