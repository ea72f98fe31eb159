// Document packing: documents (their token counts, in the order the sampler gives them) into
// rows of seq_len + 1 tokens, pure functions (docs/howto/blends-and-packing.md).
//
// A row is a list of pieces (document, offset, length): the tokens [offset, offset + length)
// of the document-th of the given documents, in the row's order, then padding up to
// seq_len + 1. A trainer takes tokens row[:-1] and labels row[1:], as GPTDataset does with
// add_extra_token_to_sequence.
//
// - concat: Megatron's concatenate-and-cut (GPTDataset's sample index, helpers.cpp
//   build_sample_idx with add_extra_token_to_sequence = 1 and drop_last_partial_sequence): the
//   documents laid end to end, row i is the tokens [i·seq_len, i·seq_len + seq_len + 1) of that
//   stream, so consecutive rows share one token (row i's last is row i+1's first: a label in
//   one, an input in the next); rows = (tokens - 1) / seq_len; the tokens after the last full
//   row are dropped. No padding; documents cut wherever the rows fall.
// - best_fit: best-fit-decreasing over a bounded lookahead (Ding et al. 2024, "Fewer
//   Truncations Improve Language Modeling"). The documents are taken in groups of `lookahead`
//   (the last group may be smaller); a group's rows depend on that group only. Within a group:
//   a document longer than seq_len + 1 is cut into chunks of seq_len + 1 tokens from its start
//   and a last chunk of the rest (a document of exactly seq_len + 1 tokens fits a row whole);
//   the pieces (whole documents and chunks) are placed longest first (ties: the earlier
//   document, then the earlier chunk), each into the open row with the least room that can hold
//   it (ties: the row opened first), else a new row; rows are emitted in the order they were
//   opened, padded to seq_len + 1. Every token is in exactly one row, none shared.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace gpufeed::server {

struct PackPiece {
  uint64_t document = 0;  // index into the given lengths
  uint64_t offset = 0;  // first token within the document
  uint64_t length = 0;  // tokens, >= 1
  bool operator==(const PackPiece&) const = default;
};

// Rows as pieces, compressed: row r is pieces[row_begin[r], row_begin[r + 1]).
struct Packing {
  uint64_t width = 0;  // seq_len + 1
  std::vector<PackPiece> pieces;
  std::vector<uint64_t> row_begin = {0};

  uint64_t rows() const { return row_begin.size() - 1; }
  std::span<const PackPiece> Row(uint64_t r) const {
    return std::span<const PackPiece>(pieces).subspan(row_begin[r], row_begin[r + 1] - row_begin[r]);
  }
};

enum class PackKind { kConcat, kBestFit };

// The default best_fit lookahead, in documents.
inline constexpr uint64_t kDefaultPackLookahead = 1024;

// INVALID_ARGUMENT naming the argument: seq_len < 1 (or seq_len + 1 past 2^31, the widest row
// position_ids can describe), lookahead < 1.
absl::StatusOr<Packing> PackConcat(std::span<const uint64_t> lengths, uint64_t seq_len);
absl::StatusOr<Packing> PackBestFit(std::span<const uint64_t> lengths, uint64_t seq_len,
                                    uint64_t lookahead = kDefaultPackLookahead);

// What a packing delivers of `lengths`. Fractions of rows() x width tokens (padding) and of the
// documents (truncation).
struct PackStats {
  uint64_t rows = 0;
  uint64_t row_tokens = 0;  // rows x width
  uint64_t document_tokens = 0;  // sum of the lengths
  uint64_t pad_tokens = 0;
  uint64_t dropped_tokens = 0;  // document tokens in no row (concat's tail)
  uint64_t documents = 0;  // of length >= 1
  // Documents not delivered whole in one piece: cut across rows (concat: also a document
  // whose last token is only the shared token) or dropped in part.
  uint64_t truncated_documents = 0;

  double padding_fraction() const;
  double truncation_fraction() const;
  double dropped_fraction() const;
};
PackStats MeasurePacking(const Packing& packing, std::span<const uint64_t> lengths);

// The position ids of the first out.size() tokens of a row (at most the width): 0, 1, ...
// restarting at each piece; the padding after the last piece counts as a sequence of its own.
void PositionIds(std::span<const PackPiece> row, std::span<int32_t> out);

// The row's sequence boundaries in FlashAttention's varlen form, over its first `tokens`
// tokens (width or seq_len): 0, then the end of each piece, clipped to `tokens`; the padding
// is a last sequence of its own, so the last entry is always `tokens` (and a batch's rows
// concatenate by adding r·tokens). Pieces wholly past `tokens` give no entry.
std::vector<int32_t> CuSeqlens(std::span<const PackPiece> row, uint64_t tokens);

// An upper bound on the pieces of any row, for a cu_seqlens narrower than the row (a row of
// 2,049 tokens holds a few documents, and a cu_seqlens of the row's width would be most of a
// packed feed's bytes). Fed the documents each source may put into one row (Add), Bound() is
// the most pieces any row can hold: best_fit places whole pieces, so a row holds at most the
// shortest pieces whose lengths sum to the width; concat cuts a window of the width from the
// documents end to end, so the documents inside it plus the two it cuts. A bound, not the
// most a given order gives: the shortest pieces may never meet in one row.
class RowPiecesBound {
 public:
  RowPiecesBound(PackKind kind, uint64_t width);
  // One source's document lengths (0: no piece), each document at most `copies` times in
  // one row (a source that wraps into its next epoch within a group or a window repeats some).
  void Add(std::span<const uint64_t> lengths, uint64_t copies);
  // At most the width (a piece holds a token at least).
  uint64_t Bound() const;

 private:
  void Count(uint64_t length, uint64_t n);

  PackKind kind_;
  uint64_t width_;
  // count_[n]: pieces of n tokens, n up to the histogram's cap; longer ones are counted in
  // longer_ as if cap + 1 tokens long (shorter than they are: the bound only grows). Counts
  // stop at width + 1, more than any row can hold.
  std::vector<uint64_t> count_;
  uint64_t longer_ = 0;
};

}  // namespace gpufeed::server
