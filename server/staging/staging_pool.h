// The staging pool: host memory for every session's ring, as memfd slabs created once at
// start-up (pinning and allocation are slow: never per batch). A session's ring is one
// contiguous, page-aligned region of one slab; consumers receive the slab's fd over the
// memory socket and map just their region.
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

// A lease on a region of a slab; returns it to the pool when destroyed. The pool must
// outlive its regions.
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
  uint64_t offset() const { return offset_; }  // within the slab, page-aligned
  int slab() const { return slab_; }

 private:
  friend class StagingPool;
  StagingPool* pool_ = nullptr;
  int slab_ = -1;
  uint64_t offset_ = 0;
  uint64_t size_ = 0;
  std::byte* data_ = nullptr;
};

class StagingPool {
 public:
  // `total_bytes` split into slabs of at most `max_slab_bytes` (rounded to pages). Memory is
  // reserved lazily by the kernel: untouched pages cost nothing.
  static absl::StatusOr<std::unique_ptr<StagingPool>> Create(uint64_t total_bytes,
                                                             uint64_t max_slab_bytes);

  // A region of at least `bytes` (rounded up to pages), zeroed. RESOURCE_EXHAUSTED stating
  // the bytes asked and free when it does not fit.
  absl::StatusOr<StagingRegion> Allocate(uint64_t bytes);

  uint64_t total_bytes() const { return total_bytes_; }
  uint64_t free_bytes() const;
  int num_slabs() const { return static_cast<int>(slabs_.size()); }
  int slab_fd(int slab) const { return slabs_[slab].fd.get(); }
  std::byte* slab_data(int slab) const { return slabs_[slab].mapping.data(); }
  uint64_t slab_bytes(int slab) const { return slabs_[slab].mapping.size(); }

 private:
  friend class StagingRegion;
  // The first free range of `size` bytes (page-rounded), not yet zeroed.
  absl::StatusOr<StagingRegion> Take(uint64_t size);
  struct Slab {
    UniqueFd fd;
    Mapping mapping;
  };
  StagingPool() = default;
  void Free(int slab, uint64_t offset, uint64_t size);

  std::vector<Slab> slabs_;
  uint64_t total_bytes_ = 0;
  mutable absl::Mutex mu_;
  // Free ranges per slab: offset -> size, coalesced on free.
  std::vector<std::map<uint64_t, uint64_t>> free_ ABSL_GUARDED_BY(mu_);
  uint64_t free_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpufeed::server
