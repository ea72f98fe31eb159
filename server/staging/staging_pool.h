// The staging pool: host memory for every session's ring, within one byte budget
// (--staging_bytes). Two kinds of memory (docs/SECURITY.md section 3):
//
// - A host-delivery ring is its own memfd, of exactly the ring's bytes (page-rounded), sealed
//   against resizing (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), created and mapped at
//   Attach. The memory socket hands that memfd to the ring's consumer and nothing else: a
//   consumer can map only its own ring. When the session ends the daemon unmaps it and the
//   bytes return to the budget (the session closes its descriptor when it goes); a consumer
//   that still maps it keeps only its own old pages, never another session's.
// - A device-delivery session stages through a region of the daemon's slabs: memfd slabs
//   created once at start-up (pinned when a GPU is present: pinning is slow, never per batch)
//   and never handed to any consumer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/os/fd.h"

namespace gpufeed::server {

class StagingPool;

// A lease on staging memory, counted against the pool's budget until destroyed: a region of
// a daemon slab, or a ring's own memfd (own_memfd()). The pool must outlive its regions.
class StagingRegion {
 public:
  StagingRegion() = default;
  StagingRegion(StagingRegion&& other) noexcept { *this = std::move(other); }
  StagingRegion& operator=(StagingRegion&& other) noexcept;
  StagingRegion(const StagingRegion&) = delete;
  StagingRegion& operator=(const StagingRegion&) = delete;
  ~StagingRegion();

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  // A slab region's place: its slab and page-aligned offset. -1 and 0 for an own memfd.
  uint64_t offset() const { return offset_; }
  int slab() const { return slab_; }
  // Whether this is a ring's own memfd (the region is the whole file, size() bytes).
  bool own_memfd() const { return pool_ != nullptr && slab_ < 0; }
  // A new close-on-exec descriptor of the ring's own memfd, for the memory socket.
  // FAILED_PRECONDITION for a slab region (slabs never leave the daemon), or once taken.
  absl::StatusOr<UniqueFd> DupMemfd() const;
  // Hands the own memfd's descriptor to the caller (invalid for a slab region); the region
  // keeps the mapping and the budget until it goes. A session holds the descriptor so that
  // its consumer can be given its ring for as long as the session object lives.
  UniqueFd TakeMemfd() { return std::move(memfd_); }
  // An own memfd's pages are freed when the region goes (MADV_REMOVE: a consumer that still
  // maps the ring then reads zeros), so that a ring's memory never outlives its place in the
  // budget: a consumer cannot keep rings alive past --staging_bytes by holding their fds
  // (docs/SECURITY.md section 3). KeepPagesForConsumer leaves them to the consumer's mapping
  // instead: at shutdown, so that batches a consumer holds across a daemon restart keep
  // their bytes.
  void KeepPagesForConsumer() { release_pages_ = false; }

 private:
  friend class StagingPool;
  void Return();

  StagingPool* pool_ = nullptr;
  int slab_ = -1;
  uint64_t offset_ = 0;
  uint64_t size_ = 0;
  std::byte* data_ = nullptr;
  // Own memfd only: its descriptor (until taken) and the daemon's mapping of it.
  UniqueFd memfd_;
  Mapping mapping_;
  bool release_pages_ = true;
};

class StagingPool {
 public:
  // `total_bytes` (the budget) and, for device-delivery staging, slabs of at most
  // `max_slab_bytes` (rounded to pages) adding up to it. Memory is reserved lazily by the
  // kernel: untouched pages cost nothing.
  static absl::StatusOr<std::unique_ptr<StagingPool>> Create(uint64_t total_bytes,
                                                             uint64_t max_slab_bytes);

  // A region of a slab of at least `bytes` (rounded up to pages), zeroed: daemon-private
  // staging (device delivery). RESOURCE_EXHAUSTED stating the bytes asked and free when it
  // does not fit the budget or any slab.
  absl::StatusOr<StagingRegion> Allocate(uint64_t bytes);

  // A ring's own sealed memfd of `bytes` rounded up to pages, mapped, zeroed (a new memfd
  // is): host delivery, handed to the consumer. RESOURCE_EXHAUSTED stating the bytes asked
  // and free when it does not fit the budget.
  absl::StatusOr<StagingRegion> AllocateOwnMemfd(uint64_t bytes);

  uint64_t total_bytes() const { return total_bytes_; }
  // The budget not held by any region (slab regions and own memfds together).
  uint64_t free_bytes() const;
  int num_slabs() const { return static_cast<int>(slabs_.size()); }
  // The daemon's slabs, for pinning and tests; never handed to a consumer.
  int slab_fd(int slab) const { return slabs_[slab].fd.get(); }
  std::byte* slab_data(int slab) const { return slabs_[slab].mapping.data(); }
  uint64_t slab_bytes(int slab) const { return slabs_[slab].mapping.size(); }

 private:
  friend class StagingRegion;
  // Page-rounds `bytes`; RESOURCE_EXHAUSTED when that exceeds the whole pool.
  absl::StatusOr<uint64_t> RoundRequest(uint64_t bytes) const;
  absl::Status ExhaustedLocked(uint64_t size, uint64_t largest) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first free range of `size` bytes (page-rounded), not yet zeroed.
  absl::StatusOr<StagingRegion> Take(uint64_t size);
  struct Slab {
    UniqueFd fd;
    Mapping mapping;
  };
  StagingPool() = default;
  void Free(int slab, uint64_t offset, uint64_t size);
  void Unreserve(uint64_t size);

  std::vector<Slab> slabs_;
  uint64_t total_bytes_ = 0;
  mutable absl::Mutex mu_;
  // Free ranges per slab: offset -> size, coalesced on free.
  std::vector<std::map<uint64_t, uint64_t>> free_ ABSL_GUARDED_BY(mu_);
  // The budget left: total_bytes_ less every live region, of a slab or an own memfd.
  uint64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed::server
