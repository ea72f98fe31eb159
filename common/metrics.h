// A daemon's measurements, which the core records and the metrics endpoint exports
// (server/service/metrics.cc). Plain atomics: the core takes no dependency on Prometheus, and
// recording costs two clock reads and a few relaxed adds. Each daemon owns its Counters (two
// daemons in one process, as tests start them, count apart); the feed hands them to its
// dataset and sessions.
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

// Images decoded, by decoder: the CPU's whole-file decodes (every PNG, and every JPEG not cut
// to a box), its region decodes (only a random resized crop's box of a JPEG, --region_decode)
// and the rows staged for nvJPEG (less those the GPU refused, which the CPU redoes and counts:
// Session::RedoRows).
enum class Decoder { kCpu, kCpuRegion, kNvjpeg };
inline constexpr int kNumDecoders = 3;
inline constexpr const char* kDecoderNames[kNumDecoders] = {"cpu", "cpu_region", "nvjpeg"};

// One daemon's counters and stage histograms, since its start.
class Counters {
 public:
  StageHistogram& histogram(Stage stage) { return histograms_[static_cast<int>(stage)]; }
  const StageHistogram& histogram(Stage stage) const {
    return histograms_[static_cast<int>(stage)];
  }
  // Bytes of batches handed to consumers, by delivery kind (0 host, else device).
  std::atomic<uint64_t>& delivered_bytes(int device) { return delivered_[device != 0 ? 1 : 0]; }
  uint64_t delivered_bytes(int device) const {
    return delivered_[device != 0 ? 1 : 0].load(std::memory_order_relaxed);
  }
  std::atomic<uint64_t>& decodes(Decoder decoder) { return decodes_[static_cast<int>(decoder)]; }
  uint64_t decodes(Decoder decoder) const {
    return decodes_[static_cast<int>(decoder)].load(std::memory_order_relaxed);
  }

 private:
  StageHistogram histograms_[kNumStages];
  std::atomic<uint64_t> delivered_[2]{};
  std::atomic<uint64_t> decodes_[kNumDecoders]{};
};

// Records the time from construction to destruction under `stage` of `counters`.
class StageTimer {
 public:
  StageTimer(Counters& counters, Stage stage)
      : histogram_(counters.histogram(stage)), start_(std::chrono::steady_clock::now()) {}
  ~StageTimer() {
    histogram_.Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  StageHistogram& histogram_;
  const std::chrono::steady_clock::time_point start_;
};

}  // namespace gpufeed::metrics
