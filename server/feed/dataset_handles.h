// Dataset handles (docs/SECURITY.md section 2): a descriptor a client opened with its own
// rights and passed on the memory socket, kept until an Attach of the same uid names it in
// dataset.handle. 128 random bits, bound to the sending uid, single use, valid for
// attach_timeout; bounded in number, overall and per uid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/os/fd.h"
#include "server/objstore/object_store.h"

namespace gpufeed::server {

struct DatasetHandleOptions {
  size_t max_handles = 1024;
  size_t max_per_uid = 64;
  absl::Duration lifetime = absl::Seconds(10);  // the daemon's attach_timeout
};

class DatasetHandles {
 public:
  explicit DatasetHandles(DatasetHandleOptions options = {}, Clock clock = RealClock())
      : options_(options), clock_(std::move(clock)) {}

  // Keeps `fd` for `uid` and returns its handle: 32 lowercase hex digits. RESOURCE_EXHAUSTED
  // when the table or the uid's share of it is full (expired handles are dropped first).
  // `lifeline`, when valid, is the client's memory-socket connection that the session
  // attached with this handle will keep (MemRequest.lifeline).
  absl::StatusOr<std::string> Add(UniqueFd fd, uint32_t uid, UniqueFd lifeline = UniqueFd())
      ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the lifeline out of `handle` (the uid's, not expired), leaving its descriptor for
  // Take; an invalid UniqueFd when there is none.
  UniqueFd TakeLifeline(const std::string& handle, uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the descriptor of `handle` (it can be taken once): INVALID_ARGUMENT
  // "dataset.handle: ..." when it is not 32 hex digits; NOT_FOUND "dataset.handle: ..." when it
  // is unknown, taken already, expired, or another uid's (which it leaves in place).
  absl::StatusOr<UniqueFd> Take(const std::string& handle, uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);

  // The same for an s3:// dataset: the caller's access to the object store instead of a
  // descriptor (MemRequest.object_store), kept only until its Attach takes it.
  absl::StatusOr<std::string> Add(std::shared_ptr<const objstore::ObjectStoreAccess> access,
                                  uint32_t uid, UniqueFd lifeline = UniqueFd())
      ABSL_LOCKS_EXCLUDED(mu_);
  // Take for a handle of access; INVALID_ARGUMENT where it names a descriptor (and Take, the
  // other way round), the handle spent either way.
  absl::StatusOr<std::shared_ptr<const objstore::ObjectStoreAccess>> TakeAccess(
      const std::string& handle, uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);

  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    UniqueFd fd;
    uint32_t uid = 0;
    absl::Time expiry;
    UniqueFd lifeline;
    std::shared_ptr<const objstore::ObjectStoreAccess> access;  // instead of fd
  };
  absl::StatusOr<std::string> AddEntry(Entry entry) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<Entry> TakeEntry(const std::string& handle, uint32_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves the expired entries out (closed by the caller, outside the lock).
  void DropExpired(absl::Time now, std::vector<UniqueFd>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const DatasetHandleOptions options_;
  const Clock clock_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint32_t, size_t> per_uid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed::server
