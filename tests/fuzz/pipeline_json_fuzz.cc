// Pipeline JSON: the client library's parse of AttachOptions::pipeline_json (gpufeedctl
// consume --pipeline FILE, the C API's "pipeline_json" option, Python's pipeline=), then the
// server's checks of the request the client would send.
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/options.h"
#include "gpufeed/client.h"
#include "tests/fuzz/attach_checks.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {

int FuzzPipelineJson(const uint8_t* data, size_t size) {
  client::AttachOptions options;
  options.kind = "image_folder";
  options.dataset = "/data/images";
  options.batch_size = 8;
  options.pipeline_json.assign(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<client::internal::AttachPlan> plan =
      client::internal::AttachPlanFromOptions(options);
  if (!plan.ok()) {
    FUZZ_CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
    // Every refusal names the field: "pipeline: ..." for the whole, "pipeline.ops[i] op: ..."
    // for one op (client/cpp/pipeline_json.cc).
    const absl::string_view m = plan.status().message();
    FUZZ_CHECK(m.rfind("pipeline: ", 0) == 0 || m.rfind("pipeline.ops[", 0) == 0);
    return 0;
  }
  FUZZ_CHECK(!plan->device);
  CheckAttachRequest(plan->request);
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzPipelineJson)
