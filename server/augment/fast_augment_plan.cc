#include "server/augment/fast_augment_plan.h"

#include <algorithm>

#include "server/augment/augment_pixel.h"

namespace gpufeed::server::fast_augment {
namespace {

// An upper bound of the taps of one output index resampling `in` to `out` (AugmentTaps's
// [lo, hi) spans at most 2 * support + 1 inputs).
int TapBound(int in, int out) {
  const double support = std::max(static_cast<double>(in) / out, 1.0);
  return static_cast<int>(2.0 * support) + 2;
}

// The taps of output index `i` (AugmentTaps: the weights of ComputeResampleWeights and the
// kernel) less the zero weights at either end, which add nothing to a sum of non-negative
// terms: writes the weights to `w` and returns their count; *first is the first input index
// (a valid one even without taps).
int Taps(int i, int in, int out, float* w, int32_t* first) {
  const AugmentTaps t(i, in, out);
  int lo = t.lo, n = 0;
  for (int j = t.lo; j < t.hi; ++j) {
    const float v = t.Weight(j);
    if (n == 0 && v == 0.0f) {
      ++lo;
    } else {
      w[n++] = v;
    }
  }
  while (n > 0 && w[n - 1] == 0.0f) --n;
  *first = std::min(lo, in - 1);
  return n;
}

}  // namespace

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

void BuildPlan(const StagedGeometry& g, int out_height, int out_width, int lanes, Plan* p) {
  p->lanes = lanes;
  p->line = std::max(out_width, lanes);
  const int cbound = TapBound(g.crop_width, g.resize_width);
  p->first.assign(static_cast<size_t>(out_width), 0);
  p->count.assign(static_cast<size_t>(out_width), 0);
  p->weights.resize(static_cast<size_t>(out_width) * cbound);
  int taps = 1;
  for (int x_out = 0; x_out < out_width; ++x_out) {
    const int x = g.flip ? out_width - 1 - x_out : x_out;
    const int rx = x + g.window_left;
    if (rx < 0 || rx >= g.resize_width) continue;
    const int n = Taps(rx, g.crop_width, g.resize_width,
                       &p->weights[static_cast<size_t>(x_out) * cbound], &p->first[x_out]);
    p->count[x_out] = n;
    taps = std::max(taps, n);
  }
  const int blocks = (out_width + lanes - 1) / lanes;
  p->col_taps = taps;
  p->block_x.resize(static_cast<size_t>(blocks));
  p->block_base.resize(static_cast<size_t>(blocks));
  p->block_tables.resize(static_cast<size_t>(blocks));
  p->col_index.resize(static_cast<size_t>(blocks) * taps * lanes);
  p->col_weight.resize(p->col_index.size());
  p->col_lo = g.crop_width;
  p->col_hi = 0;
  p->plane_floats = 0;
  for (int b = 0; b < blocks; ++b) {
    const int x0 = out_width >= lanes ? std::min(b * lanes, out_width - lanes) : 0;
    int base = g.crop_width, end = 0;  // the crop columns this block's taps read
    for (int x = x0; x < std::min(x0 + lanes, out_width); ++x) {
      if (p->count[x] == 0) continue;
      base = std::min(base, p->first[x]);
      end = std::max(end, p->first[x] + p->count[x]);
    }
    if (end == 0) base = end = 0;  // no taps: zeros, whatever the lookups read
    const int tables = (end - base + lanes - 1) / lanes;
    p->block_x[b] = x0;
    p->block_base[b] = base;
    p->block_tables[b] = tables <= kMaxTables ? std::max(tables, 1) : 0;
    if (end > 0) {
      p->col_lo = std::min(p->col_lo, base);
      p->col_hi = std::max(p->col_hi, end);
    }
    p->plane_floats = std::max(p->plane_floats, base + std::max(p->block_tables[b], 1) * lanes);
    for (int k = 0; k < taps; ++k) {
      for (int l = 0; l < lanes; ++l) {
        const int x = x0 + l;
        const size_t at = (static_cast<size_t>(b) * taps + k) * lanes + l;
        const bool has = x < out_width && p->count[x] > 0;
        const bool tap = has && k < p->count[x];
        p->col_weight[at] = tap ? p->weights[static_cast<size_t>(x) * cbound + k] : 0.0f;
        p->col_index[at] = has ? p->first[x] + (tap ? k : 0) - base : 0;
      }
    }
  }
  p->col_lo = std::min(p->col_lo, p->col_hi);
  // Room for the conversion's last vector and the byte planes' lane-wide loads.
  p->plane_floats = std::max(p->plane_floats, p->col_hi + 2 * lanes);
  p->row_stride = TapBound(g.crop_height, g.resize_height);
  p->row_first.assign(static_cast<size_t>(out_height), 0);
  p->row_count.assign(static_cast<size_t>(out_height), 0);
  p->row_weight.resize(static_cast<size_t>(out_height) * p->row_stride);
  p->row_taps = 1;
  for (int y = 0; y < out_height; ++y) {
    const int ry = y + g.window_top;
    if (ry < 0 || ry >= g.resize_height) continue;
    const int n = Taps(ry, g.crop_height, g.resize_height,
                       &p->row_weight[static_cast<size_t>(y) * p->row_stride], &p->row_first[y]);
    p->row_count[y] = n;
    p->row_taps = std::max(p->row_taps, n);
  }
}

}  // namespace gpufeed::server::fast_augment
