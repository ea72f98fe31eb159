// The webdataset dataset kind: each sample is a tar member of the shards' index
// (reader/webdataset.h), read by pread from its shard, held open since the index was built.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/decode/image_decoder.h"
#include "server/images/dataset.h"
#include "server/images/image_source.h"
#include "server/reader/shards.h"
#include "server/reader/webdataset.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

class TarSource final : public ImageSource {
 public:
  explicit TarSource(WebDatasetIndex index)
      : index_(std::move(index)), notices_(WebDatasetNotices(index_)) {}

  uint64_t size() const override { return index_.samples.size(); }
  int64_t label(uint64_t id) const override { return index_.samples[id].label; }
  std::string name(uint64_t id) const override { return index_.display(id); }

  // A member larger than max_bytes is too_large (never read). A read that fails is the
  // shard's, not the sample's (the shard shrank: DATA_LOSS, or an I/O error) and ends the fill.
  absl::StatusOr<std::vector<uint8_t>> Read(uint64_t id, uint64_t max_bytes) const override {
    const WebDatasetSample& s = index_.samples[id];
    if (s.size > max_bytes) {
      return MarkBadImage(
          absl::InvalidArgumentError(absl::StrCat(
              "the member holds ", s.size, " bytes, more than max_image_bytes (", max_bytes, ")")),
          BadImage::kTooLarge);
    }
    std::vector<uint8_t> bytes(s.size);
    absl::Status read = index_.shards[s.shard].file->ReadAt(
        s.offset, std::as_writable_bytes(std::span<uint8_t>(bytes)));
    if (!read.ok()) {
      return absl::Status(read.code(), absl::StrCat("reading ", index_.display(id), " (", s.size,
                                                    " bytes at ", s.offset, "): ", read.message()));
    }
    return bytes;
  }

  // The shards the batch read, each once (all of them for no ids).
  absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const override {
    return CheckShardsNotShrunk(
        index_.shards.size(), ids,
        [this](size_t k) -> const RandomAccessFile& { return *index_.shards[k].file; },
        [this](int64_t id) -> size_t { return index_.samples[static_cast<uint64_t>(id)].shard; });
  }

  std::string ContentIdentity() const override {
    return ShardsIdentity(
        index_.shards.size(),
        [this](size_t k) -> const std::string& { return index_.shards[k].name; },
        [this](size_t k) -> const RandomAccessFile& { return *index_.shards[k].file; });
  }

  std::vector<DatasetNotice> notices() const override { return notices_; }

  bool takes_read_hints() const override {
    return !index_.shards.empty() && index_.shards.front().file->takes_read_hints();
  }
  void WillRead(uint64_t id, uint64_t next_use) const override {
    if (id >= index_.samples.size()) return;
    const WebDatasetSample& s = index_.samples[id];
    index_.shards[s.shard].file->WillRead(s.offset, s.size, next_use);
  }

 private:
  const WebDatasetIndex index_;
  const std::vector<DatasetNotice> notices_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ImageDataset>> OpenWebDataset(const DatasetSpec& spec,
                                                             FileSystem* fs) {
  // Refused before the indexing: a bad pipeline costs no file system work.
  if (absl::StatusOr<PipelinePlan> plan = CompilePipeline(spec.pipeline); !plan.ok()) {
    return plan.status();
  }
  GPUFEED_ASSIGN_OR_RETURN(
      WebDatasetIndex index,
      IndexWebDataset(spec, fs, spec.reader.has_value() ? &*spec.reader : nullptr, spec.walk,
                      /*skip_imageless=*/spec.bad_sample == BadSamplePolicy::kSkip));
  auto source = std::make_unique<TarSource>(std::move(index));
  for (const DatasetNotice& n : source->notices()) {
    spdlog::info("webdataset {}: {}", EscapeForLog(spec.path), n.message);
  }
  return MakeImageDataset(std::move(source), spec);
}

}  // namespace gpufeed::server
