// Daemon-wide measurements the core records and the metrics endpoint exports
// (server/service/metrics.cc). Plain atomics: the core takes no dependency on Prometheus, and
// recording costs two clock reads and a few relaxed adds.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace gpufeed::metrics {

// Where time goes, per sample or per batch: a batch's whole fill, a file's read, an image's
// decode and augmentation on the CPU, and a batch's submission on a GPU's copy thread
// (copies, nvJPEG, kernel launch; the GPU runs them asynchronously).
enum class Stage { kFill, kRead, kDecode, kAugment, kDevice };
inline constexpr int kNumStages = 5;
inline constexpr const char* kStageNames[kNumStages] = {"fill", "read", "decode", "augment",
                                                        "device"};

// A histogram with fixed bucket bounds (seconds), from 10 µs to 3 s.
class StageHistogram {
 public:
  static constexpr std::array<double, 12> kBounds = {1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3,
                                                     1e-2, 3e-2, 0.1,  0.3,  1.0,  3.0};
  void Observe(double seconds) {
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    buckets_[i].fetch_add(1, std::memory_order_relaxed);  // non-cumulative; the last is +Inf
    sum_ns_.fetch_add(static_cast<uint64_t>(seconds * 1e9), std::memory_order_relaxed);
  }
  // Non-cumulative counts per bucket (kBounds.size() + 1, the last above every bound).
  std::array<uint64_t, kBounds.size() + 1> Counts() const {
    std::array<uint64_t, kBounds.size() + 1> out;
    for (size_t i = 0; i < out.size(); ++i) out[i] = buckets_[i].load(std::memory_order_relaxed);
    return out;
  }
  double sum_seconds() const { return static_cast<double>(sum_ns_.load(std::memory_order_relaxed)) / 1e9; }

 private:
  std::array<std::atomic<uint64_t>, kBounds.size() + 1> buckets_{};
  std::atomic<uint64_t> sum_ns_{0};
};

StageHistogram& Histogram(Stage stage);

// Records the time from construction to destruction under `stage`.
class StageTimer {
 public:
  explicit StageTimer(Stage stage) : stage_(stage), start_(std::chrono::steady_clock::now()) {}
  ~StageTimer() {
    Histogram(stage_).Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  const Stage stage_;
  const std::chrono::steady_clock::time_point start_;
};

// Bytes of batches handed to consumers, by delivery kind (0 host, 1 device), since start-up.
std::atomic<uint64_t>& DeliveredBytes(int device);

// Images decoded since start-up, by decoder: the CPU's whole-file decodes (every PNG, and
// every JPEG not cut to a box), its region decodes (only a random resized crop's box of a
// JPEG, --region_decode) and the rows staged for nvJPEG (less those the GPU refused, which
// the CPU redoes and counts: Session::RedoRows).
enum class Decoder { kCpu, kCpuRegion, kNvjpeg };
inline constexpr int kNumDecoders = 3;
inline constexpr const char* kDecoderNames[kNumDecoders] = {"cpu", "cpu_region", "nvjpeg"};
std::atomic<uint64_t>& Decodes(Decoder decoder);

}  // namespace gpufeed::metrics
