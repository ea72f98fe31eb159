// Datasets: a source of fixed-size samples read with pread straight into staging memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/os/file.h"
#include "server/augment/pipeline.h"
#include "server/augment/stage_arena.h"
#include "server/augment/staged.h"

namespace gpufeed::server {

enum class DatasetKind { kUnspecified = 0, kTokens = 1, kRecords = 2, kImageFolder = 3 };
enum class BadSamplePolicy { kSkip = 1, kFail = 2 };

struct DatasetSpec {
  DatasetKind kind = DatasetKind::kUnspecified;
  std::string path;
  DType token_dtype = DType::kUnspecified;  // tokens: unset = the .npy header's, or uint16
  int64_t seq_len = 0;                      // tokens
  uint64_t vocab_size = 0;                  // tokens: checked on a sample at open; 0 = not
  std::vector<PipelineStep> pipeline;       // image_folder
  BadSamplePolicy bad_sample = BadSamplePolicy::kSkip;  // image_folder
  uint64_t max_pixels = 64'000'000;                      // image_folder
};

// What a sample's random augmentation depends on, besides its id.
struct SampleContext {
  uint64_t seed = 0;
  int64_t epoch = 0;
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
};

// One tensor of a sample: its element type and per-sample shape (no batch dimension).
struct SampleTensor {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;
  uint64_t byte_size = 0;  // per sample
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual uint64_t num_samples() const = 0;
  virtual const std::vector<SampleTensor>& tensors() const = 0;
  // Writes sample `id` (< num_samples) into rows[t] for each tensor t; rows[t] has exactly
  // tensors()[t].byte_size bytes. One copy from the page cache, no more. Thread-safe.
  virtual absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const = 0;
  // As ReadSample, for the sample's augmentation as of `context`; returns the id actually
  // written: a dataset whose policy skips bad samples writes a replacement instead.
  virtual absl::StatusOr<uint64_t> ReadSampleAt(uint64_t id, const SampleContext& context,
                                                std::span<const std::span<std::byte>> rows) const {
    absl::Status s = ReadSample(id, rows);
    if (!s.ok()) return s;
    return id;
  }
  // The staged layout of a batch of `batch` samples; nullopt when the dataset has no staged
  // form (only image datasets have one).
  virtual std::optional<StagedLayout> StagedLayoutFor(int64_t batch) const { return std::nullopt; }
  // Stages sample `id` as row `row` of a staged batch (its record, label and arena bytes) and
  // returns the id actually staged, as ReadSampleAt does.
  virtual absl::StatusOr<uint64_t> StageSampleAt(uint64_t id, const SampleContext& context,
                                                 int64_t row, const StageTarget& target) const {
    return absl::UnimplementedError("this dataset kind has no staged form");
  }
  // DATA_LOSS when the files read shrank since they were opened; called after each batch.
  virtual absl::Status CheckNotShrunk() const = 0;
  // Samples that could not be used, by reason ("truncated", ...), since the dataset opened.
  virtual std::vector<std::pair<std::string, int64_t>> bad_samples() const { return {}; }
};

// Opens and validates a dataset: NOT_FOUND / PERMISSION_DENIED naming the path, and
// INVALID_ARGUMENT naming the field ("dataset.seq_len: ...") for what cannot be served.
absl::StatusOr<std::unique_ptr<Dataset>> OpenDataset(const DatasetSpec& spec, FileSystem* fs);

}  // namespace gpufeed::server
