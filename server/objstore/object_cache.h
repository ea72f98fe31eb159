// The node-local cache of object-store bytes (issue #36): one per daemon, shared by every job
// and rank, in memory or in a directory, keyed by (endpoint, bucket, key, ETag) and a block
// index. It knows nothing of S3: a reader hands in how to fetch a range (BlockFetch).
//
// Blocks. An object is cut into blocks [n*block_bytes, (n+1)*block_bytes), the last shorter.
// A block is fetched whole, once (single flight: readers of a block that is being fetched
// wait for that fetch), and is resident only once its fetch succeeded in full; a failed fetch
// is returned to every reader waiting on it and never cached, so the next read tries again.
// A cached block serves only readers of the same ObjectId, ETag included: bytes of one
// version of an object are never served for another.
//
// Budget. Every resident block and every block being fetched is charged its length rounded
// up to 4 KiB (a file's allocation unit; it also charges the bookkeeping of tiny objects), and
// the charges never exceed capacity_bytes. A block that cannot be charged (longer than the
// capacity, or every resident block is in use) is read through: the reader fetches the bytes
// it asked for straight into its buffer, and nothing is cached.
//
// Eviction, by farthest next use (Belady's rule, fed by the caller's hints):
//   - Hint(id, block, next_use) records one future read of the block at `next_use`, a counter
//     the caller assigns (smaller = sooner; the global step at which a feed reads it). A block
//     keeps its pending reads (the soonest 4, duplicates merged); a read of the block consumes
//     the soonest one. Its next use is its soonest pending read, or infinitely far if none.
//     Several readers may hint the same block; the soonest counts. A hint at or before a use
//     already consumed is stale and ignored, so re-hinting a window that has been read cannot
//     hold a block forever.
//   - To make room, the cache evicts the resident block whose next use is farthest ("no hint"
//     is infinitely far), ties broken by least recent use. So with no hints at all it is LRU.
//   - A block a reader is copying from, or waiting to copy from, is pinned and never evicted.
//   - Hints for blocks that are not resident are kept too (they apply when the block arrives),
//     at most max(1024, 4 x the blocks that fit) of them; beyond that the oldest is dropped.
//
// Read-ahead. After a read misses block n (or is the first to use a block read-ahead
// brought), blocks n+1..n+read_ahead_blocks of the object that are neither resident nor
// being fetched are fetched in the background by prefetch_threads threads (so at most that
// many at once), never past the object's end. A read-ahead is skipped, evicting nothing, when
// it would have to evict a pinned block or one whose next use is sooner than its own.
//
// Disk mode (dir != ""). Blocks are files "gpufeed-cache-<16 hex digits>.blk", mode 0600,
// written under "<same>.tmp" and renamed once whole, so a crash never leaves a partial block
// under a block's name. The names carry no object identity, so a new cache cannot tell whose
// bytes an old file holds: at start it removes every file of its own naming (.blk and .tmp)
// and nothing else, and starts empty. A lock file ("gpufeed-cache.lock", flock) keeps two
// caches (two daemons) off one directory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gpufeed::objstore {

// Which object version: a cached block is valid only for the same endpoint, bucket, key and
// ETag.
struct ObjectId {
  std::string endpoint;  // "" for AWS
  std::string bucket, key, etag;

  friend bool operator==(const ObjectId&, const ObjectId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const ObjectId& id) {
    return H::combine(std::move(h), id.endpoint, id.bucket, id.key, id.etag);
  }
};

struct ObjectCacheOptions {
  // "": blocks are kept in memory. Else files under this directory, created (with its missing
  // parents) mode 0700 if missing; at start the cache removes the files of its own naming
  // left there (see above) and never any other file.
  std::string dir;
  uint64_t capacity_bytes = 0;     // the budget for resident blocks (memory or disk); > 0
  uint64_t block_bytes = 8 << 20;  // > 0
  int read_ahead_blocks = 2;       // >= 0; 0 turns read-ahead off
  int prefetch_threads = 4;        // >= 1 where read_ahead_blocks > 0
};

struct ObjectCacheStats {
  uint64_t hits = 0;            // block reads that found the block resident
  uint64_t misses = 0;          // block reads that did not (fetched it, waited, or read through)
  uint64_t fetched_bytes = 0;   // bytes of successful fetches (read-ahead and read-through too)
  uint64_t fetches = 0;         // calls of a BlockFetch (failed ones too)
  uint64_t evictions = 0;       // resident blocks dropped to make room
  uint64_t resident_bytes = 0;  // charges of resident blocks (lengths rounded up to 4 KiB)
  uint64_t prefetches = 0;      // read-ahead fetches started
  uint64_t prefetch_hits = 0;   // first reads of a block read-ahead fetched (or was fetching)
};

// Fetches [offset, offset + out.size()) of the object into out (the S3 GetRange with If-Match,
// in the daemon; a fake in tests). Thread-safe; may fail (the error is returned to the reader,
// never cached).
using BlockFetch = std::function<absl::Status(uint64_t offset, std::span<std::byte> out)>;

class ObjectCache {
 public:
  // INVALID_ARGUMENT naming the option (cache_dir, cache_bytes, cache_block_bytes,
  // cache_read_ahead_blocks, cache_prefetch_threads); for a directory that cannot be made,
  // cleared or locked, the error names cache_dir and the path (FAILED_PRECONDITION when
  // another cache holds it).
  static absl::StatusOr<std::unique_ptr<ObjectCache>> Create(ObjectCacheOptions options);
  // Stops read-ahead (queued fetches are dropped, running ones finish). No Read may be running.
  ~ObjectCache();
  ObjectCache(const ObjectCache&) = delete;
  ObjectCache& operator=(const ObjectCache&) = delete;

  // Copies [offset, offset + dst.size()) of object `id`, of `size` bytes, into dst, each block
  // from the cache or fetched once with `fetch` (see above). OUT_OF_RANGE past `size`.
  // FAILED_PRECONDITION when a cached block of `id` has another length than `size` implies
  // (two readers disagree on the size of one version). On an error dst is partly written.
  //
  // `fetch` is taken by value: the cache keeps a copy (in a shared_ptr) for read-ahead, which
  // may call it after Read returns, until the fetch ends or the cache is destroyed. So what
  // it captures must stay valid that long (capture shared_ptrs, not references to the caller's
  // stack).
  absl::Status Read(const ObjectId& id, uint64_t size, uint64_t offset, std::span<std::byte> dst,
                    BlockFetch fetch);

  // One future read of block `block_index` of `id` at `next_use` (see Eviction above).
  void Hint(const ObjectId& id, uint64_t block_index, uint64_t next_use);
  // Fetches block `block_index` of `id` (of `size` bytes) in the background, as read-ahead
  // does (evicting no block needed sooner than its hint; dropped when the queue is full),
  // unless it is resident or being fetched. The reader's own order (a feed's permutation)
  // rather than the next blocks of the object.
  void Prefetch(const ObjectId& id, uint64_t size, uint64_t block_index, BlockFetch fetch);

  ObjectCacheStats stats() const;
  uint64_t block_bytes() const;

 private:
  class Impl;
  explicit ObjectCache(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpufeed::objstore
