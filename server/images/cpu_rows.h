// decode auto with --adaptive_decode: which rows of a staged batch the CPU pool decodes.
// The share (session/decode_share.h) says how many; this says which. A region decode
// (--region_decode) costs the CPU what its box costs: the entropy decode of every row down to
// the box's bottom, and the rest of the work for the box alone; nvJPEG decodes every file
// whole, whatever the box, and each image it decodes costs a training process on the same GPU
// the same (without MPS). So the CPU takes the rows that are cheapest for it, and the same
// pool time decodes more rows on the CPU.
//
// A region decode's time over a whole decode's is estimated linearly from the box's bottom
// and area (RegionDecodeCost), a fit to measured decodes; the cheapest 40 % of the rows by
// that estimate cost the CPU clearly less than 40 % taken evenly, as little as the truly
// cheapest 40 % would
// (measured: docs/benchmarks.md, section Adaptive decode, Which rows the CPU takes).
//
// Which rows are "cheapest 40 %" needs the distribution of the estimates; a session keeps a
// histogram of its rows' estimates (RowCosts) and at each fill's start turns the share into
// a bound (a bin, and the part of that bin's rows the CPU takes). Rows without an estimate
// (no random resized crop, --noregion_decode) and sessions whose histogram holds too few rows
// (rows are recorded only while the share is above 0, and only those nvJPEG could take) are
// spread evenly by index (CpuDecodesRow), as before.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>

namespace gpufeed::server {

// Whether row `row` of a batch goes to the CPU decoder at `share`: floor((row + 1) * share) >
// floor(row * share), which spreads about batch * share CPU rows evenly over the batch (and
// over the pool's threads, which take rows in order).
inline bool CpuDecodesRow(int64_t row, double share) {
  if (share <= 0) return false;
  if (share >= 1) return true;
  return std::floor(static_cast<double>(row + 1) * share) >
         std::floor(static_cast<double>(row) * share);
}

// A region decode's estimated time over a whole decode's (above), for a box of box_height x
// box_width at box_top in a height x width image.
inline double RegionDecodeCost(int height, int width, int box_top, int box_height, int box_width) {
  if (height <= 0 || width <= 0) return 1;
  const double bottom = std::clamp(static_cast<double>(box_top + box_height) / height, 0.0, 1.0);
  const double area = std::clamp(
      static_cast<double>(box_height) * box_width / (static_cast<double>(height) * width), 0.0,
      1.0);
  return 0.03 + 0.73 * bottom + 0.26 * area;
}

// A session's histogram of its rows' estimated costs. Recorded by the pool's threads, read
// at a fill's start: relaxed atomics, and a bound from a slightly stale histogram is as good.
class RowCosts {
 public:
  static constexpr int kBins = 64;
  // Rows recorded before the histogram is trusted.
  static constexpr uint64_t kMinRows = 64;

  // The CPU takes the rows of bins below `bin`, and of `bin` the part `part` (by index).
  struct Bound {
    bool known = false;
    int bin = 0;
    double part = 0;
  };

  static int BinOf(double cost) { return std::clamp(static_cast<int>(cost * kBins), 0, kBins - 1); }

  void Record(int bin) {
    counts_[static_cast<size_t>(bin)].fetch_add(1, std::memory_order_relaxed);
  }

  // The bound under which `share` of the recorded rows lie; not known for a share of 0 or 1
  // (CpuDecodesRow is exact there) or before kMinRows rows.
  Bound BoundFor(double share) const {
    if (share <= 0 || share >= 1) return {};
    std::array<uint64_t, kBins> c;
    uint64_t total = 0;
    for (int i = 0; i < kBins; ++i) {
      c[static_cast<size_t>(i)] = counts_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
      total += c[static_cast<size_t>(i)];
    }
    if (total < kMinRows) return {};
    const double target = share * static_cast<double>(total);
    double below = 0;
    for (int i = 0; i < kBins; ++i) {
      const double n = static_cast<double>(c[static_cast<size_t>(i)]);
      if (n > 0 && below + n >= target) return {true, i, (target - below) / n};
      below += n;
    }
    return {true, kBins - 1, 1.0};
  }

 private:
  std::array<std::atomic<uint64_t>, kBins> counts_{};
};

// A fill's rule for its rows: `share` of them on the CPU, the cheapest where `costs` knows
// enough (bound: costs->BoundFor(share) at the fill's start).
struct CpuRows {
  double share = 0;
  RowCosts* costs = nullptr;  // the session's; nullptr: by index
  RowCosts::Bound bound;

  // Row `row`, whose estimated cost falls in `bin` (none: no estimate), goes to the CPU.
  bool Takes(int64_t row, std::optional<int> bin) const {
    if (!bin.has_value() || !bound.known) return CpuDecodesRow(row, share);
    return *bin < bound.bin || (*bin == bound.bin && CpuDecodesRow(row, bound.part));
  }
};

}  // namespace gpufeed::server
