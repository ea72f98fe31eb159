// The budget for the per-slot sample-id arrays of every session (docs/SECURITY.md §4,
// `max_ids_bytes` and `max_ids_bytes_per_uid`): batch_size x ring slots x 8 bytes a session,
// outside --staging_bytes. Attach takes a charge before the session exists; the charge
// returns its bytes when it is destroyed, with the session that owns the arrays.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/byte_budget.h"

namespace gpufeed::server {

// max_ids_bytes of `capacity` bytes, `per_uid` of them (0: half) for one non-admin uid.
inline std::shared_ptr<ByteBudget> CreateIdsBudget(uint64_t capacity, uint64_t per_uid = 0) {
  return ByteBudget::Create("max_ids_bytes", capacity, "max_ids_bytes_per_uid", per_uid,
                            "lower batch_size or ring_slots, or retry later");
}

// The ids of `slots` slots of `batch_size` rows, charged to `uid` (nullopt: an admin).
// RESOURCE_EXHAUSTED naming the bytes asked, in use and the setting when they do not fit.
inline absl::StatusOr<std::shared_ptr<const ByteBudget::Charge>> TakeIds(
    ByteBudget& budget, std::optional<uint32_t> uid, int64_t batch_size, int32_t slots) {
  // batch_size <= 2^24 and slots <= 64 at Attach, but do not rely on it here.
  const __uint128_t want = static_cast<__uint128_t>(static_cast<uint64_t>(batch_size)) *
                           static_cast<uint64_t>(slots) * sizeof(int64_t);
  const std::string what = absl::StrCat("sample ids of ", slots, " slots x ", batch_size, " rows");
  if (batch_size < 0 || slots < 0 || (want >> 64) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " need more than 2^64 bytes; ",
                                                     budget.used(), " of max_ids_bytes ",
                                                     budget.capacity(), " are in use"));
  }
  absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> charge =
      budget.Take(uid, static_cast<uint64_t>(want), what);
  if (!charge.ok()) return charge.status();
  return std::shared_ptr<const ByteBudget::Charge>(std::move(*charge));
}

}  // namespace gpufeed::server
