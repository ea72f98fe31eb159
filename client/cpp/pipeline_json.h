// Internal to the client: a pipeline's JSON text (gpufeedctl --pipeline FILE, the C API's
// "pipeline_json" option, Python's pipeline=) -> v1::Pipeline, validated before anything is
// sent.
//
// Two spellings are accepted, and may be mixed:
// - protobuf's JSON form of v1.Pipeline, as deploy/pipelines/*.json hold it:
//   {"cast": {"dtype": "DTYPE_FLOAT16"}}, {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}},
//   "scale_min"/"scale_max", lowerCamelCase names, enum numbers;
// - the short names README.md writes: "float16" (uint8, float16, bfloat16, float32), "nchw"
//   or "nhwc" (either case), "scale": [lo, hi], "ratio": [lo, hi], and an op of one field
//   given its value alone: {"resize": 256}, {"flip": 0.5}, {"cast": "float16"}.
//
// An unknown op or field is INVALID_ARGUMENT naming the op's index, the op and the field, and
// listing what is valid there: `pipeline.ops[0] resize: no field "size"; resize takes:
// shorter_side`. Values are checked by the daemon at Attach (ranges, the order of ops).
#pragma once

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gpufeed/v1/feed.pb.h"

namespace gpufeed::client::internal {

absl::StatusOr<v1::Pipeline> ParsePipelineJson(absl::string_view json);

}  // namespace gpufeed::client::internal
