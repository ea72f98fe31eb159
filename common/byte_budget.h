// A byte budget shared by many holders, daemon-wide and per uid: what one uid may take of a
// heap the daemon keeps outside its staging pool (docs/SECURITY.md §4: the sessions' sample-id
// arrays, `max_ids_bytes`; the datasets' attach-time indexes, `max_index_bytes`). A holder
// takes a Charge, may grow it (an index being built), and returns its bytes by destroying it.
// Never blocks: a request past the total or past the uid's share is RESOURCE_EXHAUSTED
// naming the setting, so one uid cannot leave nothing for the others.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace gpufeed {

class ByteBudget : public std::enable_shared_from_this<ByteBudget> {
 public:
  // Bytes taken from a budget by one holder, returned when this goes. Not copyable.
  class Charge {
   public:
    Charge(const Charge&) = delete;
    Charge& operator=(const Charge&) = delete;
    ~Charge();
    // `more` bytes for the same holder, for `what` (in the message): as Take.
    absl::Status Grow(uint64_t more, absl::string_view what);
    // Grows the charge to `total` bytes (a holder that has grown, as an index being built);
    // nothing when it holds that many already.
    absl::Status GrowTo(uint64_t total, absl::string_view what) {
      return total > bytes_ ? Grow(total - bytes_, what) : absl::OkStatus();
    }
    uint64_t bytes() const { return bytes_; }

   private:
    friend class ByteBudget;
    Charge(std::shared_ptr<ByteBudget> budget, std::optional<uint32_t> uid, uint64_t bytes)
        : budget_(std::move(budget)), uid_(uid), bytes_(bytes) {}
    const std::shared_ptr<ByteBudget> budget_;  // outlives every holder of a charge
    const std::optional<uint32_t> uid_;
    uint64_t bytes_;
  };

  // `capacity` bytes in all, at most `per_uid` of them (0: half of `capacity`) for one capped
  // uid. `name` / `per_uid_name` are the settings messages name ("max_ids_bytes"); `advice`
  // ends a refusal ("lower batch_size or ring_slots, or retry later").
  static std::shared_ptr<ByteBudget> Create(std::string name, uint64_t capacity,
                                            std::string per_uid_name, uint64_t per_uid,
                                            std::string advice);

  // `bytes` for `what` (the message's subject, "sample ids of 2 slots x 4 rows") charged to
  // `uid`'s share, or to no share for nullopt (an admin: counted in the total, not capped).
  // RESOURCE_EXHAUSTED naming the bytes asked, those in use and the setting.
  absl::StatusOr<std::unique_ptr<Charge>> Take(std::optional<uint32_t> uid, uint64_t bytes,
                                               absl::string_view what);

  uint64_t capacity() const { return capacity_; }
  uint64_t per_uid() const { return per_uid_; }
  uint64_t used() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t used_by(uint32_t uid) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ByteBudget(std::string name, uint64_t capacity, std::string per_uid_name, uint64_t per_uid,
             std::string advice);
  absl::Status Add(std::optional<uint32_t> uid, uint64_t bytes, absl::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Return(std::optional<uint32_t> uid, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const std::string name_;
  const uint64_t capacity_;
  const std::string per_uid_name_;
  const uint64_t per_uid_;
  const std::string advice_;
  mutable absl::Mutex mu_;
  uint64_t used_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint32_t, uint64_t> by_uid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gpufeed
