#include "tests/fuzz/attach_checks.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gpufeed/v1/feed.pb.h"
#include "server/augment/crop.h"
#include "server/augment/pipeline.h"
#include "server/service/convert.h"
#include "server/session/session_manager.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {
namespace {

using server::CompilePipeline;
using server::CropBox;
using server::PipelinePlan;

// Image sizes the decoder can hand the geometry (at most DecodeOptions' default 64M pixels):
// square, wide and tall extremes.
constexpr int kSizes[][2] = {{1, 1},       {1, 7},       {7, 1},     {2, 3},       {480, 640},
                             {8000, 8000}, {1, 65536},   {65536, 1}, {1, 64000000}, {64000000, 1}};

// The geometry a compiled plan drives for every image: a random resized crop stays inside
// the image and is never empty; a resize keeps the shorter side exact and never wraps.
void CheckGeometry(const PipelinePlan& plan) {
  for (const auto& [height, width] : kSizes) {
    if (plan.random_resized_crop) {
      for (uint64_t id = 0; id < 4; ++id) {
        server::SampleRandom random(/*seed=*/id * 7919, /*epoch=*/0, id);
        const CropBox box = server::RandomResizedCropBox(height, width,
                                                         plan.random_resized_crop->options, random);
        FUZZ_CHECK(box.height >= 1 && box.width >= 1);
        FUZZ_CHECK(box.top >= 0 && box.left >= 0);
        FUZZ_CHECK(int64_t{box.top} + box.height <= height);
        FUZZ_CHECK(int64_t{box.left} + box.width <= width);
      }
    }
    if (plan.resize) {
      int out_height = 0, out_width = 0;
      server::ResizeShorterSide(height, width, plan.resize->shorter_side, &out_height, &out_width);
      const int64_t shorter = plan.resize->shorter_side;
      const int64_t longer = height <= width ? shorter * width / height : shorter * height / width;
      FUZZ_CHECK((height <= width ? out_height : out_width) == shorter);
      FUZZ_CHECK((height <= width ? out_width : out_height) ==
                 std::min<int64_t>(longer, std::numeric_limits<int>::max()));
    }
  }
}

}  // namespace

void CheckAttachRequest(const v1::AttachRequest& request) {
  absl::StatusOr<server::AttachSpec> spec = server::AttachSpecFromProto(request);
  if (!spec.ok()) {
    FUZZ_CHECK(spec.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  const absl::Status valid = server::ValidateAttachSpec(*spec, /*max_ring_slots=*/64);
  FUZZ_CHECK(valid.ok() || valid.code() == absl::StatusCode::kInvalidArgument);
  // Feed keys and the job check are built from these texts.
  (void)spec->feed.Canonical();
  (void)server::PipelineCanonical(spec->feed.dataset.pipeline);
  // Compiled whatever the dataset kind (ValidateAttachSpec compiles only image folders').
  absl::StatusOr<PipelinePlan> plan = CompilePipeline(spec->feed.dataset.pipeline);
  if (!plan.ok()) {
    FUZZ_CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(plan->out_height >= 1 && plan->out_height <= 8192);
  FUZZ_CHECK(plan->out_width >= 1 && plan->out_width <= 8192);
  CheckGeometry(*plan);
}

}  // namespace gpufeed::fuzz
