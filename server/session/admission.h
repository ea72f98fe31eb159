// Whether the daemon takes one more session: its state (shut down, draining), its session
// limit and each uid's quotas (docs/SECURITY.md section 4), with what the open sessions hold.
// The one place the quota policy is written; the session manager asks it under its lock, with
// the bytes known at each step of Attach, and tells it of every session added and removed.
#pragma once

#include <cstdint>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "server/auth/caller.h"

namespace gpufeed::server {

struct AdmissionLimits {
  int max_sessions = 256;
  // Per non-admin uid: sessions attached at once, and bytes of staging (with their sample
  // ids) their rings hold together; 0 = no limit.
  int max_sessions_per_uid = 64;
  uint64_t max_staging_bytes_per_uid = 0;
};

// Not thread-safe: its owner guards it (SessionManager, under its mutex).
class Admission {
 public:
  // Where in Attach the daemon's state is checked: before the dataset is opened, or where
  // the session is inserted (opening can take long: a drain may have begun meanwhile).
  enum class Step { kBeforeOpen, kInsert };

  explicit Admission(const AdmissionLimits& limits) : limits_(limits) {}

  // UNAVAILABLE once shut down or draining; RESOURCE_EXHAUSTED at max_sessions; then Quota.
  absl::Status Admit(const Caller& caller, uint64_t bytes, Step step) const;
  // RESOURCE_EXHAUSTED naming the quota when `caller` may not add a session holding `bytes`;
  // admins (Caller::admin: root, the daemon's uid, admin_uids) are counted but not capped.
  absl::Status Quota(const Caller& caller, uint64_t bytes) const;
  // The most staging `caller`'s rings may hold together: the pool's, or its uid's quota when
  // smaller.
  uint64_t StagingRoom(const Caller& caller, uint64_t pool_bytes) const;
  // Whose share of the sample-id budget a session of `caller` takes (nullopt: an admin's,
  // uncapped).
  static std::optional<uint32_t> IdsOwner(const Caller& caller);

  void Add(uint32_t uid, uint64_t bytes);
  void Remove(uint32_t uid, uint64_t bytes);
  int sessions() const { return sessions_; }

  // Refuses new sessions from now on; false when already draining.
  bool BeginDrain();
  bool draining() const { return draining_; }
  // Refuses new sessions for good and forgets the usage; false when already shut down.
  bool Shutdown();

 private:
  // What one uid's open sessions hold.
  struct Usage {
    int sessions = 0;
    uint64_t staging_bytes = 0;
  };

  const AdmissionLimits limits_;
  bool shut_down_ = false;
  bool draining_ = false;
  int sessions_ = 0;
  absl::flat_hash_map<uint32_t, Usage> usage_;
};

}  // namespace gpufeed::server
