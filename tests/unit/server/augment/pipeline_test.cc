#include "server/augment/pipeline.h"

#include <cmath>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

TEST(PipelineTest, TrainAndEvalPipelinesCompile) {
  absl::StatusOr<PipelinePlan> train = CompilePipeline(
      {RandomResizedCropStep{224, {}}, FlipStep{0.5},
       NormalizeStep{{0.485f, 0.456f, 0.406f}, {0.229f, 0.224f, 0.225f}}, CastStep{DType::kFloat16}});
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ(train->out_height, 224);
  EXPECT_EQ(train->flip_p, 0.5);
  EXPECT_EQ(train->output.dtype, DType::kFloat16);
  EXPECT_TRUE(train->output.normalize);
  EXPECT_EQ(train->output.layout, Layout::kNCHW);
  absl::StatusOr<PipelinePlan> eval =
      CompilePipeline({ResizeStep{256}, CenterCropStep{224}, LayoutStep{Layout::kNHWC}});
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ(eval->out_width, 224);
  EXPECT_EQ(eval->output.dtype, DType::kUInt8);  // no normalize, no cast: as decoded
  EXPECT_EQ(eval->output.layout, Layout::kNHWC);
  // Normalised without a cast: float32.
  EXPECT_EQ(CompilePipeline({CenterCropStep{8}, NormalizeStep{{0, 0, 0}, {1, 1, 1}}})->output.dtype,
            DType::kFloat32);
}

TEST(PipelineTest, ErrorsNameTheOpAndTheField) {
  struct Case {
    std::vector<PipelineStep> steps;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{}, "output size must be fixed"},
      {{ResizeStep{256}}, "output size must be fixed"},
      {{RandomResizedCropStep{0, {}}}, "pipeline[0] random_resized_crop: size"},
      {{RandomResizedCropStep{224, {0.5, 0.2, 0.75, 1.33}}}, "pipeline[0] random_resized_crop: scale"},
      {{RandomResizedCropStep{224, {0.08, 1, 2, 1}}}, "pipeline[0] random_resized_crop: ratio"},
      // Found by fuzzing (tests/fuzz): an infinite ratio drew NaN aspects.
      {{RandomResizedCropStep{224, {0.08, 1, 0.75, INFINITY}}},
       "pipeline[0] random_resized_crop: ratio: want 0 < ratio_min <= ratio_max, finite"},
      {{RandomResizedCropStep{224, {}}, CenterCropStep{224}}, "pipeline[1] center_crop: only one geometry"},
      {{ResizeStep{200}, CenterCropStep{224}}, "pipeline[1] center_crop: size: 224 is larger"},
      {{CenterCropStep{224}, FlipStep{1.5}}, "pipeline[1] flip: p"},
      {{CenterCropStep{8}, NormalizeStep{{0, 0}, {1, 1}}}, "pipeline[1] normalize: mean, std"},
      {{CenterCropStep{8}, NormalizeStep{{0, 0, 0}, {1, 0, 1}}}, "pipeline[1] normalize: std"},
      {{CenterCropStep{8}, CastStep{DType::kInt32}}, "pipeline[1] cast: dtype"},
      {{CenterCropStep{8}, NormalizeStep{{0, 0, 0}, {1, 1, 1}}, CastStep{DType::kUInt8}},
       "pipeline[2] cast: dtype: a normalised image cannot be uint8"},
      {{CenterCropStep{8}, CastStep{DType::kFloat32}, NormalizeStep{{0, 0, 0}, {1, 1, 1}}},
       "pipeline[2] normalize: comes before cast"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<PipelinePlan> plan = CompilePipeline(c.steps);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(plan.status().message(), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace gpufeed::server
