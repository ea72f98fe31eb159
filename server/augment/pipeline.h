// An image pipeline as Attach gives it, validated once into a plan: the geometry (random
// resized crop, or resize then centre crop), the flip probability and the output stage.
// Errors are INVALID_ARGUMENT naming the op's index, its name and the field.
#pragma once

#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "server/augment/crop.h"
#include "server/augment/output.h"

namespace gpufeed::server {

struct DecodeStep {
  bool dct_scaling = false;
};
struct RandomResizedCropStep {
  int size = 0;
  RandomResizedCropOptions options;
};
struct ResizeStep {
  int shorter_side = 0;
};
struct CenterCropStep {
  int size = 0;
};
struct FlipStep {
  double p = 0.5;
};
struct NormalizeStep {
  std::vector<float> mean, std;
};
struct CastStep {
  DType dtype = DType::kUnspecified;
};
struct LayoutStep {
  Layout layout = Layout::kNCHW;
};
using PipelineStep = std::variant<RandomResizedCropStep, ResizeStep, CenterCropStep, FlipStep,
                                  NormalizeStep, CastStep, LayoutStep, DecodeStep>;

struct PipelinePlan {
  // Geometry: a random resized crop, or an optional resize then a centre crop.
  std::optional<RandomResizedCropStep> random_resized_crop;
  std::optional<ResizeStep> resize;
  std::optional<CenterCropStep> center_crop;
  double flip_p = 0;
  // CPU JPEG decode at the smallest DCT scale that keeps the resolution the geometry needs.
  bool dct_scaling = false;
  OutputSpec output;
  int out_height = 0;
  int out_width = 0;
};

// The largest size a geometry op may ask for (random_resized_crop and center_crop size,
// resize shorter_side). The Python client checks the same bound before a request is sent
// (tests/structure/mirrors_test.py keeps the two equal).
inline constexpr int kMaxPipelineSide = 8192;

absl::StatusOr<PipelinePlan> CompilePipeline(const std::vector<PipelineStep>& steps);

// A canonical text of the steps: equal pipelines give equal text (part of a feed's key).
std::string PipelineCanonical(const std::vector<PipelineStep>& steps);

}  // namespace gpufeed::server
