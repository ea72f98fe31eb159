#include "server/staging/staging_pool.h"

#include <sys/mman.h>
#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

uint64_t RoundUpToPage(uint64_t bytes) {
  const uint64_t page = PageSize();
  return (bytes + page - 1) / page * page;
}

}  // namespace

StagingRegion& StagingRegion::operator=(StagingRegion&& other) noexcept {
  if (this != &other) {
    Return();
    pool_ = std::exchange(other.pool_, nullptr);
    slab_ = std::exchange(other.slab_, -1);
    offset_ = std::exchange(other.offset_, 0);
    size_ = std::exchange(other.size_, 0);
    data_ = std::exchange(other.data_, nullptr);
    memfd_ = std::move(other.memfd_);
    mapping_ = std::move(other.mapping_);
    release_pages_ = std::exchange(other.release_pages_, true);
  }
  return *this;
}

StagingRegion::~StagingRegion() { Return(); }

void StagingRegion::Return() {
  if (pool_ == nullptr) return;
  if (slab_ >= 0) {
    pool_->Free(slab_, offset_, size_);
  } else {
    // An own memfd: its pages go with its place in the budget (a consumer's mapping then
    // reads zeros), unless they are left to the consumer (KeepPagesForConsumer).
    if (release_pages_ && mapping_.data() != nullptr &&
        ::madvise(mapping_.data(), mapping_.size(), MADV_REMOVE) != 0) {
      spdlog::warn("freeing a ring's pages: madvise(MADV_REMOVE): {}", std::strerror(errno));
    }
    mapping_ = Mapping();
    memfd_.Reset();
    pool_->Unreserve(size_);
  }
  pool_ = nullptr;
}

absl::StatusOr<UniqueFd> StagingRegion::DupMemfd() const {
  if (!memfd_.valid()) {
    return absl::FailedPreconditionError(
        own_memfd() ? "this ring's memfd is held by its session"
                    : "this ring stages in the daemon's private slabs, which are never handed out");
  }
  UniqueFd fd(::fcntl(memfd_.get(), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoToStatus(errno, "dup of the ring's memfd");
  return fd;
}

absl::StatusOr<std::unique_ptr<StagingPool>> StagingPool::Create(uint64_t total_bytes,
                                                                 uint64_t max_slab_bytes) {
  if (total_bytes > (uint64_t{1} << 48)) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_bytes: at most 256 TiB, got ", total_bytes));
  }
  total_bytes = RoundUpToPage(total_bytes);
  // Clamped first, so rounding a huge slab size cannot wrap.
  max_slab_bytes = RoundUpToPage(std::clamp<uint64_t>(max_slab_bytes, 1, total_bytes));
  if (total_bytes == 0) return absl::InvalidArgumentError("staging_bytes must be > 0");
  std::unique_ptr<StagingPool> pool(new StagingPool());
  pool->total_bytes_ = total_bytes;
  absl::MutexLock lock(&pool->mu_);
  for (uint64_t done = 0; done < total_bytes;) {
    const uint64_t size = std::min(max_slab_bytes, total_bytes - done);
    const int index = static_cast<int>(pool->slabs_.size());
    GPUFEED_ASSIGN_OR_RETURN(UniqueFd fd,
                             CreateSealedMemfd(absl::StrCat("gpufeed-staging-", index), size));
    GPUFEED_ASSIGN_OR_RETURN(Mapping mapping, Mapping::Map(fd.get(), 0, size, true));
    pool->slabs_.push_back({std::move(fd), std::move(mapping)});
    pool->free_.push_back({{0, size}});
    done += size;
  }
  pool->free_bytes_ = total_bytes;
  return pool;
}

absl::StatusOr<uint64_t> StagingPool::RoundRequest(uint64_t bytes) const {
  // Rounded in 128 bits: a request near 2^64 must not wrap to a tiny region.
  // A request of 0 bytes gets one page (every region has an address of its own).
  const __uint128_t page = PageSize();
  const __uint128_t pages = bytes == 0 ? 1 : (__uint128_t{bytes} + page - 1) / page;
  const __uint128_t rounded = pages * page;
  if (rounded > total_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "staging pool: asked for ", bytes, " bytes, more than the whole pool (", total_bytes_,
        " bytes free at most); start gpufeedd with a larger --staging_bytes"));
  }
  return static_cast<uint64_t>(rounded);
}

absl::Status StagingPool::ExhaustedLocked(uint64_t size, uint64_t largest) const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "staging pool: asked for ", size, " bytes, ", free_bytes_, " of ", total_bytes_,
      " bytes free (largest free block ", largest, " bytes); detach other sessions, use fewer "
      "ring_slots or a smaller batch, or start gpufeedd with a larger --staging_bytes"));
}

absl::StatusOr<StagingRegion> StagingPool::Allocate(uint64_t bytes) {
  GPUFEED_ASSIGN_OR_RETURN(const uint64_t size, RoundRequest(bytes));
  absl::StatusOr<StagingRegion> region = Take(size);
  // A new ring never shows the previous owner's bytes: zeroed outside the pool's lock (a
  // 64 MiB ring takes a few milliseconds, once per Attach).
  if (region.ok()) std::memset(region->data(), 0, region->size());
  return region;
}

absl::StatusOr<StagingRegion> StagingPool::AllocateOwnMemfd(uint64_t bytes) {
  GPUFEED_ASSIGN_OR_RETURN(const uint64_t size, RoundRequest(bytes));
  {
    absl::MutexLock lock(&mu_);
    // Any free byte of the budget will do: an own memfd needs no contiguous range.
    if (size > free_bytes_) return ExhaustedLocked(size, free_bytes_);
    free_bytes_ -= size;
  }
  // Created and mapped outside the lock; on failure the reservation goes back.
  StagingRegion region;
  region.pool_ = this;
  region.size_ = size;
  absl::StatusOr<UniqueFd> fd = CreateSealedMemfd("gpufeed-ring", size);
  if (!fd.ok()) return Annotate(fd.status(), "staging pool: a ring's memfd");  // region returns
  region.memfd_ = std::move(*fd);
  absl::StatusOr<Mapping> mapping = Mapping::Map(region.memfd_.get(), 0, size, true);
  if (!mapping.ok()) return Annotate(mapping.status(), "staging pool: mapping a ring's memfd");
  region.mapping_ = std::move(*mapping);
  region.data_ = region.mapping_.data();
  return region;  // a new memfd reads as zeros: nothing to clear
}

absl::StatusOr<StagingRegion> StagingPool::Take(uint64_t size) {
  absl::MutexLock lock(&mu_);
  // Own memfds hold budget outside the slabs: a free range counts up to the budget left.
  const bool in_budget = size <= free_bytes_;
  uint64_t largest = 0;
  for (size_t s = 0; s < free_.size(); ++s) {
    for (auto it = free_[s].begin(); it != free_[s].end(); ++it) {
      largest = std::max(largest, std::min(it->second, free_bytes_));
      if (!in_budget || it->second < size) continue;  // first fit
      StagingRegion region;
      region.pool_ = this;
      region.slab_ = static_cast<int>(s);
      region.offset_ = it->first;
      region.size_ = size;
      region.data_ = slabs_[s].mapping.data() + it->first;
      const uint64_t rest_offset = it->first + size;
      const uint64_t rest = it->second - size;
      const bool exact_fit = it->second == size;  // no empty range is ever kept
      free_[s].erase(it);
      if (!exact_fit) free_[s][rest_offset] = rest;
      free_bytes_ -= size;
      return region;
    }
  }
  return ExhaustedLocked(size, largest);
}

void StagingPool::Free(int slab, uint64_t offset, uint64_t size) {
  absl::MutexLock lock(&mu_);
  auto& ranges = free_[slab];
  auto [it, inserted] = ranges.emplace(offset, size);
  if (!inserted) return;  // double free cannot happen with owning regions; be safe anyway
  free_bytes_ += size;
  auto next = std::next(it);
  if (next != ranges.end() && it->first + it->second == next->first) {
    it->second += next->second;
    ranges.erase(next);
  }
  if (it != ranges.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      ranges.erase(it);
    }
  }
}

void StagingPool::Unreserve(uint64_t size) {
  absl::MutexLock lock(&mu_);
  free_bytes_ += size;
}

uint64_t StagingPool::free_bytes() const {
  absl::MutexLock lock(&mu_);
  return free_bytes_;
}

}  // namespace gpufeed::server
