// What every Attach request must satisfy on the server side, whatever its fields: the
// conversion and validation refuse with INVALID_ARGUMENT (never crash), and a pipeline that
// compiles drives a geometry that stays inside every image the decoder can produce.
// Shared by the attach_request and pipeline_json targets.
#pragma once

#include "gpufeed/v1/feed.pb.h"

namespace gpufeed::fuzz {

// AttachSpecFromProto -> ValidateAttachSpec, the feed's canonical text, CompilePipeline
// and the crop geometry; aborts (FUZZ_CHECK) on a broken invariant.
void CheckAttachRequest(const v1::AttachRequest& request);

}  // namespace gpufeed::fuzz
