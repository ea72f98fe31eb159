#include "server/session/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace gpufeed::server {

absl::Status Admission::Admit(const Caller& caller, uint64_t bytes, Step step) const {
  if (shut_down_) return absl::UnavailableError("gpufeedd is shutting down");
  if (draining_) {
    return absl::UnavailableError(
        step == Step::kBeforeOpen
            ? "gpufeedd is draining (gpufeedctl drain): attach to another daemon or retry after "
              "its restart"
            : "gpufeedd is draining (gpufeedctl drain)");
  }
  if (sessions_ >= limits_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("gpufeedd serves at most ", limits_.max_sessions, " sessions"));
  }
  return Quota(caller, bytes);
}

absl::Status Admission::Quota(const Caller& caller, uint64_t bytes) const {
  if (caller.admin) return absl::OkStatus();
  const uint32_t uid = caller.uid();
  auto it = usage_.find(uid);
  const Usage usage = it == usage_.end() ? Usage() : it->second;
  if (limits_.max_sessions_per_uid > 0 && usage.sessions >= limits_.max_sessions_per_uid) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_sessions_per_uid: uid ", uid, " has ", usage.sessions,
        " sessions attached, the most one uid may hold; detach one (or an admin raises "
        "max_sessions_per_uid)"));
  }
  const uint64_t quota = limits_.max_staging_bytes_per_uid;
  if (quota > 0 && bytes > 0 && (bytes > quota || usage.staging_bytes > quota - bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_staging_bytes_per_uid: uid ", uid, "'s rings hold ", usage.staging_bytes,
        " bytes of staging (with their sample ids); a ring of ", bytes,
        " more would pass its quota of ", quota,
        " bytes (use fewer or smaller rings, or an admin raises max_staging_bytes_per_uid)"));
  }
  return absl::OkStatus();
}

uint64_t Admission::StagingRoom(const Caller& caller, uint64_t pool_bytes) const {
  const uint64_t quota = limits_.max_staging_bytes_per_uid;
  return caller.admin || quota == 0 ? pool_bytes : std::min(quota, pool_bytes);
}

std::optional<uint32_t> Admission::IdsOwner(const Caller& caller) {
  return caller.admin ? std::nullopt : std::optional<uint32_t>(caller.uid());
}

void Admission::Add(uint32_t uid, uint64_t bytes) {
  ++sessions_;
  Usage& usage = usage_[uid];
  ++usage.sessions;
  usage.staging_bytes += bytes;
}

void Admission::Remove(uint32_t uid, uint64_t bytes) {
  auto it = usage_.find(uid);
  if (it == usage_.end()) return;  // forgotten by Shutdown
  --sessions_;
  --it->second.sessions;
  it->second.staging_bytes -= std::min(it->second.staging_bytes, bytes);
  if (it->second.sessions <= 0) usage_.erase(it);
}

bool Admission::BeginDrain() {
  const bool was = draining_;
  draining_ = true;
  return !was;
}

bool Admission::Shutdown() {
  if (shut_down_) return false;
  shut_down_ = true;
  sessions_ = 0;
  usage_.clear();
  return true;
}

}  // namespace gpufeed::server
