// The fast augment's tables (fast_augment.cc): per image, which crop columns and rows each
// output pixel's taps read and with what weights, built by target-independent code into
// per-thread storage that only grows. The weights are AugmentTaps's (augment_pixel.h): this
// code's arithmetic is the fast path's, compiled without fused multiply-adds as it is.
#pragma once

#include <cstdint>
#include <vector>

#include "server/augment/staged.h"

namespace gpufeed::server::fast_augment {

// The most vectors of a line one block's lookups pick from (a shrink by up to ~3.5x with
// 16 lanes, ~1.7x with 8); wider blocks are gathered.
constexpr int kMaxTables = 4;

// What the passes read, rebuilt per image into storage that only grows.
struct Plan {
  int lanes = 0;
  int line = 0;  // floats per channel in a horizontal line: max(out_width, lanes)
  // Columns, in blocks of `lanes` output columns starting at block_x[b]; when the width is no
  // multiple of the lanes the last block ends at the last column, overlapping the one before.
  // A block's taps read crop columns [block_base[b], block_base[b] + block_tables[b] * lanes):
  // that many vectors of a channel's line, from which a table lookup per tap picks each lane's
  // input (no gathers: they are slow, 3 values/ns on Zen 4); 0 tables: too wide, gathered.
  int col_taps = 0;
  int col_lo = 0, col_hi = 0;  // the crop columns any tap reads
  int plane_floats = 0;        // floats a channel's line must have for the lookups' loads
  std::vector<int32_t> block_x, block_base, block_tables;
  std::vector<int32_t> col_index;  // [block][tap][lane]: crop column - block_base
  std::vector<float> col_weight;   // [block][tap][lane]: 0 past a column's taps
  // Rows.
  int row_taps = 0;  // the most taps of any output row, at least 1
  int row_stride = 0;
  std::vector<int32_t> row_first;  // per output row: first crop row
  std::vector<int32_t> row_count;  // per output row: taps, 0 outside the resized image
  std::vector<float> row_weight;   // [row][row_stride]
  // Per output column while building.
  std::vector<int32_t> first, count;
  std::vector<float> weights;
};

// Per thread, grown to the largest image seen.
struct Scratch {
  Plan plan;
  std::vector<float> ring;          // row_taps lines x 3 channels x plan.line floats
  std::vector<int32_t> ring_row;    // the crop row each ring line holds, -1 for none
  std::vector<uint8_t> bytes;       // a crop row's channels, planar: 3 x plan.plane_floats
  std::vector<float> planes;        // the same as floats
  std::vector<const float*> lines;  // an output row's tap lines in the ring
};

// This thread's scratch.
Scratch& ThreadScratch();

// The tables of geometry `g` for an out_height x out_width output in vectors of `lanes` floats.
void BuildPlan(const StagedGeometry& g, int out_height, int out_width, int lanes, Plan* p);

}  // namespace gpufeed::server::fast_augment
