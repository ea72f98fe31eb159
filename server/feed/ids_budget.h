// The daemon-wide budget for the per-slot sample-id arrays of every session (docs/SECURITY.md
// §4, `max_ids_bytes`): batch_size x ring slots x 8 bytes a session, outside --staging_bytes.
// Attach takes a charge before the session exists; the charge returns its bytes when it is
// destroyed, with the session that owns the arrays.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::server {

class IdsBudget {
 public:
  // Bytes taken from a budget, returned when this goes. Move-only; held by shared_ptr where
  // the holder must be copyable (SessionParams).
  class Charge {
   public:
    Charge(const Charge&) = delete;
    Charge& operator=(const Charge&) = delete;
    ~Charge() { budget_->used_.fetch_sub(bytes_, std::memory_order_relaxed); }
    uint64_t bytes() const { return bytes_; }

   private:
    friend class IdsBudget;
    Charge(std::shared_ptr<IdsBudget> budget, uint64_t bytes)
        : budget_(std::move(budget)), bytes_(bytes) {}
    const std::shared_ptr<IdsBudget> budget_;  // outlives every session that holds a charge
    const uint64_t bytes_;
  };

  static std::shared_ptr<IdsBudget> Create(uint64_t capacity) {
    return std::shared_ptr<IdsBudget>(new IdsBudget(capacity));
  }

  // The ids of `slots` slots of `batch_size` rows. RESOURCE_EXHAUSTED naming the bytes asked,
  // in use and the cap when they do not fit. Never blocks.
  static absl::StatusOr<std::shared_ptr<const Charge>> Take(const std::shared_ptr<IdsBudget>& self,
                                                            int64_t batch_size, int32_t slots) {
    // batch_size <= 2^24 and slots <= 64 at Attach, but do not rely on it here.
    const __uint128_t want = static_cast<__uint128_t>(static_cast<uint64_t>(batch_size)) *
                             static_cast<uint64_t>(slots) * sizeof(int64_t);
    uint64_t used = self->used_.load(std::memory_order_relaxed);
    while (true) {
      if (batch_size < 0 || slots < 0 || want > self->capacity_ - used) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "sample ids of ", slots, " slots x ", batch_size, " rows need ",
            (want >> 64) != 0 ? "more than 2^64" : absl::StrCat(static_cast<uint64_t>(want)),
            " bytes; ", used, " of max_ids_bytes ",
            self->capacity_, " are in use: lower batch_size or ring_slots, or retry later"));
      }
      if (self->used_.compare_exchange_weak(used, used + static_cast<uint64_t>(want),
                                            std::memory_order_relaxed)) {
        break;
      }
    }
    return std::shared_ptr<const Charge>(new Charge(self, static_cast<uint64_t>(want)));
  }

  uint64_t capacity() const { return capacity_; }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }

 private:
  explicit IdsBudget(uint64_t capacity) : capacity_(capacity) {}
  const uint64_t capacity_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace gpufeed::server
