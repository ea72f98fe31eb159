#include "server/objstore/object_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <list>
#include <optional>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/os/fd.h"
#include "common/thread_pool.h"
#include "spdlog/spdlog.h"

namespace gpufeed::objstore {
namespace {

// Charges are block lengths rounded up to this: a file's allocation unit on common file
// systems, and it keeps a cache of tiny objects from holding millions of index entries.
constexpr uint64_t kChargeUnit = 4096;
// Pending reads kept per block (the soonest ones).
constexpr int kMaxPendingHints = 4;
constexpr uint64_t kNoHint = std::numeric_limits<uint64_t>::max();

constexpr absl::string_view kFilePrefix = "gpufeed-cache-";
constexpr absl::string_view kBlockSuffix = ".blk";
constexpr absl::string_view kTempSuffix = ".tmp";
constexpr absl::string_view kLockName = "gpufeed-cache.lock";
constexpr size_t kFileNumberDigits = 16;

uint64_t ChargeOf(uint64_t length) {
  return (length + kChargeUnit - 1) / kChargeUnit * kChargeUnit;
}

std::string ErrnoText(int err) { return std::strerror(err); }

std::string ObjectName(const ObjectId& id) {
  return absl::StrCat("s3://", id.bucket, "/", id.key, " (ETag ", id.etag,
                      id.endpoint.empty() ? "" : ", endpoint ", id.endpoint, ")");
}

// Whether `name` is one of the files a cache writes: prefix, 16 lowercase hex digits, and
// .blk or .tmp. The lock file is not one: it is never removed.
bool IsCacheFileName(absl::string_view name) {
  if (name.size() != kFilePrefix.size() + kFileNumberDigits + kBlockSuffix.size()) return false;
  if (name.substr(0, kFilePrefix.size()) != kFilePrefix) return false;
  absl::string_view digits = name.substr(kFilePrefix.size(), kFileNumberDigits);
  for (char c : digits) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  absl::string_view suffix = name.substr(kFilePrefix.size() + kFileNumberDigits);
  return suffix == kBlockSuffix || suffix == kTempSuffix;
}

std::string CacheFilePath(const std::string& dir, uint64_t number, absl::string_view suffix) {
  return absl::StrCat(dir, "/", kFilePrefix, absl::Hex(number, absl::kZeroPad16), suffix);
}

// mkdir -p with mode 0700 for every directory it makes.
absl::Status MakeDirectories(const std::string& dir) {
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    std::string prefix = dir.substr(0, pos);
    if (mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::FailedPreconditionError(
          absl::StrCat("cache_dir: cannot create ", prefix, ": ", ErrnoText(errno)));
    }
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(absl::StrCat("cache_dir: ", dir, ": ", ErrnoText(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cache_dir: ", dir, " is not a directory"));
  }
  return absl::OkStatus();
}

// Takes the directory's lock file, so that one cache at a time owns the directory.
absl::StatusOr<UniqueFd> LockDirectory(const std::string& dir) {
  std::string path = absl::StrCat(dir, "/", kLockName);
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache_dir: cannot open ", path, ": ", ErrnoText(errno)));
  }
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cache_dir: ", dir, " is in use by another object cache (", path, " is locked)"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cache_dir: cannot lock ", path, ": ", ErrnoText(errno)));
  }
  return fd;
}

// Removes the files of the cache's own naming in `dir`, and nothing else.
absl::Status RemoveCacheFiles(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cache_dir: cannot list ", dir, ": ", ErrnoText(errno)));
  }
  absl::Status status;
  while (struct dirent* entry = readdir(d)) {
    if (!IsCacheFileName(entry->d_name)) continue;
    if (unlinkat(dirfd(d), entry->d_name, 0) != 0 && errno != ENOENT) {
      status = absl::FailedPreconditionError(absl::StrCat("cache_dir: cannot remove ", dir, "/",
                                                          entry->d_name, ": ", ErrnoText(errno)));
      break;
    }
  }
  closedir(d);
  return status;
}

// Writes `data` to `temp`, then renames it to `final_path`: a block file is whole or absent.
absl::Status WriteBlockFile(const std::string& temp, const std::string& final_path,
                            std::span<const std::byte> data) {
  UniqueFd fd(open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) {
    return absl::InternalError(
        absl::StrCat("cache_dir: cannot create ", temp, ": ", ErrnoText(errno)));
  }
  absl::Status status;
  for (size_t done = 0; done < data.size();) {
    ssize_t n = pwrite(fd.get(), data.data() + done, data.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = absl::InternalError(absl::StrCat("cache_dir: writing ", temp, ": ",
                                                n < 0 ? ErrnoText(errno) : "wrote nothing"));
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (status.ok() && close(fd.Release()) != 0) {
    status = absl::InternalError(absl::StrCat("cache_dir: closing ", temp, ": ", ErrnoText(errno)));
  }
  if (status.ok() && rename(temp.c_str(), final_path.c_str()) != 0) {
    status =
        absl::InternalError(absl::StrCat("cache_dir: renaming ", temp, ": ", ErrnoText(errno)));
  }
  if (!status.ok()) unlink(temp.c_str());
  return status;
}

absl::Status ReadBlockFile(const std::string& path, uint64_t offset, std::span<std::byte> dst) {
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) {
    return absl::DataLossError(
        absl::StrCat("cache_dir: cannot open ", path, ": ", ErrnoText(errno)));
  }
  for (size_t done = 0; done < dst.size();) {
    ssize_t n =
        pread(fd.get(), dst.data() + done, dst.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat("cache_dir: reading ", path, ": ",
                                              n < 0 ? ErrnoText(errno) : "file is short"));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

// The index's types, named (not in an unnamed namespace) because ObjectCache::Impl, which has
// external linkage, holds them.
namespace object_cache_internal {

struct BlockKey {
  ObjectId id;
  uint64_t index = 0;

  friend bool operator==(const BlockKey&, const BlockKey&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const BlockKey& k) {
    return H::combine(std::move(h), k.id, k.index);
  }
};

// One fetch in flight; readers of the block wait for `done`. Guarded by Impl::mu_.
struct Flight {
  bool done = false;
  absl::Status status;
};

enum class State { kAbsent, kFetching, kResident };

// An index entry: a resident block, one being fetched, or an absent one that has pending
// hints or readers. Every field is guarded by Impl::mu_. A block lives in exactly one place:
// pinned (pins > 0: in no container, never evicted), in `evictable_` (resident, unpinned), or
// in `hinted_absent_` (absent, unpinned, with hints); an absent, unpinned block without hints
// is erased. Fields that order a container are changed only while the block is out of it
// (Detach, change, Settle).
struct Block {
  BlockKey key;
  uint64_t seq = 0;  // unique in this cache: the last tie-break of the eviction order
  State state = State::kAbsent;
  uint64_t length = 0;                // while fetching or resident
  uint64_t charge = 0;                // ditto
  std::unique_ptr<std::byte[]> data;  // memory mode, while resident
  uint64_t file_number = 0;           // disk mode: the file of the current fetch or residence
  std::shared_ptr<Flight> flight;     // while fetching
  int pins = 0;
  bool read_ahead_unused = false;  // fetched by read-ahead, not yet read
  uint64_t last_use = 0;
  uint64_t next_use = kNoHint;  // = pending[0], or kNoHint
  std::array<uint64_t, kMaxPendingHints> pending{};
  int num_pending = 0;
  std::optional<uint64_t> consumed_upto;  // the latest pending read a read consumed
  bool in_evictable = false;
  bool in_hinted_absent = false;
  std::list<Block*>::iterator hinted_absent_pos;
};

// Eviction order: farthest next use first, then least recently used.
struct EvictionOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->next_use != b->next_use) return a->next_use > b->next_use;
    if (a->last_use != b->last_use) return a->last_use < b->last_use;
    return a->seq < b->seq;
  }
};

// What eviction frees, released after the lock is dropped (no I/O under the lock).
struct Garbage {
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  std::vector<std::string> files;
  void Release() {
    buffers.clear();
    for (const std::string& f : files) unlink(f.c_str());
    files.clear();
  }
};

}  // namespace object_cache_internal

class ObjectCache::Impl {
  using Block = object_cache_internal::Block;
  using BlockKey = object_cache_internal::BlockKey;
  using EvictionOrder = object_cache_internal::EvictionOrder;
  using Flight = object_cache_internal::Flight;
  using Garbage = object_cache_internal::Garbage;
  using State = object_cache_internal::State;

 public:
  Impl(ObjectCacheOptions options, UniqueFd dir_lock)
      : options_(std::move(options)), dir_lock_(std::move(dir_lock)) {
    const uint64_t blocks = options_.capacity_bytes / options_.block_bytes;
    max_hinted_absent_ = std::clamp<uint64_t>(4 * blocks, 1024, uint64_t{1} << 20);
    if (options_.read_ahead_blocks > 0) {
      size_t queue = std::max<size_t>(16, 2 * static_cast<size_t>(options_.prefetch_threads) *
                                              static_cast<size_t>(options_.read_ahead_blocks));
      prefetch_ = std::make_unique<ThreadPool>("prefetch", options_.prefetch_threads, queue);
    }
  }

  ~Impl() {
    {
      absl::MutexLock lock(&mu_);
      shutting_down_ = true;
    }
    // Queued read-aheads see shutting_down_ and return; running fetches finish.
    if (prefetch_ != nullptr) prefetch_->Shutdown();
  }

  absl::Status Read(const ObjectId& id, uint64_t size, uint64_t offset, std::span<std::byte> dst,
                    BlockFetch fetch);
  void Hint(const ObjectId& id, uint64_t block_index, uint64_t next_use);
  void Prefetch(const ObjectId& id, uint64_t size, uint64_t index,
                const std::shared_ptr<const BlockFetch>& fetch);
  ObjectCacheStats stats() const {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  uint64_t block_bytes() const { return options_.block_bytes; }

 private:
  bool disk() const { return !options_.dir.empty(); }
  std::string BlockPath(uint64_t number) const {
    return CacheFilePath(options_.dir, number, kBlockSuffix);
  }

  absl::Status ReadBlock(const ObjectId& id, uint64_t size, uint64_t index, uint64_t in_block,
                         std::span<std::byte> dst, const std::shared_ptr<const BlockFetch>& fetch);
  absl::Status ReadThrough(const BlockFetch& fetch, uint64_t offset, std::span<std::byte> dst);
  // Fetches `b` (fetching, pinned by the caller, whose pin this ends), copies
  // [in_block, in_block + dst.size()) of it to dst, and makes it resident or absent.
  absl::Status FetchBlock(Block* b, uint64_t object_offset, uint64_t length, uint64_t file_number,
                          const BlockFetch& fetch, uint64_t in_block, std::span<std::byte> dst);
  void ScheduleReadAhead(const ObjectId& id, uint64_t size, uint64_t index,
                         const std::shared_ptr<const BlockFetch>& fetch);
  void ReadAhead(const ObjectId& id, uint64_t size, uint64_t index,
                 const std::shared_ptr<const BlockFetch>& fetch);

  // The block of `key`, created absent if missing, pinned.
  Block* Pin(const BlockKey& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unpin(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `b` out of the container it is in.
  void Detach(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts an unpinned `b` where its state says, or erases it: `b` may be gone after this.
  void Settle(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a read of the pinned `b` (hit or miss), consumes its soonest hint, marks it used.
  // Whether the read should start read-ahead (a miss, or the first use of a read-ahead block).
  bool CountRead(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts until `charge` more fits; with `read_ahead_next_use`, only if that evicts no block
  // used sooner (and otherwise evicts nothing). Whether it fits now.
  bool MakeRoom(uint64_t charge, std::optional<uint64_t> read_ahead_next_use, Garbage& garbage)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Evict(Block* b, Garbage& garbage) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartFetch(Block* b, uint64_t length, uint64_t charge, bool read_ahead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ObjectCacheOptions options_;
  const UniqueFd dir_lock_;  // held for the cache's life (disk mode)
  uint64_t max_hinted_absent_ = 0;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<BlockKey, std::unique_ptr<Block>> blocks_ ABSL_GUARDED_BY(mu_);
  std::set<Block*, EvictionOrder> evictable_ ABSL_GUARDED_BY(mu_);
  std::list<Block*> hinted_absent_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint64_t charged_ ABSL_GUARDED_BY(mu_) = 0;             // resident and fetching blocks' charges
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_file_number_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  ObjectCacheStats stats_ ABSL_GUARDED_BY(mu_);

  std::unique_ptr<ThreadPool> prefetch_;  // null without read-ahead
};

auto ObjectCache::Impl::Pin(const BlockKey& key) -> Block* {
  auto [it, inserted] = blocks_.try_emplace(key);
  if (inserted) {
    it->second = std::make_unique<Block>();
    it->second->key = key;
    it->second->seq = next_seq_++;
  }
  Block* b = it->second.get();
  Detach(b);
  ++b->pins;
  return b;
}

void ObjectCache::Impl::Unpin(Block* b) {
  --b->pins;
  Settle(b);
}

void ObjectCache::Impl::Detach(Block* b) {
  if (b->in_evictable) {
    evictable_.erase(b);
    b->in_evictable = false;
  }
  if (b->in_hinted_absent) {
    hinted_absent_.erase(b->hinted_absent_pos);
    b->in_hinted_absent = false;
  }
}

void ObjectCache::Impl::Settle(Block* b) {
  if (b->pins > 0) return;
  if (b->state == State::kResident) {
    evictable_.insert(b);
    b->in_evictable = true;
    return;
  }
  // Absent: a fetching block is always pinned by its fetcher.
  if (b->num_pending == 0) {
    blocks_.erase(blocks_.find(b->key));
    return;
  }
  b->hinted_absent_pos = hinted_absent_.insert(hinted_absent_.end(), b);
  b->in_hinted_absent = true;
  while (hinted_absent_.size() > max_hinted_absent_) {
    Block* oldest = hinted_absent_.front();
    hinted_absent_.pop_front();
    blocks_.erase(blocks_.find(oldest->key));
  }
}

bool ObjectCache::Impl::CountRead(Block* b) {
  bool read_ahead = b->state != State::kResident;
  if (read_ahead) {
    ++stats_.misses;
  } else {
    ++stats_.hits;
  }
  if (b->read_ahead_unused) {
    ++stats_.prefetch_hits;
    b->read_ahead_unused = false;
    read_ahead = true;
  }
  if (b->num_pending > 0) {
    b->consumed_upto = b->pending[0];
    std::copy(b->pending.data() + 1, b->pending.data() + b->num_pending, b->pending.data());
    --b->num_pending;
    b->next_use = b->num_pending > 0 ? b->pending[0] : kNoHint;
  }
  b->last_use = ++clock_;
  return read_ahead;
}

bool ObjectCache::Impl::MakeRoom(uint64_t charge, std::optional<uint64_t> read_ahead_next_use,
                                 Garbage& garbage) {
  const uint64_t capacity = options_.capacity_bytes;
  if (charge > capacity) return false;
  if (charged_ + charge <= capacity) return true;
  // Check first, so that a room that cannot be made evicts nothing.
  const uint64_t need = charged_ + charge - capacity;
  uint64_t freeable = 0;
  for (const Block* victim : evictable_) {
    if (read_ahead_next_use.has_value() && victim->next_use < *read_ahead_next_use) return false;
    freeable += victim->charge;
    if (freeable >= need) break;
  }
  if (freeable < need) return false;
  while (charged_ + charge > capacity) {
    Evict(*evictable_.begin(), garbage);
    ++stats_.evictions;
  }
  return true;
}

void ObjectCache::Impl::Evict(Block* b, Garbage& garbage) {
  Detach(b);
  charged_ -= b->charge;
  stats_.resident_bytes -= b->charge;
  if (disk()) {
    garbage.files.push_back(BlockPath(b->file_number));
  } else {
    garbage.buffers.push_back(std::move(b->data));
  }
  b->state = State::kAbsent;
  b->read_ahead_unused = false;
  Settle(b);
}

void ObjectCache::Impl::StartFetch(Block* b, uint64_t length, uint64_t charge, bool read_ahead) {
  b->state = State::kFetching;
  b->length = length;
  b->charge = charge;
  charged_ += charge;
  b->flight = std::make_shared<Flight>();
  b->file_number = ++next_file_number_;
  b->read_ahead_unused = read_ahead;
  ++stats_.fetches;
  if (read_ahead) {
    ++stats_.prefetches;
    b->last_use = ++clock_;
  }
}

absl::Status ObjectCache::Impl::Read(const ObjectId& id, uint64_t size, uint64_t offset,
                                     std::span<std::byte> dst, BlockFetch fetch) {
  if (offset > size || dst.size() > size - offset) {
    return absl::OutOfRangeError(absl::StrCat("reading [", offset, ", ", offset + dst.size(),
                                              ") of ", ObjectName(id), ": past its end at ", size));
  }
  if (dst.empty()) return absl::OkStatus();
  auto shared_fetch = std::make_shared<const BlockFetch>(std::move(fetch));
  const uint64_t block = options_.block_bytes;
  const uint64_t end = offset + dst.size();
  for (uint64_t pos = offset; pos < end;) {
    const uint64_t index = pos / block;
    const uint64_t in_block = pos - index * block;
    const uint64_t n = std::min(block - in_block, end - pos);
    absl::Status s =
        ReadBlock(id, size, index, in_block, dst.subspan(pos - offset, n), shared_fetch);
    if (!s.ok()) return s;
    pos += n;
  }
  return absl::OkStatus();
}

absl::Status ObjectCache::Impl::ReadBlock(const ObjectId& id, uint64_t size, uint64_t index,
                                          uint64_t in_block, std::span<std::byte> dst,
                                          const std::shared_ptr<const BlockFetch>& fetch) {
  const uint64_t object_offset = index * options_.block_bytes;
  const uint64_t length = std::min(options_.block_bytes, size - object_offset);
  const BlockKey key{id, index};
  bool counted = false;
  bool read_ahead = false;
  int copy_failures = 0;
  int others_failed = 0;  // fetches by another reader this one waited for, that failed
  while (true) {
    enum class Next { kCopy, kWait, kFetch, kReadThrough } next = Next::kCopy;
    Block* b = nullptr;
    std::shared_ptr<Flight> flight;
    uint64_t file_number = 0;
    const std::byte* data = nullptr;
    Garbage garbage;
    {
      absl::MutexLock lock(&mu_);
      b = Pin(key);
      if (b->state != State::kAbsent && b->length != length) {
        uint64_t cached = b->length;
        Unpin(b);
        return absl::FailedPreconditionError(
            absl::StrCat("reading block ", index, " of ", ObjectName(id), " as an object of ", size,
                         " bytes: the cache holds it as ", cached,
                         " bytes long (readers disagree on its size)"));
      }
      if (!counted) {
        counted = true;
        read_ahead = CountRead(b);
      }
      switch (b->state) {
        case State::kResident:
          next = Next::kCopy;
          file_number = b->file_number;
          data = b->data.get();
          break;
        case State::kFetching:
          next = Next::kWait;
          flight = b->flight;
          break;
        case State::kAbsent:
          if (MakeRoom(ChargeOf(length), std::nullopt, garbage)) {
            next = Next::kFetch;
            StartFetch(b, length, ChargeOf(length), /*read_ahead=*/false);
            file_number = b->file_number;
          } else {
            next = Next::kReadThrough;
            ++stats_.fetches;
            Unpin(b);
            b = nullptr;
          }
          break;
      }
    }
    garbage.Release();
    if (std::exchange(read_ahead, false)) ScheduleReadAhead(id, size, index, fetch);

    switch (next) {
      case Next::kReadThrough:
        return ReadThrough(*fetch, object_offset + in_block, dst);
      case Next::kFetch:
        return FetchBlock(b, object_offset, length, file_number, *fetch, in_block, dst);
      case Next::kWait: {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&flight->done));
        if (b->state != State::kResident) {
          // Fetched but not cached: go again. Failed: that was another reader's fetch, with
          // its own credentials (expired, revoked) or its read-ahead: this reader fetches once
          // itself before it takes the error as its own. Only what is the version's, not the
          // reader's, is shared at once: the object changed, or is shorter.
          Unpin(b);
          if (!flight->status.ok() && (absl::IsFailedPrecondition(flight->status) ||
                                       absl::IsOutOfRange(flight->status) || ++others_failed > 1)) {
            return flight->status;
          }
          continue;
        }
        file_number = b->file_number;
        data = b->data.get();
        break;
      }
      case Next::kCopy:
        break;
    }

    // `b` is resident and pinned: neither evicted nor changed until unpinned.
    absl::Status s;
    if (disk()) {
      s = ReadBlockFile(BlockPath(file_number), in_block, dst);
    } else {
      std::memcpy(dst.data(), data + in_block, dst.size());
    }
    {
      absl::MutexLock lock(&mu_);
      if (!s.ok() && b->state == State::kResident && b->file_number == file_number) {
        // Its file is gone or short (removed by hand?): drop it and fetch it again.
        Evict(b, garbage);
      }
      Unpin(b);
    }
    garbage.Release();
    if (s.ok() || ++copy_failures > 1) return s;
  }
}

absl::Status ObjectCache::Impl::ReadThrough(const BlockFetch& fetch, uint64_t offset,
                                            std::span<std::byte> dst) {
  absl::Status s = CallCatching("fetching an object range", [&] { return fetch(offset, dst); });
  if (s.ok()) {
    absl::MutexLock lock(&mu_);
    stats_.fetched_bytes += dst.size();
  }
  return s;
}

absl::Status ObjectCache::Impl::FetchBlock(Block* b, uint64_t object_offset, uint64_t length,
                                           uint64_t file_number, const BlockFetch& fetch,
                                           uint64_t in_block, std::span<std::byte> dst) {
  std::unique_ptr<std::byte[]> buffer;
  // An exception from the fetch (or the allocation) must still end the flight, or its waiters
  // would wait forever.
  absl::Status s = CallCatching("fetching an object block", [&] {
    buffer.reset(new std::byte[length]);
    return fetch(object_offset, std::span<std::byte>(buffer.get(), length));
  });
  bool cached = s.ok();
  if (s.ok()) {
    if (!dst.empty()) std::memcpy(dst.data(), buffer.get() + in_block, dst.size());
    if (disk()) {
      absl::Status w =
          WriteBlockFile(CacheFilePath(options_.dir, file_number, kTempSuffix),
                         BlockPath(file_number), std::span<const std::byte>(buffer.get(), length));
      if (!w.ok()) {
        cached = false;  // the reader has its bytes; the block is just not kept
        spdlog::warn("object cache: {}; the block is served but not cached",
                     std::string(w.message()));
      }
    }
  }
  absl::MutexLock lock(&mu_);
  b->flight->status = s;
  b->flight->done = true;
  b->flight.reset();
  if (s.ok()) stats_.fetched_bytes += length;
  if (cached) {
    b->state = State::kResident;
    if (!disk()) b->data = std::move(buffer);
    stats_.resident_bytes += b->charge;
  } else {
    b->state = State::kAbsent;
    charged_ -= b->charge;
    b->read_ahead_unused = false;
  }
  Unpin(b);
  return s;
}

void ObjectCache::Impl::ScheduleReadAhead(const ObjectId& id, uint64_t size, uint64_t index,
                                          const std::shared_ptr<const BlockFetch>& fetch) {
  if (prefetch_ == nullptr) return;
  const uint64_t blocks = (size + options_.block_bytes - 1) / options_.block_bytes;
  const uint64_t last =
      std::min<uint64_t>(blocks - 1, index + static_cast<uint64_t>(options_.read_ahead_blocks));
  std::vector<uint64_t> wanted;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    for (uint64_t i = index + 1; i <= last; ++i) {
      auto it = blocks_.find(BlockKey{id, i});
      if (it == blocks_.end() || it->second->state == State::kAbsent) wanted.push_back(i);
    }
  }
  for (uint64_t i : wanted) {
    // A full queue drops the read-ahead: the reader will fetch the block when it gets there.
    if (!prefetch_->TrySubmit([this, id, size, i, fetch] { ReadAhead(id, size, i, fetch); }).ok()) {
      break;
    }
  }
}

void ObjectCache::Impl::ReadAhead(const ObjectId& id, uint64_t size, uint64_t index,
                                  const std::shared_ptr<const BlockFetch>& fetch) {
  const uint64_t object_offset = index * options_.block_bytes;
  const uint64_t length = std::min(options_.block_bytes, size - object_offset);
  const BlockKey key{id, index};
  Block* b = nullptr;
  uint64_t file_number = 0;
  Garbage garbage;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    auto it = blocks_.find(key);
    if (it != blocks_.end() && it->second->state != State::kAbsent) return;  // a reader was first
    b = Pin(key);
    if (!MakeRoom(ChargeOf(length), b->next_use, garbage)) {
      Unpin(b);
      return;
    }
    StartFetch(b, length, ChargeOf(length), /*read_ahead=*/true);
    file_number = b->file_number;
  }
  garbage.Release();
  // Its error reaches the readers waiting on it; nobody else is asking.
  FetchBlock(b, object_offset, length, file_number, *fetch, 0, {}).IgnoreError();
}

void ObjectCache::Impl::Prefetch(const ObjectId& id, uint64_t size, uint64_t index,
                                 const std::shared_ptr<const BlockFetch>& fetch) {
  if (prefetch_ == nullptr) return;
  if (index >= (size + options_.block_bytes - 1) / options_.block_bytes) return;
  {
    absl::MutexLock lock(&mu_);
    if (shutting_down_) return;
    auto it = blocks_.find(BlockKey{id, index});
    if (it != blocks_.end() && it->second->state != State::kAbsent) return;
  }
  // A full queue drops it: the reader fetches the block when it gets there.
  (void)prefetch_->TrySubmit([this, id, size, index, fetch] { ReadAhead(id, size, index, fetch); });
}

void ObjectCache::Impl::Hint(const ObjectId& id, uint64_t block_index, uint64_t next_use) {
  absl::MutexLock lock(&mu_);
  Block* b = Pin(BlockKey{id, block_index});
  uint64_t* begin = b->pending.data();
  uint64_t* end = begin + b->num_pending;
  const bool stale = b->consumed_upto.has_value() && next_use <= *b->consumed_upto;
  if (!stale && std::find(begin, end, next_use) == end) {
    uint64_t* at = std::upper_bound(begin, end, next_use);
    if (b->num_pending < kMaxPendingHints) {
      std::copy_backward(at, end, end + 1);
      *at = next_use;
      ++b->num_pending;
    } else if (at != end) {  // full: the latest pending read gives way
      std::copy_backward(at, end - 1, end);
      *at = next_use;
    }
    b->next_use = b->pending[0];
  }
  Unpin(b);
}

absl::StatusOr<std::unique_ptr<ObjectCache>> ObjectCache::Create(ObjectCacheOptions options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("cache_bytes: must be > 0");
  }
  if (options.block_bytes == 0) {
    return absl::InvalidArgumentError("cache_block_bytes: must be > 0");
  }
  if (options.read_ahead_blocks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_read_ahead_blocks: must be >= 0, not ", options.read_ahead_blocks));
  }
  if (options.read_ahead_blocks > 0 && options.prefetch_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cache_prefetch_threads: must be >= 1 with read-ahead, not ", options.prefetch_threads));
  }
  UniqueFd dir_lock;
  if (!options.dir.empty()) {
    while (options.dir.size() > 1 && options.dir.back() == '/') options.dir.pop_back();
    if (absl::Status s = MakeDirectories(options.dir); !s.ok()) return s;
    // Every tenant's reads are served from the block files in it: no one but the daemon may
    // write there (a block swapped in would reach every reader).
    struct stat st {};
    if (::stat(options.dir.c_str(), &st) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cache_dir: ", options.dir, ": ", std::strerror(errno)));
    }
    if (st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cache_dir: ", options.dir, " is owned by uid ", st.st_uid, " with mode ",
          absl::StrFormat("%04o", st.st_mode & 07777), ": the cache wants a directory of its own ",
          "uid (", ::geteuid(), ") that no group or other user may write"));
    }
    absl::StatusOr<UniqueFd> lock = LockDirectory(options.dir);
    if (!lock.ok()) return lock.status();
    dir_lock = std::move(*lock);
    if (absl::Status s = RemoveCacheFiles(options.dir); !s.ok()) return s;
  }
  return std::unique_ptr<ObjectCache>(
      new ObjectCache(std::make_unique<Impl>(std::move(options), std::move(dir_lock))));
}

ObjectCache::ObjectCache(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ObjectCache::~ObjectCache() = default;

absl::Status ObjectCache::Read(const ObjectId& id, uint64_t size, uint64_t offset,
                               std::span<std::byte> dst, BlockFetch fetch) {
  return impl_->Read(id, size, offset, dst, std::move(fetch));
}

void ObjectCache::Hint(const ObjectId& id, uint64_t block_index, uint64_t next_use) {
  impl_->Hint(id, block_index, next_use);
}

void ObjectCache::Prefetch(const ObjectId& id, uint64_t size, uint64_t block_index,
                           BlockFetch fetch) {
  impl_->Prefetch(id, size, block_index, std::make_shared<const BlockFetch>(std::move(fetch)));
}

ObjectCacheStats ObjectCache::stats() const { return impl_->stats(); }

uint64_t ObjectCache::block_bytes() const { return impl_->block_bytes(); }

}  // namespace gpufeed::objstore
