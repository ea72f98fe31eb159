// A feed: one dataset and one sampling configuration, shared by every session that attaches
// with an equal key (the ranks of a job, and other jobs asking for the same stream). It owns
// the open dataset and the per-epoch permutations; sessions own their rings and cursors.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/os/file.h"
#include "server/auth/caller.h"
#include "server/feed/dataset_handles.h"
#include "server/feed/fingerprint.h"
#include "server/feed/lm_dataset.h"
#include "server/images/dataset.h"
#include "server/objstore/object_store.h"
#include "server/sampler/sampler.h"
#include "server/share/share_cache.h"

namespace gpufeed::server {

// What the daemon bounds per feed, whatever the request asks (docs/SECURITY.md §4; config
// fields max_samples_per_feed and max_image_bytes).
struct FeedLimits {
  // A dataset of more samples is refused at Attach (RESOURCE_EXHAUSTED naming both counts).
  uint64_t max_samples = uint64_t{1} << 40;
  // An image file larger than this is a bad sample, reason too_large, and is never read.
  uint64_t max_image_bytes = uint64_t{64} << 20;
  // An image of more pixels is a bad sample, too_large, refused from its header
  // (DatasetSpec::max_pixels; the request cannot set it).
  uint64_t max_image_pixels = 64'000'000;
  // Not a bound: how a random resized crop decodes a JPEG (DatasetSpec::region_decode).
  bool region_decode = true;
  // Not a bound: where the feed, its dataset and its sessions record (common/metrics.h; the
  // daemon's own); null: counters of the feed's own.
  std::shared_ptr<metrics::Counters> counters;
};

struct FeedSpec {
  DatasetSpec dataset;
  int64_t batch_size = 0;  // per rank
  int32_t world_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
  bool even = false;  // DistributedSampler's equal split per rank (sampler.h)
  // A sharing group's name (docs/ARCHITECTURE.md section 9), or empty. In a group the order
  // is the group's (order_seed()), while `seed` keys only this job's augmentation.
  std::string share_group;
  // An elastic resume mid-epoch at another global batch (SamplerConfig::resume_epoch; set by
  // session/elastic.h, never by a request): epoch resume_epoch is read from place
  // resume_base of its order. -1: none.
  int64_t resume_epoch = -1;
  uint64_t resume_base = 0;
  // A blend of token sources and/or document packing (lm_dataset.h); inactive by default.
  LmSpec lm;

  // The seed of the sample order: `seed`, or in a sharing group the group's (OrderSeedOf).
  uint64_t order_seed() const;
  // A canonical text of every field; equal specs give equal text.
  std::string Canonical() const;
};

// A sharing group's order seed: FNV-1a (64 bits) of "share_group:" and the group's name. The
// name alone fixes the order, so a job alone in its group reads what it reads beside others.
uint64_t OrderSeedOf(absl::string_view share_group);
// Where epoch `epoch`'s place `place` lies in a group's order across epochs: epoch x
// num_samples + place, saturated far below INT64_MAX.
int64_t OrderPosition(int64_t epoch, uint64_t num_samples, uint64_t place);

// One tensor of a slot: the per-rank batch of a sample tensor.
struct TensorLayout {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;  // [batch_size, ...sample shape]
  uint64_t byte_offset = 0;    // from the slot's start, 256-byte aligned
  uint64_t byte_size = 0;
  uint64_t row_bytes = 0;
};

struct SlotLayout {
  std::vector<TensorLayout> tensors;
  uint64_t used_bytes = 0;    // through the end of the last tensor
  uint64_t tensor_bytes = 0;  // the tensors' bytes, without alignment gaps: one batch's payload
  uint64_t stride_bytes = 0;  // page-aligned
};

// One batch's time budget (max_batch_time, docs/SECURITY.md section 4): a sample starts only
// while clock() is before `at`; past it the fill stops and returns DEADLINE_EXCEEDED naming
// the budget, so that a batch of much expensive work (hundreds of large images) ends its own
// session instead of holding the workers. Infinite `at` (the default): no budget.
struct FillDeadline {
  absl::Time at = absl::InfiniteFuture();
  Clock clock = RealClock();
  absl::Duration budget = absl::InfiniteDuration();  // for the message

  bool expired() const { return at != absl::InfiniteFuture() && clock() >= at; }
};

class Feed {
 public:
  // Opens the dataset and validates the sampling; errors name the field or path.
  // RESOURCE_EXHAUSTED when the dataset holds more than limits.max_samples samples. `key`:
  // the registry's (the spec and the dataset's device and inode); empty: FeedKeyOf(Canonical()).
  static absl::StatusOr<std::shared_ptr<Feed>> Create(FeedSpec spec, FileSystem* fs,
                                                      const FeedLimits& limits = {},
                                                      std::string key = "");

  const FeedSpec& spec() const { return spec_; }
  const std::string& key() const { return key_; }
  // What a saved position belongs to: the dataset's identity (path, size, mtime, samples,
  // the resolved token dtype) and every setting that shapes the sample order or the batches,
  // as "name=value;..." (values %-escaped). A position resumes only a feed of the same
  // fingerprint (CompareFingerprints).
  const std::string& fingerprint() const { return fingerprint_; }
  const Sampler& sampler() const { return *sampler_; }
  const Dataset& dataset() const { return *dataset_; }
  // dataset_ when the feed is a blend or packs documents, else null.
  const LmDataset* lm() const { return lm_; }
  const SlotLayout& layout() const { return layout_; }

  // Runs fn(0) .. fn(n-1), possibly on several threads, and returns when all are done.
  using ParallelFor = std::function<void(int n, const std::function<void(int)>& fn)>;

  // Reads `rank`'s slice of global batch `p` into the slot at `slot` (layout() bytes) and
  // writes its sample ids to `ids`; returns the number of valid (unpadded) rows. Batches of
  // more than kChunkBytes are read in chunks of rows through `parallel` when given: one
  // thread's memcpy from the page cache does not fill a PCIe link. An exception from a
  // dataset or an allocation (std::bad_alloc) is returned as a status, RESOURCE_EXHAUSTED or
  // INTERNAL (CallCatching), on whichever thread it was thrown: the session fails, not the
  // daemon. FillStaged likewise.
  // Each sample read marks progress on the calling thread (BusyMark::Progress: a slow batch
  // is no stall); past `deadline` the fill stops with DEADLINE_EXCEEDED (FillDeadline).
  // `share`: the session's place in its sharing group (null: none), whose cache the rows of
  // an image dataset look up first and offer their whole decodes to (share_cache.h).
  absl::StatusOr<int64_t> Fill(Position p, int32_t rank, std::byte* slot, std::span<int64_t> ids,
                               const ParallelFor& parallel = nullptr,
                               const FillDeadline& deadline = {},
                               ShareCache::Member* share = nullptr) const;
  static constexpr uint64_t kChunkBytes = uint64_t{2} << 20;

  // The staged layout of a slot (augment/staged.h) for the GPU paths; nullopt for datasets
  // without a staged form.
  const std::optional<StagedLayout>& staged_layout() const { return staged_layout_; }
  // As Fill, in staged form (`mode` kCpuDecode or kNvjpeg) into a slot of staged_layout():
  // one sample per task of `parallel`. kNvjpeg leaves the rows `cpu` takes (a share from
  // session/decode_share.h, the cheapest for the CPU: images/cpu_rows.h) to the CPU decoder.
  absl::StatusOr<int64_t> FillStaged(Position p, int32_t rank, StageMode mode, const CpuRows& cpu,
                                     std::byte* slot, std::span<int64_t> ids,
                                     const ParallelFor& parallel = nullptr,
                                     const FillDeadline& deadline = {},
                                     ShareCache::Member* share = nullptr) const;

  // What the jobs of a sharing group must agree on: the dataset (its display path, device,
  // inode and reader's rights, size and mtime, sample count, the decode's pixel cap) and the
  // order's shape (shuffle); the order seed is the group's own. `across_uids` (a group the
  // daemon lets several uids share): no display path and no reader's rights, and the exact
  // sample list's digest (ImageDataset::SampleListDigest) instead.
  std::string ShareIdentity(bool across_uids = false) const;
  // Where a member of a sharing group that reads global batch `p` next stands in the group's
  // order (OrderPosition): the batch's first place, or for an epoch's first batch the end of
  // the last batch before it (with drop_last the places past it are never read by this job).
  int64_t OrderCursor(Position p) const;

  int64_t batches_produced() const { return batches_produced_.load(std::memory_order_relaxed); }
  // Valid (unpadded) rows of those batches.
  int64_t samples_produced() const { return samples_produced_.load(std::memory_order_relaxed); }
  uint64_t bytes_produced() const { return bytes_produced_.load(std::memory_order_relaxed); }
  // Where the feed's work is recorded (FeedLimits::counters), its sessions' too.
  metrics::Counters& counters() const { return *spec_.dataset.counters; }

 private:
  // `identity`: "bytes=..;mtime_ns=.." of the dataset as opened ("" where there is none, as
  // in a test's fake file system), for the fingerprint.
  Feed(FeedSpec spec, std::string key, std::unique_ptr<Dataset> dataset,
       std::unique_ptr<Sampler> sampler,
       std::vector<std::pair<std::string, std::string>> identity);
  // An object store's dataset (docs/howto/object-storage.md): the samples `rank` reads
  // kReadHintSteps batches after `p`, hinted to the node's cache (Dataset::WillRead), which
  // fetches their blocks ahead and keeps blocks by their next use (the feed's order).
  void HintAhead(Position p, int32_t rank, size_t batch) const;
  absl::StatusOr<int64_t> FillImpl(Position p, int32_t rank, std::byte* slot,
                                   std::span<int64_t> ids, const ParallelFor& parallel,
                                   const FillDeadline& deadline, ShareCache::Member* share) const;
  absl::StatusOr<int64_t> FillStagedImpl(Position p, int32_t rank, StageMode mode,
                                         const CpuRows& cpu, std::byte* slot,
                                         std::span<int64_t> ids, const ParallelFor& parallel,
                                         const FillDeadline& deadline,
                                         ShareCache::Member* share) const;
  // The rank's sample ids of batch `p` (Sampler::RankSlice) and, with a share, the batch's
  // claim in the group's cache: one SharedRow a row, and each row's order position.
  struct Claimed {
    int64_t valid = 0;
    std::vector<SharedRow> rows;  // empty without a share
    std::vector<int64_t> at;
  };
  Claimed Claim(Position p, int32_t rank, std::span<int64_t> ids, ShareCache::Member* share) const;
  // Offers the whole decodes of a claimed batch's rows to the group.
  static void OfferDecoded(Claimed& claimed, std::span<const int64_t> ids,
                           ShareCache::Member* share);
  // Counts one batch filled, with `valid` real rows, in the produced counters.
  void CountProduced(int64_t valid) const;

  const FeedSpec spec_;
  const std::string key_;
  std::string fingerprint_;
  const std::vector<std::pair<std::string, std::string>> identity_;
  std::string MakeFingerprint() const;
  const std::unique_ptr<Dataset> dataset_;
  const ImageDataset* const images_;  // dataset_ when it is an image dataset, else null
  const LmDataset* const lm_;  // dataset_ when it is a blend or packs, else null
  const std::unique_ptr<Sampler> sampler_;
  SlotLayout layout_;
  std::optional<StagedLayout> staged_layout_;
  mutable std::atomic<int64_t> batches_produced_{0};
  mutable std::atomic<int64_t> samples_produced_{0};
  mutable std::atomic<uint64_t> bytes_produced_{0};
};

// How the registry lets callers at datasets (docs/SECURITY.md sections 2 and 4).
struct FeedAccessOptions {
  // Directories a dataset must lie beneath (its resolved path); empty: anywhere.
  std::vector<std::string> dataset_roots;
  DatasetHandleOptions handles;  // handles.lifetime: the daemon's attach_timeout
  FolderWalkLimits walk;         // walk.cancel is the registry's own (CancelOpens)
  // The node's object store (the daemon's --s3_endpoint); null: s3:// datasets refused.
  objstore::ObjectStore* object_store = nullptr;
};

// Feeds by key. Holds them weakly: a feed lives while a session uses it.
class FeedRegistry {
 public:
  // `clock` times the dataset handles' lifetime.
  explicit FeedRegistry(FileSystem* fs, FeedAccessOptions access = {},
                        const FeedLimits& limits = {}, Clock clock = RealClock());

  // The live feed with spec's key, or a new one, for `caller`: spec.dataset.handle names a
  // descriptor the caller passed (DatasetHandles::Take), read with the caller's rights; no
  // handle is an attach by path, for admins only (PERMISSION_DENIED "dataset.handle: ...").
  // The dataset must lie beneath a dataset_root when there are any. Feeds are shared by
  // (device, inode) of the dataset and the spec (path included: it stays the display name).
  // The dataset is opened outside the lock.
  absl::StatusOr<std::shared_ptr<Feed>> GetOrCreate(const FeedSpec& spec, const Caller& caller);
  // As above for an in-process caller with the daemon's rights (tests, benchmarks).
  absl::StatusOr<std::shared_ptr<Feed>> GetOrCreate(const FeedSpec& spec);
  std::vector<std::shared_ptr<Feed>> List() const;

  // The memory socket's open_dataset: checks that `fd` is a regular file or a directory and
  // keeps it for `from`'s uid, with the client's `lifeline` if any; returns the handle.
  absl::StatusOr<std::string> AddDatasetHandle(UniqueFd fd, const PeerCred& from,
                                               UniqueFd lifeline = UniqueFd());
  // The same for an s3:// dataset: the caller's access to the object store.
  absl::StatusOr<std::string> AddObjectStoreHandle(objstore::ObjectStoreAccess access,
                                                   const PeerCred& from,
                                                   UniqueFd lifeline = UniqueFd());
  // The lifeline that came with `uid`'s handle (DatasetHandles::TakeLifeline).
  UniqueFd TakeLifeline(const std::string& handle, uint32_t uid) {
    return handles_.TakeLifeline(handle, uid);
  }
  // Spends `uid`'s handle unused (an Attach refused before its dataset was opened): its
  // descriptor is closed. Unknown handles are ignored.
  void DropDatasetHandle(const std::string& handle, uint32_t uid) { (void)handles_.Take(handle, uid); }
  // Ends image_folder walks in progress (CANCELLED) and those to come: shutdown does not wait
  // for an attach that is walking a tree.
  void CancelOpens() { cancel_.store(true, std::memory_order_relaxed); }

 private:
  // Resolves the dataset's descriptor (a handle) or the admin's path, checks the roots, and
  // fills in the key's identity; `fd` owns the descriptor for the open.
  absl::Status Resolve(const Caller& caller, FeedSpec* spec, UniqueFd* fd, std::string* key) const;
  absl::StatusOr<std::shared_ptr<Feed>> GetOrCreateResolved(const FeedSpec& spec,
                                                            const std::string& key);

  FileSystem* const fs_;
  const FeedAccessOptions access_;
  const FeedLimits limits_;
  std::atomic<bool> cancel_{false};
  mutable DatasetHandles handles_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::weak_ptr<Feed>> feeds_ ABSL_GUARDED_BY(mu_);
};

// The stable, printable key of a canonical spec text (FNV-1a, 64 bits, hex).
std::string FeedKeyOf(const std::string& canonical);

}  // namespace gpufeed::server
