#include "server/feed/feed.h"

#include <stdlib.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/metrics.h"
#include "common/os/fd.h"
#include "common/status.h"

namespace gpufeed::server {
namespace {

constexpr uint64_t kTensorAlign = 256;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

}  // namespace

std::string FeedSpec::Canonical() const {
  std::string out = absl::StrCat(
      "kind=", static_cast<int>(dataset.kind), ";path=", dataset.path, ";token_dtype=",
      DTypeName(dataset.token_dtype), ";seq_len=", dataset.seq_len, ";vocab_size=",
      dataset.vocab_size, ";batch_size=", batch_size,
      ";world_size=", world_size, ";seed=", seed, ";shuffle=", shuffle, ";drop_last=", drop_last);
  if (dataset.kind == DatasetKind::kImageFolder) {
    absl::StrAppend(&out, ";pipeline=", PipelineCanonical(dataset.pipeline), ";bad_sample=",
                    static_cast<int>(dataset.bad_sample), ";max_pixels=", dataset.max_pixels);
  }
  return out;
}

std::string FeedKeyOf(const std::string& canonical) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : canonical) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return absl::StrFormat("%016x", h);
}

absl::StatusOr<std::shared_ptr<Feed>> Feed::Create(FeedSpec spec, FileSystem* fs) {
  GPUFEED_ASSIGN_OR_RETURN(std::unique_ptr<Dataset> dataset, OpenDataset(spec.dataset, fs));
  SamplerConfig config{dataset->num_samples(), spec.batch_size, spec.world_size,
                       spec.seed,              spec.shuffle,    spec.drop_last};
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
  return std::shared_ptr<Feed>(new Feed(std::move(spec), std::move(dataset), std::move(sampler)));
}

Feed::Feed(FeedSpec spec, std::unique_ptr<Dataset> dataset, std::unique_ptr<Sampler> sampler)
    : spec_(std::move(spec)),
      key_(FeedKeyOf(spec_.Canonical())),
      dataset_(std::move(dataset)),
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
  staged_layout_ = dataset_->StagedLayoutFor(spec_.batch_size);
}

absl::StatusOr<int64_t> Feed::FillStaged(Position p, int32_t rank, StageMode mode, std::byte* slot,
                                         std::span<int64_t> ids, const ParallelFor& parallel) const {
  if (!staged_layout_) return absl::FailedPreconditionError("the dataset has no staged form");
  metrics::StageTimer timer(metrics::Stage::kFill);
  const int64_t valid = sampler_->RankSlice(p, rank, ids);
  StageArena arena(*staged_layout_);
  const StageTarget target{mode, &*staged_layout_, slot, &arena};
  std::vector<absl::Status> status(ids.size());
  auto stage = [&](int i) {
    const size_t k = static_cast<size_t>(i);
    absl::StatusOr<uint64_t> used =
        dataset_->StageSampleAt(static_cast<uint64_t>(ids[k]), {spec_.seed, p.epoch}, i, target);
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
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  CountProduced(valid);  // as finished tensors, as Fill counts them
  return valid;
}

void Feed::CountProduced(int64_t valid) const {
  batches_produced_.fetch_add(1, std::memory_order_relaxed);
  samples_produced_.fetch_add(valid, std::memory_order_relaxed);
  bytes_produced_.fetch_add(layout_.tensor_bytes, std::memory_order_relaxed);
}

absl::StatusOr<int64_t> Feed::Fill(Position p, int32_t rank, std::byte* slot,
                                   std::span<int64_t> ids, const ParallelFor& parallel) const {
  metrics::StageTimer timer(metrics::Stage::kFill);
  const int64_t valid = sampler_->RankSlice(p, rank, ids);
  uint64_t row_bytes = 0;
  for (const TensorLayout& l : layout_.tensors) row_bytes += l.row_bytes;
  const size_t rows_per_chunk =
      static_cast<size_t>(std::max<uint64_t>(1, kChunkBytes / std::max<uint64_t>(row_bytes, 1)));
  const int chunks = static_cast<int>((ids.size() + rows_per_chunk - 1) / rows_per_chunk);
  std::vector<absl::Status> status(static_cast<size_t>(std::max(chunks, 1)));
  auto read_chunk = [&](int chunk) {
    std::vector<std::span<std::byte>> rows(layout_.tensors.size());
    const size_t end = std::min(ids.size(), (static_cast<size_t>(chunk) + 1) * rows_per_chunk);
    for (size_t i = static_cast<size_t>(chunk) * rows_per_chunk; i < end; ++i) {
      for (size_t t = 0; t < rows.size(); ++t) {
        const TensorLayout& l = layout_.tensors[t];
        rows[t] = std::span<std::byte>(slot + l.byte_offset + i * l.row_bytes, l.row_bytes);
      }
      absl::StatusOr<uint64_t> used =
          dataset_->ReadSampleAt(static_cast<uint64_t>(ids[i]), {spec_.seed, p.epoch}, rows);
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
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  if (absl::Status s = dataset_->CheckNotShrunk(); !s.ok()) {
    return Annotate(s, absl::StrCat("epoch ", p.epoch, " step ", p.step));
  }
  CountProduced(valid);
  return valid;
}

absl::StatusOr<std::shared_ptr<Feed>> FeedRegistry::GetOrCreate(const FeedSpec& requested) {
  FeedSpec spec = requested;
  // Canonicalise the path so "/data/x" and "/data/./x" share a feed.
  if (!spec.dataset.path.empty() && spec.dataset.path[0] == '/') {
    char resolved[PATH_MAX];
    if (::realpath(spec.dataset.path.c_str(), resolved) == nullptr) {
      return ErrnoToStatus(errno, absl::StrCat("dataset.path: ", spec.dataset.path));
    }
    spec.dataset.path = resolved;
  }
  const std::string key = FeedKeyOf(spec.Canonical());
  {
    absl::MutexLock lock(&mu_);
    auto it = feeds_.find(key);
    if (it != feeds_.end()) {
      if (std::shared_ptr<Feed> feed = it->second.lock()) return feed;
    }
  }
  GPUFEED_ASSIGN_OR_RETURN(std::shared_ptr<Feed> feed, Feed::Create(spec, fs_));
  absl::MutexLock lock(&mu_);
  // Two attaches may have raced to create it: keep the first, so both share one feed.
  auto& slot = feeds_[key];
  if (std::shared_ptr<Feed> existing = slot.lock()) return existing;
  slot = feed;
  // Drop entries of feeds nobody uses any more.
  absl::erase_if(feeds_, [](const auto& entry) { return entry.second.expired(); });
  return feed;
}

std::vector<std::shared_ptr<Feed>> FeedRegistry::List() const {
  std::vector<std::shared_ptr<Feed>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, weak] : feeds_) {
    if (std::shared_ptr<Feed> feed = weak.lock()) out.push_back(std::move(feed));
  }
  return out;
}

}  // namespace gpufeed::server
