// Attach request validation: what a client's Attach carries, as the service sees it. The
// bytes are a serialized v1::AttachRequest (the seeds are; the mutations need not be).
#include <cstdint>

#include "gpufeed/v1/feed.pb.h"
#include "tests/fuzz/attach_checks.h"
#include "tests/fuzz/fuzz_targets.h"

namespace gpufeed::fuzz {

int FuzzAttachRequest(const uint8_t* data, size_t size) {
  v1::AttachRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  CheckAttachRequest(request);
  return 0;
}

}  // namespace gpufeed::fuzz

GPUFEED_FUZZ_TARGET(FuzzAttachRequest)
