#include "server/augment/pipeline.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gpufeed::server {
namespace {

absl::Status Invalid(size_t index, const char* op, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("pipeline[", index, "] ", op, ": ", why));
}

}  // namespace

absl::StatusOr<PipelinePlan> CompilePipeline(const std::vector<PipelineStep>& steps) {
  PipelinePlan plan;
  bool have_cast = false, have_layout = false, have_flip = false;
  for (size_t i = 0; i < steps.size(); ++i) {
    const PipelineStep& step = steps[i];
    if (const auto* s = std::get_if<RandomResizedCropStep>(&step)) {
      if (plan.random_resized_crop || plan.resize || plan.center_crop) {
        return Invalid(i, "random_resized_crop", "only one geometry: a random_resized_crop, or a resize and a center_crop");
      }
      const RandomResizedCropOptions& o = s->options;
      if (s->size < 1 || s->size > kMaxPipelineSide) return Invalid(i, "random_resized_crop", absl::StrCat("size: 1 to ", kMaxPipelineSide, ", got ", s->size));
      if (!(o.scale_min > 0 && o.scale_min <= o.scale_max && o.scale_max <= 1)) {
        return Invalid(i, "random_resized_crop", "scale: want 0 < scale_min <= scale_max <= 1");
      }
      if (!(o.ratio_min > 0 && o.ratio_min <= o.ratio_max && std::isfinite(o.ratio_max))) {
        return Invalid(i, "random_resized_crop", "ratio: want 0 < ratio_min <= ratio_max, finite");
      }
      plan.random_resized_crop = *s;
    } else if (const auto* s = std::get_if<ResizeStep>(&step)) {
      if (plan.random_resized_crop || plan.resize || plan.center_crop) {
        return Invalid(i, "resize", "a resize comes once, before the center_crop, without random_resized_crop");
      }
      if (s->shorter_side < 1 || s->shorter_side > kMaxPipelineSide) return Invalid(i, "resize", absl::StrCat("shorter_side: 1 to ", kMaxPipelineSide, ", got ", s->shorter_side));
      plan.resize = *s;
    } else if (const auto* s = std::get_if<CenterCropStep>(&step)) {
      if (plan.random_resized_crop || plan.center_crop) {
        return Invalid(i, "center_crop", "only one geometry: a random_resized_crop, or a resize and a center_crop");
      }
      if (s->size < 1 || s->size > kMaxPipelineSide) return Invalid(i, "center_crop", absl::StrCat("size: 1 to ", kMaxPipelineSide, ", got ", s->size));
      if (plan.resize && s->size > plan.resize->shorter_side) {
        return Invalid(i, "center_crop", absl::StrCat("size: ", s->size, " is larger than the resized shorter side ", plan.resize->shorter_side));
      }
      plan.center_crop = *s;
    } else if (const auto* s = std::get_if<FlipStep>(&step)) {
      if (have_flip) return Invalid(i, "flip", "only one flip");
      if (!(s->p >= 0 && s->p <= 1)) return Invalid(i, "flip", "p: want 0 <= p <= 1");
      plan.flip_p = s->p;
      have_flip = true;
    } else if (const auto* s = std::get_if<NormalizeStep>(&step)) {
      if (plan.output.normalize) return Invalid(i, "normalize", "only one normalize");
      if (have_cast) return Invalid(i, "normalize", "comes before cast");
      if (s->mean.size() != 3 || s->std.size() != 3) return Invalid(i, "normalize", "mean, std: want 3 values each (RGB)");
      for (int c = 0; c < 3; ++c) {
        if (!(s->std[c] > 0)) return Invalid(i, "normalize", "std: values must be > 0");
        plan.output.mean[c] = s->mean[c];
        plan.output.std[c] = s->std[c];
      }
      plan.output.normalize = true;
    } else if (const auto* s = std::get_if<CastStep>(&step)) {
      if (have_cast) return Invalid(i, "cast", "only one cast");
      if (s->dtype != DType::kUInt8 && s->dtype != DType::kFloat16 && s->dtype != DType::kBFloat16 &&
          s->dtype != DType::kFloat32) {
        return Invalid(i, "cast", absl::StrCat("dtype: want uint8, float16, bfloat16 or float32, got ", DTypeName(s->dtype)));
      }
      if (s->dtype == DType::kUInt8 && plan.output.normalize) {
        return Invalid(i, "cast", "dtype: a normalised image cannot be uint8");
      }
      plan.output.dtype = s->dtype;
      have_cast = true;
    } else if (const auto* s = std::get_if<LayoutStep>(&step)) {
      if (have_layout) return Invalid(i, "layout", "only one layout");
      plan.output.layout = s->layout;
      have_layout = true;
    } else if (const auto* s = std::get_if<DecodeStep>(&step)) {
      if (i != 0) return Invalid(i, "decode", "comes first, once");
      plan.dct_scaling = s->dct_scaling;
    }
  }
  if (plan.random_resized_crop) {
    plan.out_height = plan.out_width = plan.random_resized_crop->size;
  } else if (plan.center_crop) {
    plan.out_height = plan.out_width = plan.center_crop->size;
  } else {
    return absl::InvalidArgumentError(
        "pipeline: the output size must be fixed: include a random_resized_crop or a center_crop");
  }
  // Without a cast: uint8 as decoded, or float32 once normalised.
  if (!have_cast) plan.output.dtype = plan.output.normalize ? DType::kFloat32 : DType::kUInt8;
  return plan;
}

}  // namespace gpufeed::server

namespace gpufeed::server {

std::string PipelineCanonical(const std::vector<PipelineStep>& steps) {
  std::string out;
  for (const PipelineStep& step : steps) {
    if (const auto* s = std::get_if<RandomResizedCropStep>(&step)) {
      absl::StrAppend(&out, "rrc(", s->size, ",", s->options.scale_min, ",", s->options.scale_max,
                      ",", s->options.ratio_min, ",", s->options.ratio_max, ")");
    } else if (const auto* s = std::get_if<ResizeStep>(&step)) {
      absl::StrAppend(&out, "resize(", s->shorter_side, ")");
    } else if (const auto* s = std::get_if<CenterCropStep>(&step)) {
      absl::StrAppend(&out, "center_crop(", s->size, ")");
    } else if (const auto* s = std::get_if<FlipStep>(&step)) {
      absl::StrAppend(&out, "flip(", s->p, ")");
    } else if (const auto* s = std::get_if<NormalizeStep>(&step)) {
      absl::StrAppend(&out, "normalize(", absl::StrJoin(s->mean, ","), ";", absl::StrJoin(s->std, ","), ")");
    } else if (const auto* s = std::get_if<CastStep>(&step)) {
      absl::StrAppend(&out, "cast(", DTypeName(s->dtype), ")");
    } else if (const auto* s = std::get_if<LayoutStep>(&step)) {
      absl::StrAppend(&out, "layout(", s->layout == Layout::kNCHW ? "nchw" : "nhwc", ")");
    } else if (const auto* s = std::get_if<DecodeStep>(&step)) {
      absl::StrAppend(&out, "decode(", s->dct_scaling ? "dct" : "full", ")");
    }
  }
  return out;
}

}  // namespace gpufeed::server
