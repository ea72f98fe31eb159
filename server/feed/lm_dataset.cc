#include "server/feed/lm_dataset.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <queue>
#include <tuple>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/shard_list.h"
#include "common/status.h"
#include "server/reader/le_bytes.h"
#include "server/reader/shards.h"
#include "server/reader/token_formats.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {

const char* PackModeName(PackMode mode) {
  switch (mode) {
    case PackMode::kNone: return "none";
    case PackMode::kConcat: return "concat";
    case PackMode::kBestFit: return "best_fit";
  }
  return "unknown";
}

std::vector<double> LmSpec::weights() const {
  if (sources.empty()) return {1.0};
  std::vector<double> out;
  for (const LmSourceSpec& s : sources) out.push_back(s.weight);
  return out;
}

bool LmSpec::changes_weights() const {
  return !history.empty() && history.back().weights != weights();
}

std::string LmSpec::Canonical() const {
  std::string out = absl::StrCat(";pack=", PackModeName(pack), ";lookahead=", lookahead);
  if (eos_id.has_value()) absl::StrAppend(&out, ";eos_id=", *eos_id);
  for (size_t i = 0; i < sources.size(); ++i) {
    // Names and paths %-escaped as the shard lists are (ShardPathsIdentity), weights exact.
    absl::StrAppend(&out, ";source", i, "=", ShardPathsIdentity(sources[i].paths), "@",
                    absl::StrFormat("%a", sources[i].weight));
  }
  for (const BlendSegment& s : history) {
    absl::StrAppend(&out, ";segment=", s.start, ":",
                    absl::StrJoin(s.weights, ",",
                                  [](std::string* o, double w) {
                                    absl::StrAppend(o, absl::StrFormat("%a", w));
                                  }),
                    ":", absl::StrJoin(s.ledger, ","));
  }
  if (changes_weights()) absl::StrAppend(&out, ";change_at=", change_epoch, ":", change_samples);
  return out;
}

absl::Status LmSpec::Validate(const FileDatasetSpec& dataset) const {
  const DatasetKind kind = dataset.kind;
  if (!active()) {
    if (eos_id.has_value() || lookahead != 0 || !history.empty()) {
      return absl::InvalidArgumentError(
          "dataset.pack: eos_id, pack_lookahead and blend_history are for a blend or a packed "
          "feed (set sources or pack)");
    }
    return absl::OkStatus();
  }
  if (kind != DatasetKind::kTokens) {
    return absl::InvalidArgumentError(
        "dataset.sources: blends and packing are for kind tokens only");
  }
  if (sources.size() > kMaxLmSources) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.sources: ", sources.size(),
                                                   " sources, more than ", kMaxLmSources));
  }
  if (!sources.empty() && !dataset.paths.empty()) {
    return absl::InvalidArgumentError(
        "dataset.paths: must be empty with sources (each source lists its own files)");
  }
  if (pack != PackMode::kNone && dataset.seq_len > kMaxPackedSeqLen) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.seq_len: at most 2^30 for a packed feed (position_ids and cu_seqlens are "
        "int32), got ", dataset.seq_len));
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    const LmSourceSpec& s = sources[i];
    const std::string field = absl::StrCat("dataset.sources[", i, "]");
    if (s.paths.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".paths: empty (", s.name.empty() ? "a source" : s.name,
                       " names no file)"));
    }
    if (!std::isfinite(s.weight) || s.weight <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".weight: must be finite and > 0, got ",
                                                     s.weight, " (", s.name, ")"));
    }
  }
  if (lookahead > kMaxPackLookahead) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset.pack_lookahead: at most ", kMaxPackLookahead, " documents, got ", lookahead));
  }
  if (lookahead != 0 && pack != PackMode::kBestFit) {
    return absl::InvalidArgumentError("dataset.pack_lookahead: only for pack best_fit");
  }
  if (eos_id.has_value()) {
    if (pack == PackMode::kNone) {
      return absl::InvalidArgumentError(
          "dataset.eos_id: documents are for packing: set pack to concat or best_fit");
    }
    if (*eos_id < 0 || *eos_id > int64_t{0xffffffff}) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.eos_id: must be a token id in [0, 2^32), got ", *eos_id));
    }
  }
  double sum = 0;
  for (const LmSourceSpec& s : sources) sum += s.weight;
  if (!std::isfinite(sum)) {
    return absl::InvalidArgumentError(
        "dataset.sources: the weights' sum is not finite; give them on a smaller scale");
  }
  if (history.size() > kMaxBlendHistory) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.blend_history: ", history.size(),
                                                   " segments, more than ", kMaxBlendHistory));
  }
  const size_t k = std::max<size_t>(sources.size(), 1);
  for (size_t i = 0; i < history.size(); ++i) {
    if (history[i].weights.size() != k || history[i].ledger.size() != k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.blend_history[", i, "]: ", history[i].weights.size(), " weights and ",
          history[i].ledger.size(), " ledger counts for ", k,
          " sources: the history is another blend's (the sources must stay as they were)"));
    }
  }
  return absl::OkStatus();
}

// One source: its tokens dataset, and with a pack mode its documents.
struct LmDataset::Source {
  std::unique_ptr<Dataset> dataset;
  const TokenShardsView* view = nullptr;
  std::vector<uint64_t> shard_first;  // per shard, its first token in the source's stream
  std::vector<uint64_t> doc_start;    // per document, its first token in that stream
  std::vector<uint64_t> doc_length;
  uint64_t tokens = 0;
};

// L consecutive picks of the stream, and best_fit's rows of them.
struct LmDataset::Group {
  uint64_t first = 0;             // its first pick
  std::vector<BlendPick> picks;
  std::vector<uint64_t> prefix;   // document tokens before each pick, in the group; picks + 1
  Packing packing;                // best_fit: pieces' `document` indexes `picks`
  PackStats stats;                // best_fit: MeasurePacking's
};

namespace {

// A source's documents: a shard's sequences (a Megatron .bin's .idx, or its offsets file), or
// the tokens split after each `eos`; never across a shard's end. Empty documents are left out.
// With eos_id set, the eos tokens decide, whatever else a shard has.
absl::Status FindDocuments(const std::vector<TokenShard>& shards,
                           const std::vector<uint64_t>& shard_first,
                           const std::optional<int64_t>& eos, const std::string& field,
                           const WalkBudget& walk, std::vector<uint64_t>* start,
                           std::vector<uint64_t>* length) {
  for (size_t k = 0; k < shards.size(); ++k) {
    const TokenShard& s = shards[k];
    if (!eos.has_value()) {
      if (s.documents_from.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ": ", s.name, " is ", s.format,
            " tokens, which say nowhere where a document ends: set eos_id (documents end at "
            "that token), give Megatron .bin/.idx pairs (their sequences are the documents), or "
            "put the document offsets beside it (", OffsetsFileOf(s.name), ")"));
      }
      uint64_t at = 0;
      for (const uint32_t size : s.sequences) {
        if (size > 0) {
          start->push_back(shard_first[k] + at);
          length->push_back(size);
        }
        at += size;
      }
      continue;
    }
    if (s.dtype == DType::kUInt16 && *eos > 0xffff) {
      return absl::InvalidArgumentError(absl::StrCat("dataset.eos_id: ", *eos, " is no uint16 token (",
                                                     s.name, " holds uint16 tokens)"));
    }
    const uint64_t tb = DTypeSize(s.dtype);
    constexpr uint64_t kChunk = 1 << 20;
    std::vector<std::byte> buffer(std::min(kChunk, s.tokens) * tb);
    uint64_t doc = 0;
    for (uint64_t done = 0; done < s.tokens;) {
      GPUFEED_RETURN_IF_ERROR(walk.Poll());
      const uint64_t n = std::min(kChunk, s.tokens - done);
      GPUFEED_RETURN_IF_ERROR(
          s.file->ReadAt(s.data_offset + done * tb, std::span<std::byte>(buffer.data(), n * tb)));
      for (uint64_t i = 0; i < n; ++i) {
        if (TokenAt(buffer.data(), i, tb) == static_cast<uint64_t>(*eos)) {
          start->push_back(shard_first[k] + doc);
          length->push_back(done + i + 1 - doc);
          doc = done + i + 1;
        }
      }
      done += n;
    }
    if (doc < s.tokens) {
      start->push_back(shard_first[k] + doc);
      length->push_back(s.tokens - doc);
    }
  }
  if (start->empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": no documents (every one is empty)"));
  }
  return absl::OkStatus();
}

// The most pieces one best_fit group of `picks` consecutive picks can make: each pick at
// least one, a document longer than a row one more for each further chunk. The largest of
// those extras, `picks` of them, each document counted as often as its source's picks can
// wrap into its next epoch within a group (2 + ceil(picks / its documents), as
// RowPiecesBound counts). O(documents x log picks) once at Open.
// Polls `walk` every 2^20 documents (a corpus of billions takes seconds).
absl::StatusOr<uint64_t> GroupPiecesBound(const std::vector<const std::vector<uint64_t>*>& sources,
                                          uint64_t picks, uint64_t width, const WalkBudget& walk) {
  // A min-heap of the largest extras so far, at most `picks`.
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<>> top;
  uint64_t seen = 0;
  for (const std::vector<uint64_t>* lengths : sources) {
    const uint64_t n = std::max<uint64_t>(lengths->size(), 1);
    const uint64_t copies = 2 + (picks + n - 1) / n;
    for (const uint64_t length : *lengths) {
      if (++seen % (uint64_t{1} << 20) == 0) GPUFEED_RETURN_IF_ERROR(walk.Poll());
      const uint64_t extra = (length + width - 1) / width - 1;
      for (uint64_t c = 0; c < copies && extra > 0; ++c) {
        if (top.size() < picks) {
          top.push(extra);
        } else if (extra > top.top()) {
          top.pop();
          top.push(extra);
        } else {
          break;
        }
      }
    }
  }
  uint64_t pieces = picks;
  for (; !top.empty(); top.pop()) pieces += top.top();
  return pieces;
}

// The lm-ahead threads of every LmDataset of the process, counted as a ByteBudget of threads
// (a charge of 1 held beside each started worker): kMaxAheadThreads in all, and
// kMaxAheadThreadsPerUid for the feeds charged to one uid (an admin's in the total only).
ByteBudget& ahead_budget() {
  // Never destroyed: feeds may end at exit, and their charges hold the budget.
  static auto* budget = new std::shared_ptr<ByteBudget>(
      ByteBudget::Create("lm-ahead threads", LmDataset::kMaxAheadThreads, "per uid",
                         LmDataset::kMaxAheadThreadsPerUid, "the fill threads pack the feed"));
  return **budget;
}

// "dataset.paths[3]: ..." of a source's open: "dataset.sources[1].paths[3]: ...".
absl::Status OfSource(const absl::Status& s, size_t i, const std::string& name) {
  if (s.ok()) return s;
  std::string m(s.message());
  const std::string field = absl::StrCat("dataset.sources[", i, "]");
  if (absl::StartsWith(m, "dataset.paths")) {
    m = absl::StrCat(field, m.substr(std::string("dataset").size()));
  } else {
    m = absl::StrCat(field, " (", name, "): ", m);
  }
  return absl::Status(s.code(), m);
}

}  // namespace

absl::StatusOr<std::unique_ptr<LmDataset>> LmDataset::Open(const DatasetSpec& dataset,
                                                           const LmSpec& lm, uint64_t seed,
                                                           bool shuffle, FileSystem* fs) {
  GPUFEED_RETURN_IF_ERROR(lm.Validate(dataset));
  std::unique_ptr<LmDataset> out(new LmDataset());
  out->limits_ = dataset.walk;
  out->display_ = dataset.path;
  {
    absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> charge = TakeIndexCharge(dataset.walk);
    if (!charge.ok()) return charge.status();
    absl::MutexLock lock(&out->charge_mu_);
    out->charge_ = *std::move(charge);
  }
  uint64_t index_bytes = 0;  // the document tables and sequence sizes kept
  out->pack_ = lm.pack;
  out->seq_len_ = static_cast<uint64_t>(dataset.seq_len);
  const bool packed = lm.pack != PackMode::kNone;
  const size_t k = std::max<size_t>(lm.sources.size(), 1);
  const PeerCred* reader = dataset.reader.has_value() ? &*dataset.reader : nullptr;
  const WalkBudget walk(dataset.walk, dataset.path, "finding documents in");
  for (size_t i = 0; i < k; ++i) {
    FileDatasetSpec spec = dataset;  // the directory, its descriptor, token_dtype, seq_len
    spec.for_packing = packed;
    std::string name = dataset.path;
    if (!lm.sources.empty()) {
      spec.paths = lm.sources[i].paths;
      name = lm.sources[i].name.empty() ? absl::StrCat("source ", i) : lm.sources[i].name;
    }
    auto source = std::make_unique<Source>();
    absl::StatusOr<std::unique_ptr<Dataset>> opened = OpenFileDataset(spec, fs, reader);
    if (!opened.ok()) {
      return lm.sources.empty() ? opened.status() : OfSource(opened.status(), i, name);
    }
    source->dataset = std::move(*opened);
    source->view = dynamic_cast<const TokenShardsView*>(source->dataset.get());
    if (source->view == nullptr) {
      return absl::InternalError("a tokens dataset opened without its shards");
    }
    const std::vector<TokenShard>& shards = source->view->shards();
    const uint64_t tb = DTypeSize(shards.front().dtype);
    if (i == 0) {
      out->token_bytes_ = tb;
    } else if (shards.front().dtype != out->sources_.front()->view->shards().front().dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "dataset.sources[", i, "]: ", name, " holds ", DTypeName(shards.front().dtype),
          " tokens but ", out->names_.front(), " holds ",
          DTypeName(out->sources_.front()->view->shards().front().dtype),
          ": every source of a blend must hold one token type"));
    }
    for (const TokenShard& s : shards) {
      source->shard_first.push_back(source->tokens);
      source->tokens += s.tokens;
    }
    if (packed) {
      const std::string field = lm.sources.empty() ? std::string("dataset.path")
                                                   : absl::StrCat("dataset.sources[", i, "]");
      GPUFEED_RETURN_IF_ERROR(FindDocuments(shards, source->shard_first, lm.eos_id, field, walk,
                                            &source->doc_start, &source->doc_length));
      for (const TokenShard& s : shards) index_bytes += s.sequences.size() * sizeof(uint32_t);
      index_bytes += source->doc_start.size() * 2 * sizeof(uint64_t);
      absl::MutexLock lock(&out->charge_mu_);
      if (out->charge_ != nullptr) {
        GPUFEED_RETURN_IF_ERROR(out->charge_->GrowTo(
            index_bytes, absl::StrCat("the document tables of ", name)));
      }
    }
    for (DatasetNotice& n : source->dataset->notices()) out->notices_.push_back(std::move(n));
    out->names_.push_back(std::move(name));
    out->sources_.push_back(std::move(source));
  }

  BlendSpec blend;
  uint64_t tokens = 0;
  for (const auto& s : out->sources_) {
    blend.sizes.push_back(packed ? s->doc_start.size() : s->dataset->num_samples());
    tokens += s->tokens;
  }
  blend.seed = seed;
  blend.shuffle = shuffle;
  const std::vector<double> weights = lm.weights();
  if (lm.history.empty()) {
    blend.segments.push_back({0, weights, std::vector<uint64_t>(k, 0)});
  } else {
    blend.segments = lm.history;
  }
  absl::StatusOr<std::unique_ptr<Blend>> created = Blend::Create(blend);
  if (!created.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(lm.history.empty() ? "dataset.sources: " : "dataset.blend_history: ",
                     created.status().message()));
  }
  out->blend_ = std::move(*created);

  const uint64_t width = out->seq_len_ + 1;
  const DType dtype = out->sources_.front()->view->shards().front().dtype;
  if (!packed) {
    for (const auto& s : out->sources_) out->rows_ += s->dataset->num_samples();
    out->tensors_ = out->sources_.front()->dataset->tensors();
  } else {
    out->group_picks_ =
        lm.pack == PackMode::kBestFit ? (lm.lookahead != 0 ? lm.lookahead : kDefaultPackLookahead)
                                      : 1024;
    out->rows_ = lm.pack == PackMode::kBestFit ? tokens / width
                                               : (tokens > 0 ? (tokens - 1) / out->seq_len_ : 0);
    out->rows_ = std::max<uint64_t>(out->rows_, 1);
    if (lm.pack == PackMode::kBestFit) {
      // A group's pieces are bounded: the lookahead times the longest document's rows.
      uint64_t longest = 0;
      size_t where = 0;
      for (size_t i = 0; i < out->sources_.size(); ++i) {
        for (const uint64_t n : out->sources_[i]->doc_length) {
          if (n > longest) longest = n, where = i;
        }
      }
      const uint64_t chunks = (longest + width - 1) / width;
      if (static_cast<__uint128_t>(chunks) * out->group_picks_ > kMaxGroupPieces) {
        return absl::InvalidArgumentError(absl::StrCat(
            "dataset.pack_lookahead: ", out->group_picks_, " documents of up to ", chunks,
            " rows each (", out->names_[where], " holds a document of ", longest,
            " tokens) could make more than 2^22 pieces in one group: lower pack_lookahead, "
            "raise seq_len, or split the longest documents"));
      }
      // The groups a feed holds at once (kept, packed ahead, being packed) are charged to
      // max_index_bytes as the document tables are, at their most for these documents: the
      // count of groups bounds them, not their bytes, and a group of long documents is large
      // (2^22 pieces, ~130 MB kept, more while packed), so one user's feeds could otherwise
      // hold gigabytes each.
      std::vector<const std::vector<uint64_t>*> lengths;
      for (const auto& source : out->sources_) lengths.push_back(&source->doc_length);
      GPUFEED_ASSIGN_OR_RETURN(const uint64_t pieces,
                               GroupPiecesBound(lengths, out->group_picks_, width, walk));
      const uint64_t held = pieces * (kKeptPieceBytes * kGroupsKept +
                                      kPackingPieceBytes * kGroupsPacking) +
                            out->group_picks_ * kPickBytes * (kGroupsKept + kGroupsPacking);
      absl::MutexLock lock(&out->charge_mu_);
      if (out->charge_ != nullptr) {
        GPUFEED_RETURN_IF_ERROR(out->charge_->GrowTo(
            index_bytes + held,
            absl::StrCat("the packed groups kept at once (", kGroupsKept + kGroupsPacking,
                         " groups of ", out->group_picks_, " documents, up to ", pieces,
                         " pieces each: lower pack_lookahead or raise seq_len to need less)")));
      }
    }
    {
      absl::MutexLock lock(&out->charge_mu_);
      out->open_charge_ = out->charge_ == nullptr ? 0 : out->charge_->bytes();
    }
    // cu_seqlens: as wide as the most pieces a row can hold needs (0, an end for each,
    // seq_len), not the row's width. A document repeats in a row only where its source wraps
    // into another epoch there: best_fit's rows come from one group of picks, concat's from a
    // window of the width's tokens.
    const bool best_fit = lm.pack == PackMode::kBestFit;
    RowPiecesBound bound(best_fit ? PackKind::kBestFit : PackKind::kConcat, width);
    for (const auto& s : out->sources_) {
      const uint64_t span = best_fit ? out->group_picks_ : width;
      const uint64_t per_epoch = best_fit ? s->doc_length.size() : s->tokens;
      bound.Add(s->doc_length, 2 + (span + per_epoch - 1) / std::max<uint64_t>(per_epoch, 1));
    }
    out->cu_width_ = std::min(width, bound.Bound() + 2);
    const int64_t w = static_cast<int64_t>(width);
    const int64_t cu = static_cast<int64_t>(out->cu_width_);
    out->tensors_ = {{"tokens", dtype, {w}, width * out->token_bytes_},
                     {"position_ids", DType::kInt32, {w}, width * 4},
                     {"loss_mask", DType::kUInt8, {w}, width},
                     {"cu_seqlens", DType::kInt32, {cu}, out->cu_width_ * 4}};
  }
  {
    absl::MutexLock lock(&out->mu_);
    out->stats_.source_tokens.assign(k, 0);
  }
  {
    absl::MutexLock lock(&out->chunk_mu_);
    out->window_tokens_.assign(k, 0);
  }
  if (lm.changes_weights()) {
    // The new weights take over at the first pick the rows before the resume have not
    // touched; the history's blend decides where that is.
    if (lm.change_samples > out->rows_) {
      return absl::InvalidArgumentError(absl::StrCat(
          "start.samples: ", lm.change_samples, " is past the ", out->rows_,
          " rows of this blend's epoch"));
    }
    absl::StatusOr<uint64_t> row =
        out->StreamRow(std::max<int64_t>(lm.change_epoch, 0), lm.change_samples);
    if (!row.ok()) return absl::InvalidArgumentError(absl::StrCat("start: ", row.status().message()));
    GPUFEED_RETURN_IF_ERROR(out->Reach(*row));
    const uint64_t at = out->ChangePoint(*row);
    absl::StatusOr<BlendSpec> changed = out->blend_->WithWeightsAt(at, weights);
    if (!changed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("dataset.sources: ", changed.status().message()));
    }
    GPUFEED_ASSIGN_OR_RETURN(out->blend_, Blend::Create(*std::move(changed)));
    out->ResetCaches();
  }
  // Up to kAheadWorkers, within the process's kMaxAheadThreads (a user's many packed feeds
  // must not cost the node unbounded threads) and the uid's kMaxAheadThreadsPerUid (nor take
  // all of them from other users); a feed left without workers packs on its fill threads, as
  // before them: slower, the same rows, and takes workers later as others go.
  int workers, running;
  {
    absl::MutexLock lock(&out->ahead_mu_);
    // Before the grant: only a thread's start can fail.
    out->ahead_.reserve(kAheadWorkers);
    out->ahead_charges_.reserve(kAheadWorkers);
    std::tie(workers, running) = out->StartAheadWorkersLocked();
    out->opened_ = true;  // from here on Reached may start more
  }
  if (workers < kAheadWorkers) {
    const std::optional<uint32_t> uid = out->limits_.charge_uid;
    spdlog::warn(
        "{}: {} of {} lm-ahead workers ({} running in the daemon, at most {}{}): the "
        "fill threads pack this feed's rows (slower, the same rows) until others end",
        out->display_, workers, kAheadWorkers, running, kMaxAheadThreads,
        uid.has_value() ? absl::StrCat("; ", AheadThreadsOf(*uid), " of uid ", *uid,
                                       "'s feeds, at most ", kMaxAheadThreadsPerUid)
                        : "");
  }
  return out;
}

int LmDataset::AheadThreads() { return static_cast<int>(ahead_budget().used()); }

int LmDataset::AheadThreadsOf(uint32_t uid) {
  return static_cast<int>(ahead_budget().used_by(uid));
}

std::pair<int, int> LmDataset::StartAheadWorkersLocked() const {
  const int running = AheadThreads();
  while (ahead_.size() < static_cast<size_t>(kAheadWorkers)) {
    // Past the process's or the uid's bound: fewer workers (the refusal is the expected case,
    // Open's warning says it).
    absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> charge =
        ahead_budget().Take(limits_.charge_uid, 1, "an lm-ahead worker");
    if (!charge.ok()) break;
    try {
      ahead_.emplace_back([this] { AheadLoop(); });
    } catch (const std::exception& e) {  // no thread (or its state) to be had: fewer workers
      spdlog::warn("{}: lm-ahead worker not started ({})", display_, e.what());
      break;  // its charge goes back here
    }
    ahead_charges_.push_back(*std::move(charge));
    pthread_setname_np(ahead_.back().native_handle(), "lm-ahead");
  }
  return {static_cast<int>(ahead_.size()), running};
}

int LmDataset::ahead_workers() const {
  absl::MutexLock lock(&ahead_mu_);
  return static_cast<int>(ahead_.size());
}

LmDataset::~LmDataset() {
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&ahead_mu_);
    stop_ = true;
    ahead_cv_.SignalAll();
    threads.swap(ahead_);  // none is added once stopped (Reached checks)
  }
  for (std::thread& t : threads) t.join();
  // ahead_charges_ go with the members: each worker's thread back to the budget, once joined.
}

uint64_t LmDataset::NewGroupsId() {
  static std::atomic<uint64_t> next{1};  // 0 is no dataset's: a thread's hint before any
  return next.fetch_add(1, std::memory_order_relaxed);
}

void LmDataset::ResetCaches() {
  absl::MutexLock lock(&mu_);
  groups_.clear();
  group_order_.clear();
  group_tokens_ = {0};
  group_rows_ = {0};
  // Renamed once they are gone, under the lock a reader finds them with: a hint taken from
  // the old ones carries the old name.
  groups_id_.store(NewGroupsId(), std::memory_order_relaxed);
  const size_t k = stats_.source_tokens.size();
  stats_ = Stats();
  stats_.source_tokens.assign(k, 0);
  absl::MutexLock chunks(&chunk_mu_);
  chunks_.clear();
  chunk_order_.clear();
  counted_chunks_ = 0;
  counting_ = false;
  window_tokens_.assign(k, 0);
  ahead_of_count_.clear();
}

BlendPick LmDataset::PickAt(uint64_t t) const {
  // Only a blend of windows reads its picks one at a time (packed rows read a group's).
  const uint64_t c = t / kPickChunk;
  std::optional<BlendPick> pick;
  {
    absl::ReaderMutexLock lock(&chunk_mu_);  // one a row
    if (auto it = chunks_.find(c); it != chunks_.end()) {
      pick = (*it->second)[t % kPickChunk];
      if (chunks_.contains(c + 1) || filling_.contains(c + 1)) return *pick;
    }
  }
  if (!pick.has_value()) return (*ChunkOf(c))[t % kPickChunk];
  Reached(c);  // the workers fill the next chunk
  return *pick;
}

std::shared_ptr<const std::vector<BlendPick>> LmDataset::ChunkOf(uint64_t c) const {
  {
    absl::MutexLock lock(&chunk_mu_);
    while (true) {
      if (auto it = chunks_.find(c); it != chunks_.end()) return it->second;
      if (!filling_.contains(c)) break;
      filled_.Wait(&chunk_mu_);
    }
    filling_.insert(c);
  }
  return FillChunk(c);
}

bool LmDataset::FillChunkAhead(uint64_t c) const {
  {
    absl::MutexLock lock(&chunk_mu_);
    if (chunks_.contains(c) || filling_.contains(c)) return false;
    filling_.insert(c);
  }
  FillChunk(c);
  return true;
}

std::shared_ptr<const std::vector<BlendPick>> LmDataset::FillChunk(uint64_t c) const {
  // A throw (no memory) leaves the chunk unclaimed and its waiters woken, not stuck.
  absl::Cleanup unclaim = [&] {
    absl::MutexLock lock(&chunk_mu_);
    filling_.erase(c);
    filled_.SignalAll();
  };
  // About 12 ms for 2^16 picks (pack_bench): filled with no lock held.
  auto fresh = std::make_shared<std::vector<BlendPick>>(kPickChunk);
  blend_->Fill(c * kPickChunk, *fresh);
  absl::MutexLock lock(&chunk_mu_);
  if (pack_ == PackMode::kNone) {
    // An unpacked blend's tokens per source, each chunk counted once, in stream order from
    // the first one filled (a resumed feed's: its resume's); one filled ahead of the next to
    // count waits for it.
    if (!counting_) {
      counting_ = true;
      counted_chunks_ = c;
    }
    if (c > counted_chunks_ && c <= counted_chunks_ + kCachedChunks) {
      ahead_of_count_.emplace(c, fresh);
    }
    std::shared_ptr<const std::vector<BlendPick>> next = c == counted_chunks_ ? fresh : nullptr;
    while (next != nullptr) {
      for (const BlendPick& p : *next) window_tokens_[p.source] += seq_len_ + 1;
      auto it = ahead_of_count_.find(++counted_chunks_);
      next = nullptr;
      if (it != ahead_of_count_.end()) {
        next = std::move(it->second);
        ahead_of_count_.erase(it);
      } else if (auto cached = chunks_.find(counted_chunks_); cached != chunks_.end()) {
        // Filled too far ahead of the count to wait for it (a reader more than kCachedChunks
        // ahead of the others) but still kept: counted now, or never (read from the cache
        // from here on, it is not filled again, and the count would stop at it).
        next = cached->second;
      }
    }
  }
  chunks_.emplace(c, fresh);
  chunk_order_.push_back(c);
  if (chunk_order_.size() > kCachedChunks) {
    chunks_.erase(chunk_order_.front());
    chunk_order_.pop_front();
  }
  return fresh;
}

uint64_t LmDataset::DocLength(const BlendPick& pick) const {
  return sources_[pick.source]->doc_length[pick.sample];
}

std::shared_ptr<const LmDataset::Group> LmDataset::MakeGroup(uint64_t g) const {
  auto group = std::make_shared<Group>();
  group->first = g * group_picks_;
  group->picks.resize(group_picks_);
  group->prefix.assign(1, 0);
  std::vector<uint64_t> lengths;
  lengths.reserve(group_picks_);
  // The picks a chunk at a time (one lookup, not one a pick: the ahead workers' pace is the
  // packed feed's).
  for (uint64_t j = 0; j < group_picks_;) {
    const uint64_t t = group->first + j;
    std::shared_ptr<const std::vector<BlendPick>> chunk = ChunkOf(t / kPickChunk);
    const uint64_t n = std::min(group_picks_ - j, kPickChunk - t % kPickChunk);
    std::copy_n(chunk->begin() + static_cast<ptrdiff_t>(t % kPickChunk), n,
                group->picks.begin() + static_cast<ptrdiff_t>(j));
    j += n;
  }
  for (const BlendPick& pick : group->picks) {
    lengths.push_back(DocLength(pick));
    group->prefix.push_back(group->prefix.back() + lengths.back());
  }
  if (pack_ == PackMode::kBestFit) {
    // The group is one lookahead window: PackBestFit's own grouping cuts nothing more. Its
    // arguments were checked at Open (seq_len <= 2^30, lookahead >= 1): it cannot refuse.
    absl::StatusOr<Packing> packing = PackBestFit(lengths, seq_len_, group_picks_);
    if (packing.ok()) group->packing = *std::move(packing);
    group->stats = MeasurePacking(group->packing, lengths);
  }
  return group;
}

void LmDataset::KeepLocked(uint64_t g, std::shared_ptr<const Group> group) const {
  // A group placed already, evicted and packed again (a reader far behind the others).
  if (g + 1 < group_rows_.size()) ++stats_.groups_again;
  groups_.emplace(g, std::move(group));
  group_order_.push_back(g);
  // Room first, so that a bad_alloc cannot leave the two prefix tables out of step; grown
  // geometrically (room for exactly the next few would copy both whole tables a group).
  for (std::vector<uint64_t>* table : {&group_tokens_, &group_rows_}) {
    const size_t need = table->size() + group_order_.size();
    if (table->capacity() < need) table->reserve(std::max(2 * table->capacity(), need));
  }
  // Placed in stream order: this group if it is the next, and every kept one after it.
  for (auto it = groups_.find(group_rows_.size() - 1); it != groups_.end();
       it = groups_.find(group_rows_.size() - 1)) {
    const Group& next = *it->second;
    group_tokens_.push_back(group_tokens_.back() + next.prefix.back());
    group_rows_.push_back(group_rows_.back() + next.packing.rows());
    if (pack_ == PackMode::kBestFit) {
      stats_.rows += next.stats.rows;
      stats_.row_tokens += next.stats.row_tokens;
      stats_.pad_tokens += next.stats.pad_tokens;
      stats_.documents += next.stats.documents;
      stats_.truncated_documents += next.stats.truncated_documents;
    } else {
      stats_.documents += group_picks_;
    }
    for (size_t j = 0; j < next.picks.size(); ++j) {
      stats_.source_tokens[next.picks[j].source] += next.prefix[j + 1] - next.prefix[j];
    }
  }
  // Evicts the oldest placed groups past the bound; unplaced ones (packed ahead of a gap
  // that another thread is packing) stay until they are placed.
  const uint64_t placed = group_rows_.size() - 1;
  for (auto it = group_order_.begin();
       group_order_.size() > kCachedGroups && it != group_order_.end();) {
    if (*it < placed) {
      groups_.erase(*it);
      it = group_order_.erase(it);
    } else {
      ++it;
    }
  }
  packed_.SignalAll();
}

std::shared_ptr<const LmDataset::Group> LmDataset::GroupAt(uint64_t g) const {
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      if (auto it = groups_.find(g); it != groups_.end()) return it->second;
      if (!packing_.contains(g) && packing_.size() < kGroupsPacking) break;
      packed_.Wait(&mu_);  // being packed, or kGroupsPacking others are (their memory)
    }
    ClaimLocked(g);
  }
  return PackClaimed(g);
}

std::shared_ptr<const LmDataset::Group> LmDataset::PackClaimed(uint64_t g) const {
  // A throw (no memory) leaves the group unclaimed and its waiters woken, not stuck.
  absl::Cleanup unclaim = [&] {
    absl::MutexLock lock(&mu_);
    packing_.erase(g);
    packed_.SignalAll();
  };
  std::shared_ptr<const Group> group = MakeGroup(g);
  absl::MutexLock lock(&mu_);
  KeepLocked(g, group);
  return group;
}

std::optional<uint64_t> LmDataset::ClaimAheadLocked(uint64_t g) const {
  if (!IsFront(g)) return std::nullopt;  // checked again with the claim: no race to a stale one
  if (packing_.size() >= kGroupsPacking) return std::nullopt;  // the fill threads go first
  for (uint64_t a = g + 1; a <= g + kPackAhead; ++a) {
    if (!groups_.contains(a) && !packing_.contains(a)) {
      ClaimLocked(a);
      return a;
    }
  }
  return std::nullopt;
}

void LmDataset::ClaimLocked(uint64_t g) const {
  packing_.insert(g);
  stats_.packing_peak = std::max<uint64_t>(stats_.packing_peak, packing_.size());
}

void LmDataset::Reached(uint64_t g, std::optional<uint64_t> moved_from) const {
  absl::MutexLock lock(&ahead_mu_);
  if (moved_from.has_value()) std::erase(fronts_, *moved_from);
  if (IsFrontLocked(g)) return;
  fronts_.push_back(g);
  if (fronts_.size() > kAheadFronts) fronts_.erase(fronts_.begin());
  ++reached_;
  // A feed opened past the process's kMaxAheadThreads (or its uid's share) takes workers as
  // other feeds end: tried at each new front while the process has some to spare (a feed
  // with all its workers takes no lock of the budget here). Not before Open is done: its
  // Reach (a resume with new weights) places groups with the old blend, which Open then
  // replaces under any worker.
  if (opened_ && !stop_ && ahead_.size() < static_cast<size_t>(kAheadWorkers) &&
      AheadThreads() < kMaxAheadThreads) {
    const size_t had = ahead_.size();
    StartAheadWorkersLocked();
    if (ahead_.size() > had) {
      spdlog::info("{}: {} of {} lm-ahead workers now", display_, ahead_.size(), kAheadWorkers);
    }
  }
  ahead_cv_.SignalAll();
}

bool LmDataset::IsFrontLocked(uint64_t f) const {
  return std::find(fronts_.begin(), fronts_.end(), f) != fronts_.end();
}

bool LmDataset::IsFront(uint64_t f) const {
  absl::MutexLock lock(&ahead_mu_);
  return IsFrontLocked(f);
}

bool LmDataset::AheadStep(uint64_t f) const {
  // A front no longer one (its reader, or Attach's Reach, moved on while this worker was on
  // another) has no work: its groups may be placed and evicted since, and packing them again
  // would be waste (a far Reach's stale fronts had each group packed up to five times).
  if (!IsFront(f)) return false;
  if (pack_ == PackMode::kNone) return FillChunkAhead(f + 1);
  // The chunk after the one holding the last pick of the furthest group packed ahead: filled
  // a whole chunk (64 default groups) before a group needs it.
  if (FillChunkAhead(((f + kPackAhead + 1) * group_picks_ - 1) / kPickChunk + 1)) return true;
  std::optional<uint64_t> g;
  {
    absl::MutexLock lock(&mu_);
    g = ClaimAheadLocked(f);
  }
  if (!g.has_value()) return false;
  PackClaimed(*g);
  return true;
}

void LmDataset::AheadLoop() const {
  uint64_t done = 0;  // the wake-ups this worker has acted on
  while (true) {
    std::vector<uint64_t> fronts;
    {
      absl::MutexLock lock(&ahead_mu_);
      while (!stop_ && reached_ == done) ahead_cv_.Wait(&ahead_mu_);
      if (stop_) return;
      done = reached_;
      fronts = fronts_;
    }
    // Caught here: a worker's throw (no memory) must not end the daemon; a fill thread
    // that needs the group or chunk does it itself.
    try {
      // A step for each front with work, the latest first, then the fronts read afresh
      // (AheadStep skips a front no longer one).
      for (bool worked = true; worked;) {
        worked = false;
        for (auto f = fronts.rbegin(); f != fronts.rend(); ++f) worked |= AheadStep(*f);
        absl::MutexLock lock(&ahead_mu_);
        if (stop_) return;
        if (reached_ != done) worked = true;  // a front came meanwhile: look again
        done = reached_;
        fronts = fronts_;
      }
    } catch (const std::exception& e) {
      spdlog::warn("{}: packing ahead failed ({}); fill threads pack for themselves", display_,
                   e.what());
    }
  }
}

absl::Status LmDataset::PlaceThrough(bool by_rows, uint64_t value, const WalkBudget* budget) const {
  std::optional<uint64_t> front;  // Reach's front, moved along as it places groups
  absl::Cleanup gone = [&] {
    if (front.has_value()) {
      absl::MutexLock lock(&ahead_mu_);
      std::erase(fronts_, *front);
    }
  };
  while (true) {
    uint64_t next;
    {
      absl::ReaderMutexLock lock(&mu_);
      const std::vector<uint64_t>& starts = by_rows ? group_rows_ : group_tokens_;
      if (starts.back() > value) return absl::OkStatus();
      next = starts.size() - 1;
    }
    // Attach's Reach (a session starting far into the stream): the ahead workers pack the
    // groups after this one meanwhile, so that the groups before the start are packed by
    // five threads, not one. One front, moved (placing jumps over the groups packed ahead:
    // fronts left behind would have the workers pack evicted groups again).
    if (budget != nullptr) {
      Reached(next, front);
      front = next;
    }
    GroupAt(next);  // packed (or waited for) and placed, with the kept ones after it
    if (budget != nullptr) {
      GPUFEED_RETURN_IF_ERROR(budget->Poll());
      // Placing only grows the tables 16 bytes a group, but a far start places millions.
      GPUFEED_RETURN_IF_ERROR(ChargeTables(by_rows, value));
    }
  }
}

absl::Status LmDataset::ChargeTables(bool by_rows, uint64_t value) const {
  uint64_t bytes, groups;
  {
    absl::ReaderMutexLock lock(&mu_);
    bytes = (group_tokens_.capacity() + group_rows_.capacity()) * sizeof(uint64_t);
    groups = group_rows_.size() - 1;
  }
  absl::MutexLock lock(&charge_mu_);
  if (charge_ != nullptr) {
    GPUFEED_RETURN_IF_ERROR(charge_->GrowTo(
        open_charge_ + bytes,
        absl::StrCat("the prefix tables of ", groups, " placed groups (reaching ",
                     by_rows ? "row " : "token ", value, " of the packed stream)")));
  }
  tables_charged_.store(bytes, std::memory_order_relaxed);
  return absl::OkStatus();
}

uint64_t LmDataset::GroupHolding(bool by_rows, uint64_t value) const {
  PlaceThrough(by_rows, value).IgnoreError();  // no budget: always OK
  absl::ReaderMutexLock lock(&mu_);
  const std::vector<uint64_t>& starts = by_rows ? group_rows_ : group_tokens_;
  return static_cast<uint64_t>(std::upper_bound(starts.begin(), starts.end(), value) -
                               starts.begin()) -
         1;
}

uint64_t LmDataset::RowPieces(uint64_t row, std::vector<PackPiece>* pieces,
                              std::vector<BlendPick>* picks) const {
  pieces->clear();
  picks->clear();
  // The row's first group: placed and found under a shared lock. Packed here only at a
  // stream's start, far from the other rows, or where the ahead workers fell behind.
  const bool by_rows = pack_ == PackMode::kBestFit;
  uint64_t at = row * seq_len_;  // concat: the row's first stream token
  const uint64_t value = by_rows ? row : at;
  uint64_t g = 0, start = 0;
  std::shared_ptr<const Group> group;
  // The group of the row this thread read last, kept: a fill reads a batch of consecutive
  // rows, most in the group of the row before (hundreds of rows a group), and finds it here
  // with no lock, search or lookup (a fifth of a best_fit row's time in lm_rows_bench). Placed
  // groups never move, so a hint of this dataset's holds until ResetCaches renames them;
  // the workers were told of the group at its first row. Weak: a group evicted, or of a
  // feed closed, is freed as it would be without the hint (the read threads outlive every
  // feed; each holding a group of long documents would be gigabytes no budget counts).
  struct Hint {
    uint64_t groups_id = 0, g = 0, start = 0, end = 0;
    std::weak_ptr<const Group> group;
  };
  thread_local Hint hint;
  const uint64_t groups_id = groups_id_.load(std::memory_order_relaxed);
  if (hint.groups_id == groups_id && value >= hint.start && value < hint.end) {
    g = hint.g;
    start = hint.start;
    group = hint.group.lock();
  }
  if (group == nullptr) {
    uint64_t end;
    bool behind;
    while (true) {
      uint64_t next;
      {
        absl::ReaderMutexLock lock(&mu_);
        const std::vector<uint64_t>& starts = by_rows ? group_rows_ : group_tokens_;
        next = starts.size() - 1;
        if (starts.back() > value) {
          g = static_cast<uint64_t>(std::upper_bound(starts.begin(), starts.end(), value) -
                                    starts.begin()) -
              1;
          start = starts[g];
          end = starts[g + 1];
          if (auto it = groups_.find(g); it != groups_.end()) group = it->second;
          // The workers fill the window after a front in order: its last group kept or
          // being packed means they are on it (one lookup a row, not kPackAhead).
          const uint64_t last = g + kPackAhead;
          behind = !groups_.contains(last) && !packing_.contains(last);
          break;
        }
      }
      GroupAt(next);  // the row is past the groups placed: place the next (PlaceThrough's)
    }
    if (behind) Reached(g);
    if (group == nullptr) group = GroupAt(g);  // evicted: a rank far behind the others
    hint = Hint{groups_id, g, start, end, group};
  }
  if (by_rows) {
    for (const PackPiece& p : group->packing.Row(row - start)) {
      pieces->push_back({group->first + p.document, p.offset, p.length});
      picks->push_back(group->picks[p.document]);
    }
  } else {
    // concat: the stream's tokens [row x seq_len, row x seq_len + seq_len + 1), from the
    // group holding the first on, across groups where the row runs past one.
    uint64_t left = seq_len_ + 1;
    while (true) {
      size_t j = static_cast<size_t>(
          std::upper_bound(group->prefix.begin(), group->prefix.end(), at - start) -
          group->prefix.begin() - 1);
      for (; j < group->picks.size() && left > 0; ++j) {
        const uint64_t offset = at - start - group->prefix[j];
        const uint64_t take = std::min(group->prefix[j + 1] - group->prefix[j] - offset, left);
        pieces->push_back({group->first + j, offset, take});
        picks->push_back(group->picks[j]);
        at += take;
        left -= take;
      }
      if (left == 0) break;
      start += group->prefix.back();
      ++g;
      group = GroupAt(g);
    }
  }
  return g;
}

uint64_t LmDataset::ChangePoint(uint64_t row) const {
  if (pack_ == PackMode::kNone) return row;
  if (pack_ == PackMode::kBestFit) {
    const uint64_t g = GroupHolding(true, row);
    absl::ReaderMutexLock lock(&mu_);
    return group_rows_[g] == row ? g * group_picks_ : (g + 1) * group_picks_;
  }
  if (row == 0) return 0;
  // The row's first token is the row before's last: the pick holding it was touched.
  const uint64_t at = row * seq_len_;
  const uint64_t g = GroupHolding(false, at);
  uint64_t base;
  {
    absl::ReaderMutexLock lock(&mu_);
    base = group_tokens_[g];
  }
  std::shared_ptr<const Group> group = GroupAt(g);
  const size_t j = static_cast<size_t>(
      std::upper_bound(group->prefix.begin(), group->prefix.end(), at - base) -
      group->prefix.begin() - 1);
  return group->first + j + 1;
}

absl::Status LmDataset::ReadPiece(const BlendPick& pick, uint64_t offset, uint64_t length,
                                  std::byte* out) const {
  const Source& s = *sources_[pick.source];
  const uint64_t at = s.doc_start[pick.sample] + offset;
  const size_t k = static_cast<size_t>(
      std::upper_bound(s.shard_first.begin(), s.shard_first.end(), at) - s.shard_first.begin() - 1);
  const TokenShard& shard = s.view->shards()[k];
  return shard.file->ReadAt(shard.data_offset + (at - s.shard_first[k]) * token_bytes_,
                            std::span<std::byte>(out, length * token_bytes_));
}

absl::Status LmDataset::ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const {
  return ReadSampleAt(id, SampleContext{}, rows).status();
}

absl::StatusOr<uint64_t> LmDataset::StreamRow(int64_t epoch, uint64_t place) const {
  const __int128 at = static_cast<__int128>(std::max<int64_t>(epoch, 0)) * rows_ + place;
  // A packed row's first token (row x seq_len) must stay below 2^62 too.
  const __int128 end = pack_ == PackMode::kNone ? (__int128{1} << 62)
                                                : (__int128{1} << 62) / (seq_len_ + 1);
  if (at >= end) {
    return absl::OutOfRangeError(absl::StrCat(
        "epoch ", epoch, " place ", place, " is past the end of this blend's stream (",
        static_cast<uint64_t>(end), " rows)"));
  }
  return static_cast<uint64_t>(at);
}

absl::Status LmDataset::Reach(uint64_t row) const {
  const WalkBudget budget(limits_, display_, absl::StrCat("reaching row ", row, " of"));
  if (pack_ == PackMode::kNone) {
    // The blend's ledger up to the row, one chunk of picks at a time (each memoised).
    for (uint64_t t = kPickChunk; t <= row; t += kPickChunk) {
      GPUFEED_RETURN_IF_ERROR(budget.Poll());
      blend_->LedgerAt(t);
    }
    return absl::OkStatus();
  }
  // Best-fit: the group holding the row; concat: the groups holding its seq_len + 1 tokens.
  const bool by_rows = pack_ == PackMode::kBestFit;
  return PlaceThrough(by_rows, by_rows ? row : row * seq_len_ + seq_len_, &budget);
}

absl::StatusOr<uint64_t> LmDataset::ReadSampleAt(uint64_t id, const SampleContext& context,
                                                 std::span<const std::span<std::byte>> rows) const {
  GPUFEED_ASSIGN_OR_RETURN(const uint64_t row, StreamRow(context.epoch, id));
  if (pack_ == PackMode::kNone) {
    const BlendPick pick = PickAt(row);
    GPUFEED_RETURN_IF_ERROR(sources_[pick.source]->dataset->ReadSample(pick.sample, rows));
    return pick.id;
  }
  // Per thread, reused: a row allocates nothing.
  thread_local std::vector<PackPiece> pieces;
  thread_local std::vector<BlendPick> picks;
  const uint64_t last_group = RowPieces(row, &pieces, &picks);
  // A row in a group past the tables charged (they grow geometrically: a few rows in a run's
  // life) charges them as grown; each table holds an entry more than the groups placed.
  if ((last_group + 2) * 2 * sizeof(uint64_t) > tables_charged_.load(std::memory_order_relaxed)) {
    const bool by_rows = pack_ == PackMode::kBestFit;
    GPUFEED_RETURN_IF_ERROR(ChargeTables(by_rows, by_rows ? row : row * seq_len_));
  }
  const uint64_t width = seq_len_ + 1;
  std::byte* tokens = rows[0].data();
  uint64_t filled = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    GPUFEED_RETURN_IF_ERROR(
        ReadPiece(picks[i], pieces[i].offset, pieces[i].length, tokens + filled * token_bytes_));
    filled += pieces[i].length;
  }
  std::memset(tokens + filled * token_bytes_, 0, (width - filled) * token_bytes_);
  // The int32 rows are 4-byte aligned (a slot's tensors start 256-aligned, rows are
  // width x 4 bytes): written in place.
  std::span<int32_t> positions(reinterpret_cast<int32_t*>(rows[1].data()), width);
  PositionIds(pieces, positions);
  std::memset(rows[2].data(), 1, filled);
  std::memset(rows[2].data() + filled, 0, width - filled);
  // cu_seqlens (CuSeqlens' rule, written in place): 0, each piece's end clipped to seq_len,
  // then seq_len to cu_width_, the bound Open computed. A row past it would mean a wrong
  // bound: refused, never written past the tensor.
  int32_t* cu = reinterpret_cast<int32_t*>(rows[3].data());
  const int32_t last = static_cast<int32_t>(seq_len_);
  uint64_t n = 0, end = 0;
  cu[n++] = 0;
  for (const PackPiece& p : pieces) {
    if (end >= seq_len_) break;
    if (n == cu_width_) return CuWidthExceeded(row, pieces.size());
    end += p.length;
    cu[n++] = static_cast<int32_t>(std::min(end, seq_len_));
  }
  if (n == cu_width_ && cu[n - 1] != last) return CuWidthExceeded(row, pieces.size());
  std::fill(cu + n, cu + cu_width_, last);
  return row;
}

absl::Status LmDataset::CuWidthExceeded(uint64_t row, size_t pieces) const {
  // The bound holds for every blend this daemon wrote: a source's picks run through its own
  // order, epoch after epoch. A blend_history given at Attach whose ledgers add up (all that
  // Blend::Create can check without replaying the run) but send a source back over documents
  // it already delivered repeats them beyond it: a history this feed did not write.
  const std::string what =
      absl::StrCat("stream row ", row, " holds ", pieces, " pieces, more than cu_seqlens' ",
                   cu_width_, " entries can describe");
  if (blend_->spec().segments.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": dataset.blend_history sends a source back over documents it delivered (a "
        "segment's ledger is not where the segment before it left off); resume with the "
        "history the feed reported (state_dict's \"blend\"), unchanged"));
  }
  return absl::InternalError(
      absl::StrCat(what, ": the bound on a row's pieces is wrong; please report it"));
}

absl::Status LmDataset::CheckNotShrunk() const {
  for (const auto& s : sources_) GPUFEED_RETURN_IF_ERROR(s->dataset->CheckNotShrunk());
  return absl::OkStatus();
}

absl::Status LmDataset::CheckReadNotShrunk(std::span<const int64_t> ids) const {
  if (pack_ != PackMode::kNone) return CheckNotShrunk();  // stream rows: every source's files
  // Union ids: each source checks the shards of its own samples the batch read.
  thread_local std::vector<std::vector<int64_t>> by_source;
  by_source.resize(sources_.size());
  for (auto& v : by_source) v.clear();
  for (const int64_t id : ids) {
    int32_t k = static_cast<int32_t>(sources_.size()) - 1;
    while (k > 0 && blend_->offset(k) > static_cast<uint64_t>(id)) --k;
    by_source[k].push_back(id - static_cast<int64_t>(blend_->offset(k)));
  }
  for (size_t k = 0; k < sources_.size(); ++k) {
    if (!by_source[k].empty()) {
      GPUFEED_RETURN_IF_ERROR(sources_[k]->dataset->CheckReadNotShrunk(by_source[k]));
    }
  }
  return absl::OkStatus();
}

std::string LmDataset::Identity() const {
  std::vector<std::string> parts;
  for (size_t i = 0; i < sources_.size(); ++i) {
    const Source& s = *sources_[i];
    // The files (names, sizes, times), not the name the user gave the source: "/data/web"
    // and "/data/web/" are one source.
    parts.push_back(absl::StrCat(s.dataset->ContentIdentity(), " ",
                                 s.tokens, " tokens ", blend_->spec().sizes[i],
                                 pack_ == PackMode::kNone ? " windows" : " documents"));
  }
  const BlendSegment& first = blend_->spec().segments.front();
  return absl::StrCat(
      absl::StrJoin(parts, " | "), "; rule ", kBlendRuleName, "; pack ", PackModeName(pack_),
      pack_ == PackMode::kNone ? "" : absl::StrCat(" ", group_picks_),
      "; first weights ",
      absl::StrJoin(first.weights, ",", [](std::string* o, double w) {
        absl::StrAppend(o, absl::StrFormat("%a", w));
      }));
}

LmDataset::Stats LmDataset::stats() const {
  absl::MutexLock lock(&mu_);
  Stats out = stats_;
  out.groups = group_rows_.size() - 1;  // placed: one prefix entry more than groups
  if (pack_ == PackMode::kNone) {
    absl::MutexLock chunks(&chunk_mu_);
    out.source_tokens = window_tokens_;
  }
  return out;
}

}  // namespace gpufeed::server
