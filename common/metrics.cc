#include "common/metrics.h"

namespace gpufeed::metrics {

StageHistogram& Histogram(Stage stage) {
  static StageHistogram histograms[kNumStages];
  return histograms[static_cast<int>(stage)];
}

std::atomic<uint64_t>& DeliveredBytes(int device) {
  static std::atomic<uint64_t> bytes[2];
  return bytes[device != 0 ? 1 : 0];
}

std::atomic<uint64_t>& Decodes(Decoder decoder) {
  static std::atomic<uint64_t> decodes[kNumDecoders];
  return decodes[static_cast<int>(decoder)];
}

}  // namespace gpufeed::metrics
