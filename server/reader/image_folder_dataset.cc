// The image_folder dataset kind: each sample is a file decoded (libjpeg-turbo / libpng) and
// augmented on the CPU by the feed's pipeline, written as `image` and `label` rows.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/augment/crop.h"
#include "server/augment/pipeline.h"
#include "server/augment/resize.h"
#include "server/decode/image_decoder.h"
#include "server/reader/dataset.h"
#include "server/reader/image_folder.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// A bad sample is replaced by the next one; a run this long of bad files ends the feed.
constexpr int kMaxReplacements = 32;

constexpr BadImage kReasons[] = {BadImage::kEmpty,     BadImage::kNotAnImage, BadImage::kUnsupported,
                                 BadImage::kTruncated, BadImage::kCorrupt,    BadImage::kTooLarge};

class ImageFolderDataset final : public Dataset {
 public:
  ImageFolderDataset(ImageFolderIndex index, PipelinePlan plan, const DatasetSpec& spec,
                     FileSystem* fs)
      : index_(std::move(index)),
        plan_(std::move(plan)),
        policy_(spec.bad_sample),
        max_pixels_(spec.max_pixels),
        fs_(fs) {
    const int h = plan_.out_height, w = plan_.out_width;
    std::vector<int64_t> shape = plan_.output.layout == Layout::kNCHW
                                     ? std::vector<int64_t>{3, h, w}
                                     : std::vector<int64_t>{h, w, 3};
    tensors_.push_back({"image", plan_.output.dtype, shape, OutputBytes(plan_.output, h, w)});
    tensors_.push_back({"label", DType::kInt64, {}, 8});
  }

  uint64_t num_samples() const override { return index_.paths.size(); }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }
  absl::Status CheckNotShrunk() const override { return absl::OkStatus(); }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    absl::StatusOr<uint64_t> used = ReadSampleAt(id, SampleContext{}, rows);
    return used.status();
  }

  absl::StatusOr<uint64_t> ReadSampleAt(uint64_t id, const SampleContext& context,
                                        std::span<const std::span<std::byte>> rows) const override {
    const uint64_t n = index_.paths.size();
    for (int attempt = 0; attempt <= kMaxReplacements; ++attempt) {
      const uint64_t sample = (id + static_cast<uint64_t>(attempt)) % n;
      absl::StatusOr<Image> image = Load(sample);
      if (image.ok()) {
        Augment(*image, SampleRandom(context.seed, context.epoch, sample), rows[0].data());
        const int64_t label = index_.labels[sample];
        std::memcpy(rows[1].data(), &label, sizeof(label));
        return sample;
      }
      const BadImage reason = BadImageOf(image.status());
      if (reason == BadImage::kNone) return image.status();  // an I/O error, not the image
      // Counted once per requested sample (attempt 0); replacements that hit a bad file are
      // logged but not counted again, so each bad file counts once per epoch.
      Count(sample, reason, image.status(), attempt == 0);
      if (policy_ == BadSamplePolicy::kFail) {
        return absl::DataLossError(absl::StrCat("image ", index_.paths[sample], " (",
                                                BadImageName(reason), "): ", image.status().message()));
      }
    }
    return absl::DataLossError(absl::StrCat(kMaxReplacements + 1, " images in a row from ",
                                            index_.paths[id], " cannot be decoded"));
  }

  std::vector<std::pair<std::string, int64_t>> bad_samples() const override {
    std::vector<std::pair<std::string, int64_t>> out;
    for (size_t i = 0; i < std::size(kReasons); ++i) {
      out.emplace_back(BadImageName(kReasons[i]), bad_[i].load(std::memory_order_relaxed));
    }
    return out;
  }

 private:
  absl::StatusOr<Image> Load(uint64_t sample) const {
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = fs_->OpenForRead(index_.paths[sample]);
    if (!file.ok()) return file.status();
    std::vector<uint8_t> bytes((*file)->size());
    absl::Status read = (*file)->ReadAt(0, std::as_writable_bytes(std::span<uint8_t>(bytes)));
    if (!read.ok()) return read;
    DecodeOptions options;
    options.max_pixels = max_pixels_;
    return DecodeImage(bytes, options);
  }

  void Count(uint64_t sample, BadImage reason, const absl::Status& status, bool count) const {
    for (size_t i = 0; i < std::size(kReasons) && count; ++i) {
      if (kReasons[i] == reason) bad_[i].fetch_add(1, std::memory_order_relaxed);
    }
    bool first;
    {
      absl::MutexLock lock(&mu_);
      first = logged_.insert(sample).second;
    }
    if (first) {  // once per file, not once per epoch
      spdlog::warn("bad image {} ({}): {}{}", index_.paths[sample], BadImageName(reason),
                   std::string(status.message()), policy_ == BadSamplePolicy::kSkip ? "; replaced" : "");
    }
  }

  // Geometry (torchvision order: crop, resize, then flip), then the output stage.
  void Augment(const Image& image, SampleRandom random, std::byte* out) const {
    const int oh = plan_.out_height, ow = plan_.out_width;
    std::vector<float> pixels(static_cast<size_t>(oh) * ow * 3);
    if (plan_.random_resized_crop) {
      const CropBox box = RandomResizedCropBox(image.height, image.width,
                                               plan_.random_resized_crop->options, random);
      const bool flip = plan_.flip_p > 0 && random.Uniform(0, 1) < plan_.flip_p;
      ResizedCrop(image, box, oh, ow, flip, pixels.data());
    } else {
      // An optional resize of the whole image, then the centre crop (zero padding where the
      // crop is larger, as torchvision's CenterCrop pads), then the flip.
      int sh = image.height, sw = image.width;
      std::vector<float> resized;
      if (plan_.resize) {
        ResizeShorterSide(image.height, image.width, plan_.resize->shorter_side, &sh, &sw);
        resized.resize(static_cast<size_t>(sh) * sw * 3);
        ResizedCrop(image, {0, 0, image.height, image.width}, sh, sw, false, resized.data());
      }
      const CropBox box = CenterCropBox(sh, sw, oh, ow);
      const bool flip = plan_.flip_p > 0 && random.Uniform(0, 1) < plan_.flip_p;
      // Reads the crop straight from the resized floats or the decoded bytes.
      auto crop = [&](const auto* source) {
        for (int y = 0; y < oh; ++y) {
          for (int x = 0; x < ow; ++x) {
            const int sy = box.top + y, sx = box.left + x;
            float* d = &pixels[(static_cast<size_t>(y) * ow + (flip ? ow - 1 - x : x)) * 3];
            const bool inside = sy >= 0 && sy < sh && sx >= 0 && sx < sw;
            const auto* s = source + (static_cast<size_t>(inside ? sy : 0) * sw + (inside ? sx : 0)) * 3;
            for (int c = 0; c < 3; ++c) d[c] = inside ? static_cast<float>(s[c]) : 0.0f;
          }
        }
      };
      if (plan_.resize) {
        crop(resized.data());
      } else {
        crop(image.rgb.data());
      }
    }
    WriteImage(pixels.data(), oh, ow, plan_.output, out);
  }

  const ImageFolderIndex index_;
  const PipelinePlan plan_;
  const BadSamplePolicy policy_;
  const uint64_t max_pixels_;
  FileSystem* const fs_;
  std::vector<SampleTensor> tensors_;
  mutable std::atomic<int64_t> bad_[std::size(kReasons)] = {};
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_set<uint64_t> logged_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> OpenImageFolder(const DatasetSpec& spec, FileSystem* fs) {
  absl::StatusOr<PipelinePlan> plan = CompilePipeline(spec.pipeline);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(spec.path);
  if (!index.ok()) return index.status();
  return std::make_unique<ImageFolderDataset>(std::move(*index), std::move(*plan), spec, fs);
}

}  // namespace gpufeed::server
