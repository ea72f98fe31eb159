// Image datasets (image_folder, webdataset): each sample's encoded bytes, from its ImageSource,
// decoded (libjpeg-turbo / libpng) and augmented on the CPU by the feed's pipeline and
// written as `image` and `label` rows, or staged for the GPU paths.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "server/augment/crop.h"
#include "server/augment/fast_augment.h"
#include "server/augment/pipeline.h"
#include "server/decode/image_decoder.h"
#include "server/images/dataset.h"
#include "server/images/image_source.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {
namespace {

// A bad sample is replaced by the next one; a run this long of bad files ends the feed.
constexpr int kMaxReplacements = 32;
// How long a row waits for another row's decode of its sample (a started decode, which waits
// for nothing) before it decodes the file itself: far above any one decode.
constexpr absl::Duration kSharedDecodeWait = absl::Seconds(30);

class SourcedImageDataset final : public ImageDataset {
 public:
  SourcedImageDataset(std::unique_ptr<ImageSource> source, PipelinePlan plan,
                      const DatasetSpec& spec)
      : source_(std::move(source)),
        plan_(std::move(plan)),
        policy_(spec.bad_sample),
        max_pixels_(spec.max_pixels),
        max_image_bytes_(spec.max_image_bytes),
        region_decode_(spec.region_decode),
        counters_(spec.counters != nullptr ? spec.counters
                                           : std::make_shared<metrics::Counters>()) {
    const int h = plan_.out_height, w = plan_.out_width;
    std::vector<int64_t> shape = plan_.output.layout == Layout::kNCHW
                                     ? std::vector<int64_t>{3, h, w}
                                     : std::vector<int64_t>{h, w, 3};
    tensors_.push_back({"image", plan_.output.dtype, shape, OutputBytes(plan_.output, h, w)});
    tensors_.push_back({"label", DType::kInt64, {}, 8});
  }

  uint64_t num_samples() const override { return source_->size(); }
  const std::vector<SampleTensor>& tensors() const override { return tensors_; }
  absl::Status CheckNotShrunk() const override { return source_->CheckReadNotShrunk({}); }
  absl::Status CheckReadNotShrunk(std::span<const int64_t> ids) const override {
    return source_->CheckReadNotShrunk(ids);
  }
  std::string ContentIdentity() const override { return source_->ContentIdentity(); }
  bool takes_read_hints() const override { return source_->takes_read_hints(); }
  void WillRead(uint64_t id, uint64_t next_use) const override { source_->WillRead(id, next_use); }
  std::vector<DatasetNotice> notices() const override { return source_->notices(); }

  absl::Status ReadSample(uint64_t id, std::span<const std::span<std::byte>> rows) const override {
    absl::StatusOr<uint64_t> used = ReadSampleAt(id, SampleContext{}, rows);
    return used.status();
  }

  absl::StatusOr<uint64_t> ReadSampleAt(uint64_t id, const SampleContext& context,
                                        std::span<const std::span<std::byte>> rows) const override {
    return ReadImageAt(id, context, rows, nullptr);
  }

  absl::StatusOr<uint64_t> ReadImageAt(uint64_t id, const SampleContext& context,
                                       std::span<const std::span<std::byte>> rows,
                                       SharedRow* share) const override {
    return WithReplacement(id, [&](uint64_t sample) -> absl::Status {
      SampleRandom random(context.seed, context.epoch, sample);
      StagedGeometry g;
      absl::StatusOr<std::shared_ptr<const Image>> image =
          DecodeShared(sample, sample == id ? share : nullptr, random, &g);
      if (!image.ok()) return image.status();
      Augment(**image, g, rows[0].data());
      const int64_t label = source_->label(sample);
      std::memcpy(rows[1].data(), &label, sizeof(label));
      return absl::OkStatus();
    });
  }

  std::string SampleListDigest() const override {
    absl::call_once(digest_once_, [this] {
      uint64_t h = 0xcbf29ce484222325ULL;
      const auto mix = [&h](absl::string_view text) {
        for (const char c : text) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ULL;
        h = (h ^ 0xffu) * 0x100000001b3ULL;  // no name or label runs into the next
      };
      for (uint64_t id = 0; id < source_->size(); ++id) {
        mix(source_->SampleName(id));
        mix(absl::StrCat(source_->label(id)));
      }
      digest_ = absl::StrFormat("%016x", h);
    });
    return digest_;
  }

  StagedLayout StagedLayoutFor(int64_t batch) const override {
    return MakeStagedLayout(batch, plan_.output, plan_.out_height, plan_.out_width);
  }

  absl::StatusOr<uint64_t> StageSampleAt(uint64_t id, const SampleContext& context, int64_t row,
                                         const StageTarget& target,
                                         SharedRow* share) const override {
    const StagedLayout& layout = *target.layout;
    auto* record = reinterpret_cast<StagedRecord*>(target.slot + layout.records_offset) + row;
    std::byte* arena = target.slot + layout.arena_offset;
    return WithReplacement(id, [&](uint64_t sample) -> absl::Status {
      SampleRandom random(context.seed, context.epoch, sample);
      *record = StagedRecord{};
      bool staged = false;
      // nvJPEG's rows need the file's bytes here; the CPU's are read by DecodeShared (a
      // group's row found in the cache reads nothing).
      std::optional<std::vector<uint8_t>> bytes;
      if (target.mode == StageMode::kNvjpeg && target.cpu.share < 1) {
        absl::StatusOr<std::vector<uint8_t>> read = ReadFile(sample);
        if (!read.ok()) return read.status();
        bytes = std::move(*read);
        DecodeOptions options;
        options.max_pixels = max_pixels_;
        absl::StatusOr<JpegHeader> header = InspectJpeg(*bytes, options);
        if (!header.ok()) return header.status();
        // The geometry from a copy of the draws: a row the CPU takes draws them again.
        SampleRandom draws = random;
        absl::StatusOr<StagedGeometry> g = header->gpu_decodable
                                               ? PlanGeometry(header->height, header->width, draws)
                                               : StagedGeometry{};
        if (!g.ok()) return g.status();
        // CostBin records the row's estimate in the session's histogram: once, for the rows
        // nvJPEG could take.
        const bool to_nvjpeg =
            header->gpu_decodable && !target.cpu.Takes(row, CostBin(*header, *g, target.cpu));
        StageArena::Claim claim;
        const uint64_t decoded = static_cast<uint64_t>(header->height) * header->width * 3;
        if (to_nvjpeg && target.arena->TryClaim(bytes->size(), decoded, &claim)) {
          std::memcpy(arena + claim.host_offset, bytes->data(), bytes->size());
          record->kind = StagedKind::kJpeg;
          record->geometry = *g;
          record->host_offset = claim.host_offset;
          record->host_bytes = bytes->size();
          record->device_offset = claim.device_offset;
          record->device_bytes = decoded;
          staged = true;
          Count(metrics::Decoder::kNvjpeg);
        }
      }
      if (!staged) {
        StagedGeometry g;
        absl::StatusOr<std::shared_ptr<const Image>> image =
            DecodeShared(sample, sample == id ? share : nullptr, random, &g,
                         bytes.has_value() ? &*bytes : nullptr);
        if (!image.ok()) return image.status();
        StageDecoded(**image, g, target, record);
      }
      const int64_t label = source_->label(sample);
      std::memcpy(target.slot + layout.labels_offset + row * sizeof(int64_t), &label,
                  sizeof(label));
      return absl::OkStatus();
    });
  }

  std::vector<std::pair<std::string, int64_t>> bad_samples() const override {
    std::vector<std::pair<std::string, int64_t>> out;
    for (size_t i = 0; i < std::size(kBadImageReasons); ++i) {
      out.emplace_back(BadImageName(kBadImageReasons[i]), bad_[i].load(std::memory_order_relaxed));
    }
    return out;
  }

 private:
  absl::StatusOr<std::vector<uint8_t>> ReadFile(uint64_t sample) const {
    metrics::StageTimer timer(*counters_, metrics::Stage::kRead);
    return source_->Read(sample, max_image_bytes_);
  }

  absl::StatusOr<Image> Decode(std::span<const uint8_t> bytes, int scale_denom = 1,
                               CropBox region = {}) const {
    metrics::StageTimer timer(*counters_, metrics::Stage::kDecode);
    DecodeOptions options;
    options.max_pixels = max_pixels_;
    options.scale_denom = scale_denom;
    options.region = region;
    // Under bad_sample fail every damaged file must end the stream, wherever the damage lies;
    // under skip, one damaged only below the crop box gives the box (its own pixels).
    options.region_checks_whole_file = policy_ == BadSamplePolicy::kFail;
    return DecodeImage(bytes, options);
  }

  // Decodes `bytes` and plans the sample's geometry (`*g`, drawing from `random`). A JPEG's
  // geometry is planned on its size from the header when only part of it is read: the same
  // crop as after a whole decode, the same draws. With DCT scaling the file is then decoded at
  // the smallest scale that leaves the crop at least as many pixels as it is resized to, and
  // the crop is mapped onto the scaled image. With a random resized crop only the crop box
  // is decoded (a region decode: bit-equal pixels, less work), and the geometry names the
  // crop within the window returned.
  absl::StatusOr<Image> DecodePlanned(std::span<const uint8_t> bytes, SampleRandom& random,
                                      StagedGeometry* g) const {
    const bool region = region_decode_ && plan_.random_resized_crop.has_value();
    if (plan_.dct_scaling || region) {
      DecodeOptions options;
      options.max_pixels = max_pixels_;
      absl::StatusOr<JpegHeader> header = InspectJpeg(bytes, options);
      if (!header.ok()) return header.status();
      if (header->height > 0) {  // a JPEG
        absl::StatusOr<StagedGeometry> planned =
            PlanGeometry(header->height, header->width, random);
        if (!planned.ok()) return planned.status();
        *g = *planned;
        int denom = plan_.dct_scaling ? 8 : 1;
        while (denom > 1 && (g->crop_height / denom < g->resize_height ||
                             g->crop_width / denom < g->resize_width)) {
          denom /= 2;
        }
        // TurboJPEG's scaled size, ceil(size / denom).
        const int scaled_height = (header->height + denom - 1) / denom;
        const int scaled_width = (header->width + denom - 1) / denom;
        if (denom != 1)
          ScaleGeometry(header->height, header->width, scaled_height, scaled_width, g);
        if (region) {
          options.region = {g->crop_top, g->crop_left, g->crop_height, g->crop_width};
        }
        absl::StatusOr<Image> image = Decode(bytes, denom, options.region);
        if (!image.ok()) return image;
        const bool cut = image->height < scaled_height || image->width < scaled_width;
        Count(cut ? metrics::Decoder::kCpuRegion : metrics::Decoder::kCpu);
        g->src_height = image->height;
        g->src_width = image->width;
        g->crop_top -= image->top;
        g->crop_left -= image->left;
        return image;
      }
    }
    absl::StatusOr<Image> image = Decode(bytes);
    if (!image.ok()) return image;
    Count(metrics::Decoder::kCpu);
    absl::StatusOr<StagedGeometry> planned = PlanGeometry(image->height, image->width, random);
    if (!planned.ok()) return planned.status();
    *g = *planned;
    return image;
  }

  // The sample's pixels and geometry with a sharing group's row (null: none): the group's
  // decode where the row found one (no read, no decode), else a whole decode, handed back for
  // the group where one is wanted; without a group, DecodePlanned's. A whole decode plans the
  // geometry on the image's size as DecodePlanned plans it on the header's: the same draws,
  // the same box. `read`: the file's bytes where the caller read them already (null: read
  // here).
  absl::StatusOr<std::shared_ptr<const Image>> DecodeShared(
      uint64_t sample, SharedRow* share, SampleRandom& random, StagedGeometry* g,
      const std::vector<uint8_t>* read = nullptr) const {
    if (share != nullptr && plan_.dct_scaling) share = nullptr;
    // Another row of the group started this sample's decode: take it (a started decode waits
    // for nothing); where it failed, decode here.
    std::shared_ptr<SharePending> pending;
    if (share != nullptr && share->found == nullptr && share->pending != nullptr) {
      if (share->pending->TryStart(share->uid)) {
        pending = share->pending;
      } else {
        share->found = share->pending->Wait(kSharedDecodeWait);
        share->check_read = share->pending->decoder_uid() != share->uid;
      }
    }
    // A decode made for another uid of a group across uids: this row's uid may have it only
    // where it may read the file itself, opened as this row's own read would open it. Where
    // it may not, the row reads the file itself, which fails as it fails without the group.
    if (share != nullptr && share->found != nullptr && share->check_read) {
      const bool readable = source_->CheckReadable(sample).ok();
      share->read_check = readable ? SharedRow::ReadCheck::kPassed : SharedRow::ReadCheck::kRefused;
      if (!readable) share->found = nullptr;
    }
    // This row decodes for the group: whatever happens below, the rows waiting are woken.
    std::shared_ptr<const Image> finished;
    absl::Cleanup finish = [&] {
      if (pending != nullptr) pending->Finish(finished);
    };
    if (share != nullptr && share->found != nullptr) {
      absl::StatusOr<StagedGeometry> planned =
          PlanGeometry(share->found->height, share->found->width, random);
      if (!planned.ok()) return planned.status();
      *g = *planned;
      return share->found;
    }
    absl::StatusOr<std::vector<uint8_t>> own;
    if (read == nullptr) {
      own = ReadFile(sample);
      if (!own.ok()) return own.status();
      read = &*own;
    }
    const std::vector<uint8_t>& bytes = *read;
    if (share == nullptr) {
      absl::StatusOr<Image> image = DecodePlanned(bytes, random, g);
      if (!image.ok()) return image.status();
      return std::make_shared<const Image>(std::move(*image));
    }
    // In a group every decode is whole, wanted or not: a region decode passes a file damaged
    // only below its box, which a whole decode refuses, and the job's bytes must not depend on
    // whether another job was behind it.
    absl::StatusOr<Image> image = Decode(bytes);
    if (!image.ok()) return image.status();
    Count(metrics::Decoder::kCpu);
    absl::StatusOr<StagedGeometry> planned = PlanGeometry(image->height, image->width, random);
    if (!planned.ok()) return planned.status();
    *g = *planned;
    auto decoded = std::make_shared<const Image>(std::move(*image));
    if (share->wanted) share->decoded = decoded;
    finished = decoded;
    return decoded;
  }

  // The bin of a region decode's estimated cost (cpu_rows.h) for a row of decode auto, recorded
  // in the session's histogram; none where the CPU would decode the file whole.
  std::optional<int> CostBin(const JpegHeader& header, const StagedGeometry& g,
                             const CpuRows& cpu) const {
    if (cpu.costs == nullptr || cpu.share <= 0 || !region_decode_ ||
        !plan_.random_resized_crop.has_value()) {
      return std::nullopt;
    }
    const int bin = RowCosts::BinOf(
        RegionDecodeCost(header.height, header.width, g.crop_top, g.crop_height, g.crop_width));
    cpu.costs->Record(bin);
    return bin;
  }

  void Count(metrics::Decoder decoder) const {
    counters_->decodes(decoder).fetch_add(1, std::memory_order_relaxed);
  }

  // Maps a geometry planned on a height x width image onto the same image decoded at
  // scaled_height x scaled_width: the crop box scales, the resize and window stay.
  static void ScaleGeometry(int height, int width, int scaled_height, int scaled_width,
                            StagedGeometry* g) {
    auto scale = [](int v, int from, int to) {
      return static_cast<int>(static_cast<int64_t>(v) * to / from);
    };
    g->src_height = scaled_height;
    g->src_width = scaled_width;
    g->crop_top = scale(g->crop_top, height, scaled_height);
    g->crop_left = scale(g->crop_left, width, scaled_width);
    g->crop_height =
        std::clamp(scale(g->crop_height, height, scaled_height), 1, scaled_height - g->crop_top);
    g->crop_width =
        std::clamp(scale(g->crop_width, width, scaled_width), 1, scaled_width - g->crop_left);
  }

  // Runs `attempt` on `id`, then on the samples after it while they are bad images and the
  // policy skips them; returns the sample that succeeded. A bad image is counted once per
  // requested sample and logged once per file; an error that is not about the image (I/O)
  // ends the attempt at once.
  template <typename F>
  absl::StatusOr<uint64_t> WithReplacement(uint64_t id, F attempt) const {
    const uint64_t n = source_->size();
    for (int replacement = 0; replacement <= kMaxReplacements; ++replacement) {
      const uint64_t sample = (id + static_cast<uint64_t>(replacement)) % n;
      absl::Status status = attempt(sample);
      if (status.ok()) return sample;
      const BadImage reason = BadImageOf(status);
      if (reason == BadImage::kNone) return status;  // not about this file: internal
      // Counted once per requested sample (replacement 0); replacements that hit a bad file
      // are logged but not counted again, so each bad file counts once per epoch.
      Count(sample, reason, status, replacement == 0);
      if (policy_ == BadSamplePolicy::kFail) {
        return absl::DataLossError(absl::StrCat("image ", source_->name(sample), " (",
                                                BadImageName(reason), "): ", status.message()));
      }
    }
    return absl::DataLossError(absl::StrCat(kMaxReplacements + 1, " images in a row from ",
                                            source_->name(id), " cannot be decoded"));
  }

  void Count(uint64_t sample, BadImage reason, const absl::Status& status, bool count) const {
    for (size_t i = 0; i < std::size(kBadImageReasons) && count; ++i) {
      if (kBadImageReasons[i] == reason) bad_[i].fetch_add(1, std::memory_order_relaxed);
    }
    bool first;
    {
      absl::MutexLock lock(&mu_);
      first = logged_.insert(sample).second;
    }
    if (first) {  // once per file, not once per epoch
      spdlog::warn("bad image {} ({}): {}{}", EscapeForLog(source_->name(sample)),
                   BadImageName(reason), EscapeForLog(status.message()),
                   policy_ == BadSamplePolicy::kSkip ? "; replaced" : "");
    }
  }

  // A sample's geometry on an image of height x width, drawing from `random` in torchvision's
  // order: the crop box (random resized crop), then the flip. A resize past the pixel cap
  // (a 1 x 65536 image resized to a shorter side of 256 is 256 x 16M) is a bad image,
  // too_large, as a decode past it is: the CPU path would allocate it whole.
  absl::StatusOr<StagedGeometry> PlanGeometry(int height, int width, SampleRandom& random) const {
    StagedGeometry g;
    g.src_height = height;
    g.src_width = width;
    if (plan_.random_resized_crop) {
      const CropBox box =
          RandomResizedCropBox(height, width, plan_.random_resized_crop->options, random);
      g.crop_top = box.top;
      g.crop_left = box.left;
      g.crop_height = box.height;
      g.crop_width = box.width;
      g.resize_height = plan_.out_height;
      g.resize_width = plan_.out_width;
    } else {
      // An optional resize of the whole image, then the centre crop (zero padding where the
      // crop is larger, as torchvision's CenterCrop pads).
      g.crop_height = height;
      g.crop_width = width;
      g.resize_height = height;
      g.resize_width = width;
      if (plan_.resize) {
        ResizeShorterSide(height, width, plan_.resize->shorter_side, &g.resize_height,
                          &g.resize_width);
        const uint64_t pixels = static_cast<uint64_t>(g.resize_height) * g.resize_width;
        if (pixels > max_pixels_ || g.resize_height == std::numeric_limits<int>::max() ||
            g.resize_width == std::numeric_limits<int>::max()) {
          return MarkBadImage(
              absl::InvalidArgumentError(
                  absl::StrCat("image of ", width, "x", height, " resized to ", g.resize_width, "x",
                               g.resize_height, " exceeds the cap of ", max_pixels_, " pixels")),
              BadImage::kTooLarge);
        }
      }
      const CropBox box =
          CenterCropBox(g.resize_height, g.resize_width, plan_.out_height, plan_.out_width);
      g.window_top = box.top;
      g.window_left = box.left;
    }
    g.flip = plan_.flip_p > 0 && random.Uniform(0, 1) < plan_.flip_p;
    return g;
  }

  // The CPU path: geometry, then the output stage, into one finished image row (SIMD, in one
  // pass; bit-equal to ResizedCrop, the window, then WriteImage, and to the kernel's arithmetic).
  void Augment(const Image& image, const StagedGeometry& g, std::byte* out) const {
    metrics::StageTimer timer(*counters_, metrics::Stage::kAugment);
    FastAugment(image, g, plan_.out_height, plan_.out_width, plan_.output, out);
  }

  // A decoded image into the arena: the pixels the kernel reads (the crop box of a random
  // resized crop, else the whole image) as kRaw, or the finished row (kFinal) when the arena
  // or the device scratch has no room for them.
  void StageDecoded(const Image& image, StagedGeometry g, const StageTarget& target,
                    StagedRecord* record) const {
    std::byte* arena = target.slot + target.layout->arena_offset;
    const uint64_t bytes = static_cast<uint64_t>(g.crop_height) * g.crop_width * 3;
    StageArena::Claim claim;
    if (!target.arena->TryClaim(bytes, bytes, &claim)) {
      claim = target.arena->ClaimFinal();
      Augment(image, g, arena + claim.host_offset);
      record->kind = StagedKind::kFinal;
      record->geometry = g;
      record->host_offset = claim.host_offset;
      record->host_bytes = target.layout->final_row_bytes;
      return;
    }
    const size_t line = static_cast<size_t>(g.crop_width) * 3;
    for (int y = 0; y < g.crop_height; ++y) {
      std::memcpy(
          arena + claim.host_offset + y * line,
          image.rgb.data() + (static_cast<size_t>(g.crop_top + y) * image.width + g.crop_left) * 3,
          line);
    }
    g.src_height = g.crop_height;
    g.src_width = g.crop_width;
    g.crop_top = 0;
    g.crop_left = 0;
    record->kind = StagedKind::kRaw;
    record->geometry = g;
    record->host_offset = claim.host_offset;
    record->host_bytes = bytes;
    record->device_offset = claim.device_offset;
    record->device_bytes = bytes;
  }

  const std::unique_ptr<ImageSource> source_;
  const PipelinePlan plan_;
  const BadSamplePolicy policy_;
  const uint64_t max_pixels_;
  const uint64_t max_image_bytes_;
  const bool region_decode_;
  const std::shared_ptr<metrics::Counters> counters_;
  std::vector<SampleTensor> tensors_;
  mutable std::atomic<int64_t> bad_[std::size(kBadImageReasons)] = {};
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_set<uint64_t> logged_ ABSL_GUARDED_BY(mu_);
  mutable absl::once_flag digest_once_;
  mutable std::string digest_;  // written once, under digest_once_
};

}  // namespace

absl::StatusOr<std::unique_ptr<ImageDataset>> MakeImageDataset(std::unique_ptr<ImageSource> source,
                                                               const DatasetSpec& spec) {
  absl::StatusOr<PipelinePlan> plan = CompilePipeline(spec.pipeline);
  if (!plan.ok()) return plan.status();
  return std::make_unique<SourcedImageDataset>(std::move(source), std::move(*plan), spec);
}

}  // namespace gpufeed::server
