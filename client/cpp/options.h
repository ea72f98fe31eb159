// Internal to the client: AttachOptions -> the Attach request, validated before anything is
// sent. A bad option is INVALID_ARGUMENT with a message that starts with the field's name.
#pragma once

#include "absl/status/statusor.h"
#include "client/cpp/device_ring.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.pb.h"

namespace gpufeed::client::internal {

struct AttachPlan {
  v1::AttachRequest request;
  bool device = false;  // device delivery
  GpuTarget gpu;        // device delivery: the CUDA device in this process
};

// Device delivery also resolves `options.gpu` to a device of this process (its UUID goes in
// the request), so it fails where this process sees no such device or has no CUDA support.
absl::StatusOr<AttachPlan> AttachPlanFromOptions(const AttachOptions& options);

}  // namespace gpufeed::client::internal
