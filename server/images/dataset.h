// The feed's datasets as the pipeline sees them: the full dataset spec (a file dataset's, plus
// an image dataset's pipeline and bad-sample policy), image datasets with their staged form
// for the GPU paths, and OpenDataset for every kind. Readers (server/reader/) only count,
// describe and read samples; decoding, augmenting and staging are this module's.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "common/os/file.h"
#include "common/os/peer_cred.h"
#include "server/augment/pipeline.h"
#include "server/augment/stage_arena.h"
#include "server/augment/staged.h"
#include "server/decode/image_decoder.h"
#include "server/images/cpu_rows.h"
#include "server/reader/dataset.h"
#include "server/reader/image_folder.h"
#include "server/share/share_cache.h"

namespace gpufeed::server {

enum class BadSamplePolicy { kSkip = 1, kFail = 2 };

struct DatasetSpec : FileDatasetSpec {
  // Image kinds (IsImageKind: image_folder, webdataset) only, as the fields below.
  std::vector<PipelineStep> pipeline;
  BadSamplePolicy bad_sample = BadSamplePolicy::kSkip;
  uint64_t max_pixels = 64'000'000;
  // A larger image file (or tar member) is a bad sample (too_large), never read. The daemon's
  // max_image_bytes (FeedLimits), not the request's; no part of the feed's key.
  uint64_t max_image_bytes = uint64_t{64} << 20;
  // A random resized crop decodes only its crop box of a JPEG (DecodeOptions::region): the
  // same pixels, less work. The daemon's region_decode (FeedLimits); no part of the key.
  bool region_decode = true;
  // Set by the feed registry, never from a request (not part of the key): a dataset with a
  // directory descriptor (fd >= 0) reads the files beneath it only where their mode bits let
  // `reader` read them.
  std::optional<PeerCred> reader;
  // Set by the feed registry (not part of the key): the dataset's (device, inode) and its
  // reader's rights, as the registry keys feeds by them; a sharing group's jobs must agree.
  std::string resolved;
  // Set by the feed (FeedLimits::counters), never from a request (not part of the key): where
  // an image dataset records its reads, decodes and augmentations; null: counters of its own.
  std::shared_ptr<metrics::Counters> counters;
};

// How the samples of a batch reach the slot: finished on the CPU (kNone), or staged for the
// GPU (augment/staged.h), decoded on the CPU (kCpuDecode) or by nvJPEG where it can (kNvjpeg).
enum class StageMode { kNone = 0, kCpuDecode = 1, kNvjpeg = 2 };
// What Attach asks for; resolved to a StageMode by the session manager.
enum class DecodeChoice { kAuto = 0, kCpu = 1, kNvjpeg = 2 };
enum class AugmentChoice { kAuto = 0, kCpu = 1, kGpu = 2 };

// One row of a staged batch being written: the host slot, its layout and its arena.
struct StageTarget {
  StageMode mode = StageMode::kCpuDecode;
  const StagedLayout* layout = nullptr;
  std::byte* slot = nullptr;
  StageArena* arena = nullptr;
  // kNvjpeg: the rows decoded on the CPU all the same (images/cpu_rows.h).
  CpuRows cpu;
};

// A sharing group's part in one row (server/share/share_cache.h): the sample's whole decode
// from the group's cache, or, for a sample a member behind will read, this row's whole decode
// for the cache. In a group every decode is whole, so a row gives the same bytes whichever way
// it goes (found or decoded, wanted or not), and the same as a private read but for a JPEG
// damaged only below its crop box (a region decode passes it; a whole decode counts it bad).
struct SharedRow {
  std::shared_ptr<const Image> found;    // in: the group's decode of the sample
  bool wanted = false;                   // in, without `found`: decode the file whole
  std::shared_ptr<const Image> decoded;  // out, when wanted: that whole decode
  // in, without `found`: the sample's decode in flight in the group; the row decodes it only
  // where no other row has started it, else takes that decode (SharePending).
  std::shared_ptr<SharePending> pending;
  // A group across uids: the uid whose rights this row reads with (in), and whether `found`
  // was decoded for another uid (in; set too when the decode waited for was another uid's).
  // Such an image is used only after this row's own open of the file succeeds (ImageSource::
  // CheckReadable); where it fails, the row reads the file itself, as without the group.
  uint32_t uid = 0;
  bool check_read = false;
  enum class ReadCheck { kNone, kPassed, kRefused };
  ReadCheck read_check = ReadCheck::kNone;  // out
};

// A dataset of images: finished on the CPU through ReadSampleAt, or staged for the GPU.
class ImageDataset : public Dataset {
 public:
  // ReadSampleAt with the row's share of a sharing group (null: none). A pipeline with
  // dct_scaling decodes each sample at its own scale and shares nothing.
  virtual absl::StatusOr<uint64_t> ReadImageAt(uint64_t id, const SampleContext& context,
                                               std::span<const std::span<std::byte>> rows,
                                               SharedRow* share) const = 0;
  // A digest (FNV-1a, 64 bits, hex) of the exact sample list: each sample's name beneath the
  // dataset's root and its label, in id order. Two uids' datasets of the same root with the
  // same digest name the same files by the same ids (a sharing group across uids). Computed
  // once, on first use.
  virtual std::string SampleListDigest() const = 0;
  // The staged layout of a batch of `batch` samples.
  virtual StagedLayout StagedLayoutFor(int64_t batch) const = 0;
  // Stages sample `id` as row `row` of a staged batch (its record, label and arena bytes) and
  // returns the id actually staged, as ReadSampleAt does. `share` as ReadImageAt's, on the
  // CPU decode path only (kCpuDecode: nvJPEG's pixels are not the CPU decoder's).
  virtual absl::StatusOr<uint64_t> StageSampleAt(uint64_t id, const SampleContext& context,
                                                 int64_t row, const StageTarget& target,
                                                 SharedRow* share = nullptr) const = 0;
};

absl::StatusOr<std::unique_ptr<ImageDataset>> OpenImageFolder(const DatasetSpec& spec,
                                                              FileSystem* fs);
// WebDataset tar shards (reader/webdataset.h): a directory, a glob or brace pattern, or one
// tar file.
absl::StatusOr<std::unique_ptr<ImageDataset>> OpenWebDataset(const DatasetSpec& spec,
                                                             FileSystem* fs);

// Opens and validates a dataset of any kind: NOT_FOUND / PERMISSION_DENIED naming the path,
// and INVALID_ARGUMENT naming the field ("dataset.seq_len: ...") for what cannot be served.
absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(const DatasetSpec& spec, FileSystem* fs);

}  // namespace gpufeed::server
