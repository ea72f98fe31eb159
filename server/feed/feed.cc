#include "server/feed/feed.h"

#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/metrics.h"
#include "common/os/fd.h"
#include "common/os/file.h"
#include "common/progress.h"
#include "common/status.h"
#include "common/thread_pool.h"
#include "server/reader/shards.h"

namespace gpufeed::server {
namespace {

constexpr uint64_t kTensorAlign = 256;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

std::string FeedSpec::Canonical() const {
  std::string out = absl::StrCat(
      "kind=", static_cast<int>(dataset.kind), ";path=", dataset.path,
      ";token_dtype=", DTypeName(dataset.token_dtype), ";seq_len=", dataset.seq_len,
      ";vocab_size=", dataset.vocab_size, ";batch_size=", batch_size, ";world_size=", world_size,
      ";seed=", seed, ";shuffle=", shuffle, ";drop_last=", drop_last, even ? ";even=1" : "");
  if (!share_group.empty()) absl::StrAppend(&out, ";share_group=", share_group);
  if (resume_epoch >= 0) {
    absl::StrAppend(&out, ";resume_epoch=", resume_epoch, ";resume_base=", resume_base);
  }
  if (!dataset.arrays.empty()) absl::StrAppend(&out, ";arrays=", RecordArraysText(dataset.arrays));
  if (!dataset.paths.empty()) absl::StrAppend(&out, ";paths=", ShardPathsIdentity(dataset.paths));
  if (lm.active()) absl::StrAppend(&out, lm.Canonical());
  if (IsImageKind(dataset.kind)) {
    absl::StrAppend(&out, ";pipeline=", PipelineCanonical(dataset.pipeline), ";bad_sample=",
                    static_cast<int>(dataset.bad_sample), ";max_pixels=", dataset.max_pixels);
  }
  return out;
}

uint64_t OrderSeedOf(absl::string_view share_group) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : absl::StrCat("share_group:", share_group)) {
    h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
  }
  return h;
}

uint64_t FeedSpec::order_seed() const {
  return share_group.empty() ? seed : OrderSeedOf(share_group);
}

int64_t OrderPosition(int64_t epoch, uint64_t num_samples, uint64_t place) {
  constexpr __int128 kMax = __int128{1} << 62;
  const __int128 at = static_cast<__int128>(epoch) * num_samples + place;
  return static_cast<int64_t>(std::min(at, kMax));
}

std::string FeedKeyOf(const std::string& canonical) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : canonical) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return absl::StrFormat("%016x", h);
}

absl::StatusOr<std::shared_ptr<Feed>> Feed::Create(FeedSpec spec, FileSystem* fs,
                                                   const FeedLimits& limits, std::string key) {
  spec.dataset.max_image_bytes = limits.max_image_bytes;
  spec.dataset.max_pixels = limits.max_image_pixels;
  spec.dataset.region_decode = limits.region_decode;
  spec.dataset.counters =
      limits.counters != nullptr ? limits.counters : std::make_shared<metrics::Counters>();
  // Opening reads untrusted headers and may allocate by them: an exception is this Attach's
  // error, never the daemon's end.
  // A blend or a packed feed walks its own stream in order (lm_dataset.h): the sampler does
  // not shuffle it again, while `shuffle` keys each source's own permutation; nor does it
  // drop a nominal epoch's last rows (their documents would never come) or pad ranks with
  // rows counted valid (`even`: they would come twice): that epoch ends in a short batch
  // (valid_count) instead.
  const bool lm = spec.lm.active();
  GPUFEED_ASSIGN_OR_RETURN(
      std::unique_ptr<Dataset> dataset,
      CallCatching(absl::StrCat("opening dataset ", spec.dataset.path),
                   [&]() -> absl::StatusOr<std::unique_ptr<Dataset>> {
                     if (!lm) return OpenDataset(spec.dataset, fs);
                     return LmDataset::Open(spec.dataset, spec.lm, spec.order_seed(),
                                            spec.shuffle, fs);
                   }));
  if (dataset->num_samples() > limits.max_samples) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "dataset.path: ", spec.dataset.path, " makes ", dataset->num_samples(),
        " samples, more than this gpufeedd's max_samples_per_feed (", limits.max_samples,
        "); split the dataset or ask the admin to raise the cap"));
  }
  // The dataset's identity for the fingerprint: what it holds, and when it last changed,
  // where the path is a real file or folder (a test's fake file system has no such thing).
  std::vector<std::pair<std::string, std::string>> identity;
  struct stat st;
  // Where the dataset names its files (shards, several record arrays: ContentIdentity), each
  // file's own size and time say what the feed reads; their directory's time changes with any
  // file added beside them, a checkpoint or a dot-file say, and is left out. A regular file's
  // size and time stay, a single shard's too.
  std::string files = dataset->ContentIdentity();
  if (lm) {
    // The sources' own files name the blend (LmDataset::Identity), not their directory.
    identity.emplace_back("blend", static_cast<const LmDataset&>(*dataset).Identity());
    if (spec.lm.eos_id.has_value()) identity.emplace_back("eos_id", absl::StrCat(*spec.lm.eos_id));
  } else if (spec.dataset.arrays.empty() && spec.dataset.objects == nullptr &&
             (spec.dataset.fd >= 0 ? ::fstat(spec.dataset.fd, &st) == 0
                                   : ::stat(spec.dataset.path.c_str(), &st) == 0) &&
             (files.empty() || !S_ISDIR(st.st_mode))) {
    if (S_ISREG(st.st_mode)) identity.emplace_back("bytes", absl::StrCat(st.st_size));
    identity.emplace_back("mtime_ns",
                          absl::StrCat(static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
                                       st.st_mtim.tv_nsec));
  }
  if (!files.empty()) {
    identity.emplace_back(spec.dataset.arrays.empty() ? "shards" : "files", std::move(files));
  }
  // The descriptor was borrowed for the open; the handle is spent. Neither is the feed's.
  spec.dataset.fd = -1;
  spec.dataset.handle.clear();
  spec.dataset.reader.reset();
  SamplerConfig config{dataset->num_samples(), spec.batch_size, spec.world_size,
                       spec.order_seed(),      spec.shuffle && !lm, spec.drop_last && !lm,
                       spec.even && !lm,       spec.resume_epoch, spec.resume_base};
  GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<Sampler> sampler, Sampler::Create(config));
  // A slot must stay addressable: bound it (and so every product below) well inside 64 bits.
  __uint128_t slot_bytes = 0;
  for (const SampleTensor& t : dataset->tensors()) {
    slot_bytes += static_cast<__uint128_t>(t.byte_size) * static_cast<uint64_t>(spec.batch_size);
  }
  if (slot_bytes > (__uint128_t{1} << 44)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch_size: ", spec.batch_size, " samples of this dataset make a batch of more than "
        "16 TiB"));
  }
  if (key.empty()) key = FeedKeyOf(spec.Canonical());
  return std::shared_ptr<Feed>(new Feed(std::move(spec), std::move(key), std::move(dataset),
                                        std::move(sampler), std::move(identity)));
}

Feed::Feed(FeedSpec spec, std::string key, std::unique_ptr<Dataset> dataset,
           std::unique_ptr<Sampler> sampler,
           std::vector<std::pair<std::string, std::string>> identity)
    : spec_(std::move(spec)),
      key_(std::move(key)),
      identity_(std::move(identity)),
      dataset_(std::move(dataset)),
      images_(dynamic_cast<const ImageDataset*>(dataset_.get())),
      lm_(dynamic_cast<const LmDataset*>(dataset_.get())),
      sampler_(std::move(sampler)) {
  uint64_t offset = 0;
  for (const SampleTensor& t : dataset_->tensors()) {
    TensorLayout layout;
    layout.name = t.name;
    layout.dtype = t.dtype;
    layout.shape.push_back(spec_.batch_size);
    layout.shape.insert(layout.shape.end(), t.shape.begin(), t.shape.end());
    layout.byte_offset = AlignUp(offset, kTensorAlign);
    layout.row_bytes = t.byte_size;
    layout.byte_size = t.byte_size * static_cast<uint64_t>(spec_.batch_size);
    offset = layout.byte_offset + layout.byte_size;
    layout_.tensor_bytes += layout.byte_size;
    layout_.tensors.push_back(std::move(layout));
  }
  layout_.used_bytes = offset;
  layout_.stride_bytes = AlignUp(offset, PageSize());
  if (images_ != nullptr) staged_layout_ = images_->StagedLayoutFor(spec_.batch_size);
  fingerprint_ = MakeFingerprint();
}

namespace {

// %-escapes the fingerprint's separators (and '%') in a value.
std::string EscapeValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    switch (c) {
      case '%': out += "%25"; break;
      case ';': out += "%3B"; break;
      case '=': out += "%3D"; break;
      case '\n': out += "%0A"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

std::string Feed::MakeFingerprint() const {
  std::vector<std::pair<std::string, std::string>> f;
  const DatasetSpec& d = spec_.dataset;
  const char* kinds[] = {"unspecified", "tokens", "records", "image_folder", "webdataset"};
  const int kind = static_cast<int>(d.kind);
  f.emplace_back("kind", kind >= 0 && kind < static_cast<int>(std::size(kinds))
                             ? kinds[kind]
                             : absl::StrCat(kind));
  f.emplace_back("path", d.path);
  if (!d.paths.empty()) f.emplace_back("paths", ShardPathsIdentity(d.paths));
  f.insert(f.end(), identity_.begin(), identity_.end());
  f.emplace_back("samples", absl::StrCat(dataset_->num_samples()));
  std::vector<std::string> tensors;
  for (const SampleTensor& t : dataset_->tensors()) {
    tensors.push_back(absl::StrCat(t.name, ":", DTypeName(t.dtype), "[",
                                   absl::StrJoin(t.shape, ","), "]"));
  }
  f.emplace_back("tensors", absl::StrJoin(tensors, " "));
  if (d.kind == DatasetKind::kTokens) {
    f.emplace_back("seq_len", absl::StrCat(d.seq_len));
    f.emplace_back("vocab_size", absl::StrCat(d.vocab_size));
  }
  f.emplace_back("batch_size", absl::StrCat(spec_.batch_size));
  f.emplace_back("world_size", absl::StrCat(spec_.world_size));
  f.emplace_back("seed", absl::StrCat(spec_.seed));
  if (!spec_.share_group.empty()) f.emplace_back("share_group", spec_.share_group);
  f.emplace_back("shuffle", spec_.shuffle ? "true" : "false");
  f.emplace_back("drop_last", spec_.drop_last ? "true" : "false");
  if (spec_.even) f.emplace_back("even", "true");
  // The sample-order algorithm: a position saved under another order (one without this item
  // was saved before feistel1) names other samples, so it must not resume this feed.
  f.emplace_back("sampler", kSamplerName);
  if (IsImageKind(d.kind)) {
    f.emplace_back("pipeline", PipelineCanonical(d.pipeline));
    f.emplace_back("bad_sample", d.bad_sample == BadSamplePolicy::kFail ? "fail" : "skip");
    f.emplace_back("max_pixels", absl::StrCat(d.max_pixels));
  }
  std::string out;
  for (const auto& [name, value] : f) {
    absl::StrAppend(&out, out.empty() ? "" : ";", name, "=", EscapeValue(value));
  }
  return out;
}

namespace {

std::string FillWhat(Position p, int32_t rank) {
  return absl::StrCat("filling epoch ", p.epoch, " step ", p.step, " rank ", rank);
}

// The status of a fill stopped by its deadline, with `done` of `rows` samples done.
absl::Status PastDeadline(Position p, const FillDeadline& deadline, int64_t done, size_t rows) {
  return absl::DeadlineExceededError(
      absl::StrCat("the batch of epoch ", p.epoch, " step ", p.step, " ran past max_batch_time (",
                   absl::FormatDuration(deadline.budget), ") with ", done, " of ", rows,
                   " samples done: this session ends; ask for smaller batches or smaller images"));
}

// Once a fill of a group's rows ended, done or not: lets go of their decodes in flight and
// counts their read checks (ShareCache::Member::EndFill).
void EndFill(std::span<const SharedRow> rows, ShareCache::Member* share) {
  if (rows.empty()) return;
  ShareCache::FillEnd end;
  for (const SharedRow& row : rows) {
    if (row.pending != nullptr) end.pending.push_back(row.pending);
    end.read_checks_passed += row.read_check == SharedRow::ReadCheck::kPassed;
    end.read_checks_refused += row.read_check == SharedRow::ReadCheck::kRefused;
  }
  share->EndFill(end);
}

}  // namespace

absl::StatusOr<int64_t> Feed::FillStaged(Position p, int32_t rank, StageMode mode,
                                         const CpuRows& cpu, std::byte* slot,
                                         std::span<int64_t> ids, const ParallelFor& parallel,
                                         const FillDeadline& deadline,
                                         ShareCache::Member* share) const {
  return CallCatching(FillWhat(p, rank), [&] {
    return FillStagedImpl(p, rank, mode, cpu, slot, ids, parallel, deadline, share);
  });
}

absl::StatusOr<int64_t> Feed::Fill(Position p, int32_t rank, std::byte* slot,
                                   std::span<int64_t> ids, const ParallelFor& parallel,
                                   const FillDeadline& deadline,
                                   ShareCache::Member* share) const {
  return CallCatching(FillWhat(p, rank),
                      [&] { return FillImpl(p, rank, slot, ids, parallel, deadline, share); });
}

std::string Feed::ShareIdentity(bool across_uids) const {
  std::vector<std::string> identity;
  for (const auto& [name, value] : identity_) identity.push_back(absl::StrCat(name, "=", value));
  std::string name = spec_.dataset.path;
  std::string resolved = spec_.dataset.resolved;
  std::string list;
  if (across_uids) {
    // Two uids name one folder by their own paths and read it with their own rights: the
    // dataset's (device, inode), what Create saw of it and the exact sample list prove the
    // same files by the same ids, and the text names nothing of either uid's attach.
    resolved = resolved.substr(0, resolved.find(";reader="));
    if (!resolved.empty()) name = "a dataset";
    list = absl::StrCat(", sample list ", images_ != nullptr ? images_->SampleListDigest() : "-");
  }
  return absl::StrCat(name, " (", resolved.empty() ? "" : resolved.substr(1),
                      identity.empty() ? "" : ";", absl::StrJoin(identity, ";"), ", ",
                      dataset_->num_samples(), " samples", list,
                      spec_.shuffle ? "" : ", not shuffled", ", max_pixels ",
                      spec_.dataset.max_pixels, ")");
}

int64_t Feed::OrderCursor(Position p) const {
  const uint64_t n = sampler_->config().num_samples;
  if (p.step == 0 && p.epoch > 0 && sampler_->StepsIn(p.epoch - 1) > 0) {
    const Position last{p.epoch - 1, sampler_->StepsIn(p.epoch - 1) - 1};
    return OrderPosition(last.epoch, n, sampler_->GlobalBatchSpan(last).second);
  }
  return OrderPosition(p.epoch, n, sampler_->GlobalBatchSpan(p).first);
}

Feed::Claimed Feed::Claim(Position p, int32_t rank, std::span<int64_t> ids,
                          ShareCache::Member* share) const {
  Claimed c;
  if (share == nullptr || images_ == nullptr) {
    c.valid = sampler_->RankSlice(p, rank, ids);
    return c;
  }
  std::vector<uint64_t> places(ids.size());
  c.valid = sampler_->RankSlice(p, rank, ids, places);
  const uint64_t n = sampler_->config().num_samples;
  c.at.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) c.at[i] = OrderPosition(p.epoch, n, places[i]);
  const std::vector<ShareCache::Row> rows =
      share->Claim(std::span<const int64_t>(ids.data(), ids.size()), OrderCursor(p),
                   OrderPosition(p.epoch, n, sampler_->GlobalBatchSpan(p).second));
  c.rows.resize(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    SharedRow& row = c.rows[i];
    row.found = rows[i].found;
    row.wanted = rows[i].wanted;
    row.pending = rows[i].pending;
    row.uid = share->uid();
    row.check_read = rows[i].check_read;
  }
  return c;
}

void Feed::OfferDecoded(Claimed& claimed, std::span<const int64_t> ids, ShareCache::Member* share) {
  for (size_t i = 0; i < claimed.rows.size(); ++i) {
    if (claimed.rows[i].decoded != nullptr) {
      share->Offer(ids[i], claimed.at[i], std::move(claimed.rows[i].decoded));
    }
  }
}

absl::StatusOr<int64_t> Feed::FillStagedImpl(Position p, int32_t rank, StageMode mode,
                                             const CpuRows& cpu, std::byte* slot,
                                             std::span<int64_t> ids, const ParallelFor& parallel,
                                             const FillDeadline& deadline,
                                             ShareCache::Member* share) const {
  if (!staged_layout_) return absl::FailedPreconditionError("the dataset has no staged form");
  metrics::StageTimer timer(counters(), metrics::Stage::kFill);
  // nvJPEG's pixels are not the CPU decoder's: only the CPU decode path shares.
  Claimed claimed = Claim(p, rank, ids, mode == StageMode::kCpuDecode ? share : nullptr);
  absl::Cleanup end_fill = [&] { EndFill(claimed.rows, share); };
  const int64_t valid = claimed.valid;
  StageArena arena(*staged_layout_);
  const StageTarget target{mode, &*staged_layout_, slot, &arena, cpu};
  std::vector<absl::Status> status(ids.size());
  std::atomic<int64_t> done{0};
  std::atomic<bool> expired{false};
  auto stage = [&](int i) {
    const size_t k = static_cast<size_t>(i);
    if (expired.load(std::memory_order_relaxed) || deadline.expired()) {
      expired.store(true, std::memory_order_relaxed);
      return;
    }
    // Caught here, on the thread that ran the row: the row's status, as any failed read.
    absl::StatusOr<uint64_t> used = CallCatching("staging it", [&] {
      return images_->StageSampleAt(static_cast<uint64_t>(ids[k]), {spec_.seed, p.epoch}, i,
                                    target, claimed.rows.empty() ? nullptr : &claimed.rows[k]);
    });
    BusyMark::Progress();  // one sample done (common/progress.h)
    done.fetch_add(1, std::memory_order_relaxed);
    if (!used.ok()) {
      status[k] = Annotate(used.status(),
                           absl::StrCat("sample ", ids[k], " of epoch ", p.epoch, " step ", p.step));
      return;
    }
    ids[k] = static_cast<int64_t>(*used);
  };
  if (parallel != nullptr) {
    parallel(static_cast<int>(ids.size()), stage);
  } else {
    for (size_t i = 0; i < ids.size(); ++i) stage(static_cast<int>(i));
  }
  if (expired.load()) return PastDeadline(p, deadline, done.load(), ids.size());
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  OfferDecoded(claimed, ids, share);
  CountProduced(valid);  // as finished tensors, as Fill counts them
  return valid;
}

void Feed::CountProduced(int64_t valid) const {
  batches_produced_.fetch_add(1, std::memory_order_relaxed);
  samples_produced_.fetch_add(valid, std::memory_order_relaxed);
  bytes_produced_.fetch_add(layout_.tensor_bytes, std::memory_order_relaxed);
}

// Far enough ahead for the cache's prefetch threads to fetch a batch's blocks while the
// batches before it are filled and consumed; near enough that a feed's hints do not crowd
// the cache with blocks of the distant future.
constexpr int kReadHintSteps = 4;

void Feed::HintAhead(Position p, int32_t rank, size_t batch) const {
  Position ahead = p;
  for (int i = 0; i < kReadHintSteps; ++i) ahead = sampler_->Next(ahead);
  std::vector<int64_t> ids(batch);
  std::vector<uint64_t> places(batch);
  const int64_t valid = sampler_->RankSlice(ahead, rank, ids, places);
  const uint64_t n = sampler_->config().num_samples;
  for (int64_t i = 0; i < valid; ++i) {
    dataset_->WillRead(static_cast<uint64_t>(ids[static_cast<size_t>(i)]),
                       OrderPosition(ahead.epoch, n, places[static_cast<size_t>(i)]));
  }
}

absl::StatusOr<int64_t> Feed::FillImpl(Position p, int32_t rank, std::byte* slot,
                                       std::span<int64_t> ids, const ParallelFor& parallel,
                                       const FillDeadline& deadline,
                                       ShareCache::Member* share) const {
  metrics::StageTimer timer(counters(), metrics::Stage::kFill);
  Claimed claimed = Claim(p, rank, ids, share);
  absl::Cleanup end_fill = [&] { EndFill(claimed.rows, share); };
  if (dataset_->takes_read_hints()) HintAhead(p, rank, ids.size());
  const int64_t valid = claimed.valid;
  uint64_t row_bytes = 0;
  for (const TensorLayout& l : layout_.tensors) row_bytes += l.row_bytes;
  const size_t rows_per_chunk =
      static_cast<size_t>(std::max<uint64_t>(1, kChunkBytes / std::max<uint64_t>(row_bytes, 1)));
  const int chunks = static_cast<int>((ids.size() + rows_per_chunk - 1) / rows_per_chunk);
  std::vector<absl::Status> status(static_cast<size_t>(std::max(chunks, 1)));
  std::atomic<int64_t> done{0};
  std::atomic<bool> expired{false};
  auto read_chunk = [&](int chunk) {
    std::vector<std::span<std::byte>> rows(layout_.tensors.size());
    const size_t end = std::min(ids.size(), (static_cast<size_t>(chunk) + 1) * rows_per_chunk);
    for (size_t i = static_cast<size_t>(chunk) * rows_per_chunk; i < end; ++i) {
      if (expired.load(std::memory_order_relaxed) || deadline.expired()) {
        expired.store(true, std::memory_order_relaxed);
        return;
      }
      for (size_t t = 0; t < rows.size(); ++t) {
        const TensorLayout& l = layout_.tensors[t];
        rows[t] = std::span<std::byte>(slot + l.byte_offset + i * l.row_bytes, l.row_bytes);
      }
      // Caught here, on the thread that ran the chunk: the chunk's status, as a failed read.
      absl::StatusOr<uint64_t> used = CallCatching("reading it", [&] {
        const SampleContext context{spec_.seed, p.epoch};
        return claimed.rows.empty()
                   ? dataset_->ReadSampleAt(static_cast<uint64_t>(ids[i]), context, rows)
                   : images_->ReadImageAt(static_cast<uint64_t>(ids[i]), context, rows,
                                          &claimed.rows[i]);
      });
      BusyMark::Progress();  // one sample done (common/progress.h)
      done.fetch_add(1, std::memory_order_relaxed);
      if (!used.ok()) {
        status[static_cast<size_t>(chunk)] = Annotate(
            used.status(), absl::StrCat("sample ", ids[i], " of epoch ", p.epoch, " step ", p.step));
        return;
      }
      ids[i] = static_cast<int64_t>(*used);  // a replaced bad sample reports its replacement
    }
  };
  if (parallel != nullptr && chunks > 1) {
    parallel(chunks, read_chunk);
  } else {
    for (int c = 0; c < chunks; ++c) read_chunk(c);
  }
  if (expired.load()) return PastDeadline(p, deadline, done.load(), ids.size());
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = dataset_->CheckReadNotShrunk(ids); !s.ok()) {
    return Annotate(s, absl::StrCat("epoch ", p.epoch, " step ", p.step));
  }
  OfferDecoded(claimed, ids, share);
  CountProduced(valid);
  return valid;
}

}  // namespace gpufeed::server
