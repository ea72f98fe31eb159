// Language-model feeds: a weighted blend of token sources, document packing, or both, served
// as one Dataset (docs/howto/blends-and-packing.md). The order arithmetic is the sampler
// folder's (Blend, PackBestFit); this file reads the sources' tokens by it.
//
// The feed's sampler walks this dataset's rows in order (no shuffle of its own: each source
// is shuffled by its own permutation inside the blend), and row `id` of epoch e is row
// e x num_samples() + id of one endless stream:
// - unpacked: stream row T is blended sample T (Blend::At): one window of seq_len + 1 tokens
//   of one source, as a plain token feed's sample; its reported id is the union id
//   (offset_k + the source's window); num_samples() is the sources' windows together;
// - packed: the blend's picks are documents; the stream of picks is cut into groups of
//   `lookahead` picks (concat: 1,024), best_fit packs each group on its own (PackBestFit),
//   concat lays the documents end to end across groups; a row's reported id is its stream
//   row number; num_samples() is a nominal epoch, the sources' tokens / (seq_len + 1)
//   (concat: (tokens - 1) / seq_len). Each source's documents are delivered once per that
//   source's own epoch, across the nominal epochs' edges.
// Packed rows carry four tensors, the first three of the row's width seq_len + 1 (a trainer
// takes [:-1] of tokens, position_ids and loss_mask as inputs, [1:] of tokens as labels):
// `tokens`, `position_ids` (int32, 0.. restarting at each piece of a document; padding counts
// as a sequence of its own), `loss_mask` (uint8, 1 on document tokens, 0 on padding) and
// `cu_seqlens` (int32, FlashAttention's varlen boundaries over the first seq_len tokens: 0,
// each piece's end, then seq_len repeated to its width; that width is not the row's but the
// most pieces a row of these documents can hold plus 2, at most the row's: RowPiecesBound).
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/byte_budget.h"
#include "common/os/file.h"
#include "server/images/dataset.h"
#include "server/reader/dataset.h"
#include "server/sampler/blend.h"
#include "server/sampler/pack.h"

namespace gpufeed::server {

class WalkBudget;

enum class PackMode { kNone = 0, kConcat = 1, kBestFit = 2 };
const char* PackModeName(PackMode mode);

// Bounds on a request's blend (the socket is a trust boundary).
inline constexpr size_t kMaxLmSources = 256;
inline constexpr uint64_t kMaxPackLookahead = 1 << 14;
inline constexpr size_t kMaxBlendHistory = 1024;  // segments: weight changes of one run
// The widest packed row: position_ids and cu_seqlens are int32.
inline constexpr int64_t kMaxPackedSeqLen = int64_t{1} << 30;
// The pieces one best_fit group may make (lookahead x the longest document's rows): about
// 100 MB of pieces, so that a group's packing is bounded whatever the documents.
inline constexpr uint64_t kMaxGroupPieces = uint64_t{1} << 22;

struct LmSourceSpec {
  // Absolute paths beneath the dataset's directory (as FileDatasetSpec::paths).
  std::vector<std::string> paths;
  double weight = 1.0;
  std::string name;  // as the user named it, for messages
};

struct LmSpec {
  // Empty: the dataset itself (its path, paths or pattern) is the only source.
  std::vector<LmSourceSpec> sources;
  PackMode pack = PackMode::kNone;
  std::optional<int64_t> eos_id;
  uint64_t lookahead = 0;  // best_fit; 0: kDefaultPackLookahead
  // The segments of the run this one resumes (AttachResponse.blend_segments it was given).
  std::vector<BlendSegment> history;
  // Set by Attach from the resume's position, only where the weights differ from the
  // history's last: the epoch and global samples at which the new weights take over.
  int64_t change_epoch = -1;
  uint64_t change_samples = 0;

  bool active() const { return !sources.empty() || pack != PackMode::kNone; }
  // The weights asked for, one per source (one 1.0 without sources).
  std::vector<double> weights() const;
  // Whether a resume changes the weights: a history whose last segment's weights differ.
  bool changes_weights() const;
  // A canonical text of every field (part of the feed's key).
  std::string Canonical() const;
  // INVALID_ARGUMENT naming the field: too many sources, a source without paths, a weight
  // not finite or <= 0 (or weights whose sum is not finite), sources beside the dataset's own
  // `paths`, a lookahead past kMaxPackLookahead, eos_id out of [0, 2^32) or without a pack
  // mode, a history of another source count or of more than kMaxBlendHistory segments.
  // Before anything is opened.
  absl::Status Validate(const FileDatasetSpec& dataset) const;
};

class LmDataset final : public Dataset {
 public:
  // Opens every source as a tokens dataset of `dataset` (its directory, token_dtype,
  // seq_len, vocab_size), each from its own paths; with a pack mode, their documents.
  // `seed` and `shuffle` are the feed's: each source's permutation is keyed by them.
  static absl::StatusOr<std::unique_ptr<LmDataset>> Open(const DatasetSpec& dataset,
                                                         const LmSpec& lm, uint64_t seed,
                                                         bool shuffle, FileSystem* fs);
  ~LmDataset() override;

  uint64_t num_samples() const override { return rows_; }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }
  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override;
  absl::StatusOr<uint64_t> ReadSampleAt(uint64_t id, const SampleContext& context,
                                        std::span<const std::span<std::byte>> rows) const override;
  absl::Status CheckNotShrunk() const override;
  absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const override;
  std::vector<DatasetNotice> notices() const override { return notices_; }

  // Stream row of place `place` of nominal epoch `epoch`; OUT_OF_RANGE past the stream's end
  // (2^62 rows, and a packed row's first token below 2^62).
  absl::StatusOr<uint64_t> StreamRow(int64_t epoch, uint64_t place) const;
  // Packs (or, unpacked, replays the blend) up to stream row `row`, a group at a time and
  // outside the lock between groups, within the attach-time scan's limits (the dataset's
  // FolderWalkLimits: DEADLINE_EXCEEDED past its timeout, CANCELLED at shutdown): what a
  // session starting at `row` needs before its first fill, so that fills only ever pack the
  // next groups.
  absl::Status Reach(uint64_t row) const ABSL_LOCKS_EXCLUDED(mu_);

  // The segments in force (AttachResponse.blend_segments).
  const std::vector<BlendSegment>& segments() const { return blend_->spec().segments; }
  // For the fingerprint: the sources (names, files, their identity and sizes), the pack mode,
  // and the first segment's weights (a resume that lost its history changes them).
  std::string Identity() const;

  // What the stream packed so far holds (each group counted once, when first packed).
  struct Stats {
    uint64_t rows = 0, row_tokens = 0, pad_tokens = 0, documents = 0, truncated_documents = 0;
    std::vector<uint64_t> source_tokens;  // document tokens packed, per source
    // Groups placed in the stream (stats() counts them from the prefix tables), and groups
    // packed again: placed, evicted from the cache and needed again (ranks or sessions
    // reading far apart).
    uint64_t groups = 0, groups_again = 0;
    // The most groups packed at once so far: at most kGroupsPacking.
    uint64_t packing_peak = 0;
  };
  Stats stats() const;
  const std::vector<std::string>& source_names() const { return names_; }
  // Ahead workers a feed: four. Packing is the packed feed's pace (two packed ~470k rows/s on
  // the H100 machine's cores, under the plain feed's ~620k); one may fill a chunk (~12 ms)
  // while others pack.
  static constexpr int kAheadWorkers = 4;
  // The daemon's lm-ahead threads at most, all feeds together: 16 feeds' workers. A feed
  // opened past it gets fewer (none) and packs on its fill threads.
  static constexpr int kMaxAheadThreads = 64;
  // Of those, the most the feeds one uid opened may hold (8 feeds' workers), so that another
  // uid's packed feed finds workers however many feeds one user opens; an admin's feeds
  // (dataset.walk.charge_uid unset) count in the process's bound only.
  static constexpr int kMaxAheadThreadsPerUid = kMaxAheadThreads / 2;
  // The lm-ahead threads running in this process, every LmDataset's; those of `uid`'s feeds.
  static int AheadThreads();
  static int AheadThreadsOf(uint32_t uid);
  // This dataset's own (kAheadWorkers, or fewer past kMaxAheadThreads or its uid's
  // kMaxAheadThreadsPerUid, topped up as other datasets end and this one's rows find the
  // workers behind).
  int ahead_workers() const ABSL_LOCKS_EXCLUDED(ahead_mu_);

 private:
  struct Source;
  struct Group;
  LmDataset() = default;

  // Stream row `row`'s pieces (each piece's `document` is its pick's index in the stream)
  // and their picks, into `pieces` and `picks` (cleared first). Wakes the ahead workers when
  // the groups after the row's are not all packed or being packed. Returns the last group
  // the row reads (concat: a row may run into the next).
  uint64_t RowPieces(uint64_t row, std::vector<PackPiece>* pieces,
                     std::vector<BlendPick>* picks) const ABSL_LOCKS_EXCLUDED(mu_);
  // Pick t of the stream, from its chunk (filled once, by one thread; others wait for it).
  BlendPick PickAt(uint64_t t) const ABSL_LOCKS_EXCLUDED(chunk_mu_);
  // Chunk c of picks: kept, or filled by this thread, or waited for while another fills it.
  std::shared_ptr<const std::vector<BlendPick>> ChunkOf(uint64_t c) const
      ABSL_LOCKS_EXCLUDED(chunk_mu_);
  // Fills chunk c of picks unless it is cached or being filled; whether this thread did.
  bool FillChunkAhead(uint64_t c) const ABSL_LOCKS_EXCLUDED(chunk_mu_);
  // Fills chunk c, claimed by this thread, and keeps it.
  std::shared_ptr<const std::vector<BlendPick>> FillChunk(uint64_t c) const
      ABSL_LOCKS_EXCLUDED(chunk_mu_);
  uint64_t DocLength(const BlendPick& pick) const;
  // Stream row `row`'s pieces need more cu_seqlens entries than cu_width_: FAILED_PRECONDITION
  // under a blend_history (one this feed did not write), else INTERNAL.
  absl::Status CuWidthExceeded(uint64_t row, size_t pieces) const;
  // Group g's picks and packing, computed with no lock held.
  std::shared_ptr<const Group> MakeGroup(uint64_t g) const ABSL_LOCKS_EXCLUDED(mu_);
  // Group g: cached, or packed by this thread outside the lock, or waited for while another
  // packs it (one thread packs a group). Placed in the tables once the groups before it are.
  std::shared_ptr<const Group> GroupAt(uint64_t g) const ABSL_LOCKS_EXCLUDED(mu_);
  // Keeps group g (being packed by this thread, now done), places it and every group after it
  // already kept, and evicts placed groups past kCachedGroups.
  void KeepLocked(uint64_t g, std::shared_ptr<const Group> group) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Packs group g, claimed by this thread, and keeps it.
  std::shared_ptr<const Group> PackClaimed(uint64_t g) const ABSL_LOCKS_EXCLUDED(mu_);
  // Marks group g as being packed by this thread (packing_, and the peak in stats_).
  void ClaimLocked(uint64_t g) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Claims the first of groups g + 1 .. g + kPackAhead neither kept nor being packed;
  // nullopt when all are, when kGroupsPacking are being packed, or when g is no longer a
  // reading front.
  std::optional<uint64_t> ClaimAheadLocked(uint64_t g) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_)
      ABSL_LOCKS_EXCLUDED(ahead_mu_);
  // Whether `f` is one of the reading fronts now.
  bool IsFront(uint64_t f) const ABSL_LOCKS_EXCLUDED(ahead_mu_);
  bool IsFrontLocked(uint64_t f) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(ahead_mu_);
  // A row read from group `g` (packed) or chunk `g` of picks (a blend of windows) and found
  // what should be ready after it missing: records `g` as a reading front (the last
  // kAheadFronts kept: ranks or sessions of one feed may read apart) and wakes the workers.
  // `moved_from`: a front of the caller's own that `g` replaces (Reach moving along).
  void Reached(uint64_t g, std::optional<uint64_t> moved_from = std::nullopt) const
      ABSL_LOCKS_EXCLUDED(ahead_mu_);
  // Starts ahead workers up to kAheadWorkers, as many as the process's kMaxAheadThreads and
  // the uid's kMaxAheadThreadsPerUid allow; (this dataset's workers now, the process's count
  // before).
  std::pair<int, int> StartAheadWorkersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(ahead_mu_);
  // An ahead worker: for each front, packs the kPackAhead groups after it and fills the chunk
  // of picks after theirs (a blend of windows: the chunk after the front), each claimed as a
  // fill thread would claim it, until the destructor stops it.
  void AheadLoop() const ABSL_LOCKS_EXCLUDED(ahead_mu_, mu_, chunk_mu_);
  // One piece of ahead work for front `f` claimed and done; false when there was none.
  bool AheadStep(uint64_t f) const ABSL_LOCKS_EXCLUDED(mu_, chunk_mu_);
  // Places groups until group_tokens_ (by_rows: group_rows_) passes `value`, packing them
  // where need be, polling `budget` between groups when given, and charging the prefix
  // tables as they grow then (ChargeTables).
  absl::Status PlaceThrough(bool by_rows, uint64_t value, const WalkBudget* budget = nullptr) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Grows charge_ to Open's part and the placed groups' prefix tables as allocated now
  // (tables_charged_ then says how many): RESOURCE_EXHAUSTED past max_index_bytes or the
  // uid's share, for reaching `value` (Reach's, or a row's that found the tables grown).
  absl::Status ChargeTables(bool by_rows, uint64_t value) const
      ABSL_LOCKS_EXCLUDED(mu_, charge_mu_);
  // The group holding `value` (the last whose start is <= value), placed first.
  uint64_t GroupHolding(bool by_rows, uint64_t value) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReadPiece(const BlendPick& pick, uint64_t offset, uint64_t length,
                         std::byte* out) const;
  // The pick at which new weights may start for a resume at stream row `row`: the first the
  // rows before it have not touched.
  uint64_t ChangePoint(uint64_t row) const;
  void ResetCaches();

  std::vector<std::unique_ptr<Source>> sources_;
  std::vector<std::string> names_;
  std::unique_ptr<Blend> blend_;
  PackMode pack_ = PackMode::kNone;
  uint64_t seq_len_ = 0;
  uint64_t group_picks_ = 0;  // picks per group (packed)
  // Packed: cu_seqlens' entries (RowPiecesBound's + 2, at most the width).
  uint64_t cu_width_ = 0;
  uint64_t token_bytes_ = 2;
  uint64_t rows_ = 0;  // num_samples(): one nominal epoch
  std::vector<SampleTensor> tensors_;
  std::vector<DatasetNotice> notices_;
  FolderWalkLimits limits_;  // the attach-time scans' bounds (Reach)
  std::string display_;      // the dataset, as messages name it
  // The document tables and Megatron sequence sizes, charged to max_index_bytes; best_fit,
  // the groups held at once at their most; and, grown by an Attach's Reach, the prefix
  // tables of the placed groups. Open's part is open_charge_ bytes.
  std::unique_ptr<ByteBudget::Charge> charge_ ABSL_PT_GUARDED_BY(charge_mu_);
  mutable absl::Mutex charge_mu_;
  uint64_t open_charge_ = 0;
  // The prefix tables' bytes as charged (ChargeTables): a row in a group past what they
  // cover (16 bytes a group) charges the tables as grown, so that a feed read for days, not
  // only a far Reach, stays within its share; a refusal fails only rows past the charge (a
  // far Attach refused leaves the feed's running sessions reading).
  mutable std::atomic<uint64_t> tables_charged_{0};
  // Names this dataset's placed groups to RowPieces' per-thread hint (the group of the row
  // a thread read last): unique in the process, renewed when ResetCaches forgets them.
  static uint64_t NewGroupsId();
  std::atomic<uint64_t> groups_id_{NewGroupsId()};

  static constexpr uint64_t kPickChunk = Blend::kSnapshotInterval;
  static constexpr size_t kCachedChunks = 8;
  // Groups packed ahead of the furthest one a row was read from, by the ahead workers: a
  // fill thread that packed a group would hold up every batch filled after its own (they are
  // delivered in order; measured on 16 cores: the ring emptied and filled in bursts). Eight
  // default groups are ~3,600 rows of 2,048 tokens, several ms at the plain feed's rate.
  static constexpr uint64_t kPackAhead = 8;
  // The groups ahead, the furthest one read, and as many behind it for ranks a little apart.
  static constexpr size_t kCachedGroups = 2 * kPackAhead + 4;
  // What Open charges to max_index_bytes for the groups a feed holds at once, at their most:
  // kept (the cache, and those packed ahead of the last placed one) and being packed (the
  // ahead workers and a reader at each front); a kept piece (PackPiece and its share of
  // row_begin, with a vector's slack) and one being packed (PackGroup's copies, its rows'
  // vectors and open set), and a pick (BlendPick and its prefix entry). Groups packed at once
  // are at most kGroupsPacking: a fill thread past it waits for one to be done (sessions far
  // apart each packing their own would otherwise pack as many as there are fill threads).
  static constexpr uint64_t kGroupsKept = kCachedGroups + kPackAhead;
  static constexpr uint64_t kGroupsPacking = 4 + 4 + 1;  // workers, fronts, Reach
  static constexpr uint64_t kKeptPieceBytes = 64;
  static constexpr uint64_t kPackingPieceBytes = 256;
  static constexpr uint64_t kPickBytes = 48;
  // No lock is held while a group is packed or a chunk of picks filled (milliseconds): a
  // row's lookup takes mu_ shared, and a group's keeping or claim takes it exclusive for a
  // few table entries. Lock order: mu_ before chunk_mu_ (stats(), ResetCaches()) and before
  // ahead_mu_ (a claim checks its front).
  mutable absl::Mutex mu_;
  mutable absl::CondVar packed_ ABSL_GUARDED_BY(mu_);  // a group was kept
  mutable absl::Mutex chunk_mu_ ABSL_ACQUIRED_AFTER(mu_);
  mutable absl::CondVar filled_ ABSL_GUARDED_BY(chunk_mu_);  // a chunk was kept
  mutable absl::flat_hash_map<uint64_t, std::shared_ptr<const std::vector<BlendPick>>> chunks_
      ABSL_GUARDED_BY(chunk_mu_);
  mutable absl::flat_hash_set<uint64_t> filling_ ABSL_GUARDED_BY(chunk_mu_);
  mutable std::list<uint64_t> chunk_order_ ABSL_GUARDED_BY(chunk_mu_);
  // Unpacked: the pick chunks counted in window_tokens_ so far, each once and in order from
  // the first one filled; a chunk filled ahead of the next to count (the workers fill the one
  // after the readers') waits in ahead_of_count_, at most kCachedChunks of them.
  mutable uint64_t counted_chunks_ ABSL_GUARDED_BY(chunk_mu_) = 0;
  mutable bool counting_ ABSL_GUARDED_BY(chunk_mu_) = false;
  mutable absl::flat_hash_map<uint64_t, std::shared_ptr<const std::vector<BlendPick>>>
      ahead_of_count_ ABSL_GUARDED_BY(chunk_mu_);
  mutable std::vector<uint64_t> window_tokens_ ABSL_GUARDED_BY(chunk_mu_);
  mutable absl::flat_hash_map<uint64_t, std::shared_ptr<const Group>> groups_ ABSL_GUARDED_BY(mu_);
  mutable absl::flat_hash_set<uint64_t> packing_ ABSL_GUARDED_BY(mu_);  // being packed
  mutable std::list<uint64_t> group_order_ ABSL_GUARDED_BY(mu_);
  // Per placed group g (every group before it placed too): the stream tokens and (best_fit)
  // rows before it; one more entry than groups placed. Each placed group's stats counted once.
  mutable std::vector<uint64_t> group_tokens_ ABSL_GUARDED_BY(mu_) = {0};
  mutable std::vector<uint64_t> group_rows_ ABSL_GUARDED_BY(mu_) = {0};
  mutable Stats stats_ ABSL_GUARDED_BY(mu_);
  // The reading fronts (groups, or chunks of a blend of windows) the workers work ahead of,
  // latest last, and their wake-ups.
  static constexpr size_t kAheadFronts = 4;
  static_assert(kGroupsPacking == kAheadWorkers + kAheadFronts + 1);
  mutable absl::Mutex ahead_mu_ ABSL_ACQUIRED_AFTER(mu_);  // a claim checks its front
  mutable absl::CondVar ahead_cv_ ABSL_GUARDED_BY(ahead_mu_);
  mutable std::vector<uint64_t> fronts_ ABSL_GUARDED_BY(ahead_mu_);
  mutable uint64_t reached_ ABSL_GUARDED_BY(ahead_mu_) = 0;  // Reached's wake-ups so far
  bool stop_ ABSL_GUARDED_BY(ahead_mu_) = false;
  bool opened_ ABSL_GUARDED_BY(ahead_mu_) = false;  // Open done: Reached may add workers
  // Started last in Open (more by Reached, past kMaxAheadThreads), joined first in the
  // destructor.
  mutable std::vector<std::thread> ahead_ ABSL_GUARDED_BY(ahead_mu_);
  // A thread of the process's lm-ahead budget for each of ahead_, returned as the dataset goes
  // (after the destructor joined them).
  mutable std::vector<std::unique_ptr<ByteBudget::Charge>> ahead_charges_
      ABSL_GUARDED_BY(ahead_mu_);
};

}  // namespace gpufeed::server
