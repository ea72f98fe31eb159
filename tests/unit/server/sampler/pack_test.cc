#include "server/sampler/pack.h"

#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using ::testing::ElementsAre;

std::vector<uint64_t> LogNormalLengths(size_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::lognormal_distribution<double> length(std::log(300.0), 1.1);
  std::vector<uint64_t> lengths;
  for (size_t i = 0; i < count; ++i) {
    lengths.push_back(static_cast<uint64_t>(std::ceil(length(random))));
  }
  lengths[count / 2] = 0;  // an empty document is delivered as nothing
  return lengths;
}

// How many times each token of each document is in a row; "owned" counts only the first
// `owned` tokens of every row but the last (concat shares a row's last token with the next).
std::vector<std::vector<int>> Deliveries(const Packing& packing,
                                         const std::vector<uint64_t>& lengths, uint64_t owned) {
  std::vector<std::vector<int>> seen;
  for (uint64_t length : lengths) seen.emplace_back(length, 0);
  for (uint64_t r = 0; r < packing.rows(); ++r) {
    uint64_t at = 0;
    const uint64_t limit = r + 1 == packing.rows() ? packing.width : owned;
    for (const PackPiece& piece : packing.Row(r)) {
      for (uint64_t i = 0; i < piece.length && at < limit; ++i, ++at) {
        ++seen[piece.document][piece.offset + i];
      }
    }
  }
  return seen;
}

TEST(PackTest, ConcatIsMegatronsWindowsOfTheConcatenatedStream) {
  const std::vector<uint64_t> lengths = LogNormalLengths(500, 1);
  const uint64_t seq_len = 1024;
  absl::StatusOr<Packing> packing = PackConcat(lengths, seq_len);
  ASSERT_TRUE(packing.ok()) << packing.status();
  std::vector<std::pair<uint64_t, uint64_t>> stream;  // (document, offset) of every token
  for (uint64_t d = 0; d < lengths.size(); ++d) {
    for (uint64_t o = 0; o < lengths[d]; ++o) stream.emplace_back(d, o);
  }
  ASSERT_EQ(packing->rows(), (stream.size() - 1) / seq_len);
  for (uint64_t r = 0; r < packing->rows(); ++r) {
    uint64_t at = r * seq_len;  // row r is stream[r·seq_len, r·seq_len + seq_len + 1)
    uint64_t used = 0;
    for (const PackPiece& piece : packing->Row(r)) {
      ASSERT_GE(piece.length, 1u);
      for (uint64_t i = 0; i < piece.length; ++i, ++at) {
        ASSERT_EQ(stream[at], std::make_pair(piece.document, piece.offset + i)) << "row " << r;
      }
      used += piece.length;
    }
    ASSERT_EQ(used, seq_len + 1) << "row " << r;
  }
  // Every token once (counting each row's first seq_len, the last row whole), the tail dropped.
  const std::vector<std::vector<int>> seen = Deliveries(*packing, lengths, seq_len);
  const uint64_t delivered = packing->rows() * seq_len + 1;
  uint64_t at = 0;
  for (const std::vector<int>& document : seen) {
    for (int count : document) ASSERT_EQ(count, at++ < delivered ? 1 : 0) << at - 1;
  }
  const PackStats stats = MeasurePacking(*packing, lengths);
  EXPECT_EQ(stats.pad_tokens, 0u);
  EXPECT_EQ(stats.dropped_tokens, stream.size() - delivered);
  EXPECT_EQ(stats.document_tokens, stream.size());
  EXPECT_EQ(stats.documents, 499u);
}

TEST(PackTest, ConcatOfAWorkedExample) {
  // Stream: d0 = 3 tokens, d1 = 0, d2 = 7: ten tokens, seq_len 4: (10 - 1) / 4 = 2 rows of 5.
  const std::vector<uint64_t> lengths = {3, 0, 7};
  absl::StatusOr<Packing> packing = PackConcat(lengths, 4);
  ASSERT_TRUE(packing.ok());
  ASSERT_EQ(packing->rows(), 2u);
  EXPECT_THAT(packing->Row(0), ElementsAre(PackPiece{0, 0, 3}, PackPiece{2, 0, 2}));
  EXPECT_THAT(packing->Row(1), ElementsAre(PackPiece{2, 1, 5}));
  const PackStats stats = MeasurePacking(*packing, lengths);
  EXPECT_EQ(stats.dropped_tokens, 1u);  // d2's last token
  EXPECT_EQ(stats.truncated_documents, 1u);  // d2, across the rows; d0 whole in row 0
  EXPECT_EQ(PackConcat(std::vector<uint64_t>{1, 0}, 4)->rows(), 0u);
}

TEST(PackTest, BestFitOfAWorkedExample) {
  // seq_len 9: rows of 10. d2 (12) is cut into 10 + 2; pieces longest first: 10, 7, 5, 5, 3, 2,
  // 1; best fit: [10] [7 3] [5 5] [2 1].
  const std::vector<uint64_t> lengths = {3, 7, 12, 5, 5, 1};
  absl::StatusOr<Packing> packing = PackBestFit(lengths, 9, 6);
  ASSERT_TRUE(packing.ok());
  ASSERT_EQ(packing->rows(), 4u);
  EXPECT_THAT(packing->Row(0), ElementsAre(PackPiece{2, 0, 10}));
  EXPECT_THAT(packing->Row(1), ElementsAre(PackPiece{1, 0, 7}, PackPiece{0, 0, 3}));
  EXPECT_THAT(packing->Row(2), ElementsAre(PackPiece{3, 0, 5}, PackPiece{4, 0, 5}));
  EXPECT_THAT(packing->Row(3), ElementsAre(PackPiece{2, 10, 2}, PackPiece{5, 0, 1}));
  const PackStats stats = MeasurePacking(*packing, lengths);
  EXPECT_EQ(stats.pad_tokens, 7u);
  EXPECT_EQ(stats.truncated_documents, 1u);
  EXPECT_DOUBLE_EQ(stats.padding_fraction(), 7.0 / 40.0);
  EXPECT_DOUBLE_EQ(stats.truncation_fraction(), 1.0 / 6.0);

  // A lookahead of 2: groups {3, 7} {12, 5} {5, 1} packed apart.
  absl::StatusOr<Packing> grouped = PackBestFit(lengths, 9, 2);
  ASSERT_TRUE(grouped.ok());
  ASSERT_EQ(grouped->rows(), 4u);
  EXPECT_THAT(grouped->Row(0), ElementsAre(PackPiece{1, 0, 7}, PackPiece{0, 0, 3}));
  EXPECT_THAT(grouped->Row(1), ElementsAre(PackPiece{2, 0, 10}));
  EXPECT_THAT(grouped->Row(2), ElementsAre(PackPiece{3, 0, 5}, PackPiece{2, 10, 2}));
  EXPECT_THAT(grouped->Row(3), ElementsAre(PackPiece{4, 0, 5}, PackPiece{5, 0, 1}));
}

TEST(PackTest, BestFitDeliversEveryTokenOnceAndSplitsOnlyLongDocuments) {
  const std::vector<uint64_t> lengths = LogNormalLengths(5000, 2);
  for (uint64_t lookahead : {1u, 7u, 1024u, 100000u}) {
    const uint64_t seq_len = 2047;
    absl::StatusOr<Packing> packing = PackBestFit(lengths, seq_len, lookahead);
    ASSERT_TRUE(packing.ok());
    const std::vector<std::vector<int>> seen = Deliveries(*packing, lengths, packing->width);
    for (size_t d = 0; d < seen.size(); ++d) {
      for (size_t o = 0; o < seen[d].size(); ++o) {
        ASSERT_EQ(seen[d][o], 1) << "document " << d << " token " << o;
      }
    }
    std::vector<int> pieces(lengths.size(), 0);
    for (uint64_t r = 0; r < packing->rows(); ++r) {
      uint64_t used = 0;
      for (const PackPiece& piece : packing->Row(r)) {
        used += piece.length;
        ++pieces[piece.document];
      }
      ASSERT_LE(used, seq_len + 1);
      ASSERT_GE(used, 1u);
    }
    uint64_t split = 0;
    for (size_t d = 0; d < lengths.size(); ++d) {
      const int whole = lengths[d] == 0 ? 0 : 1;
      const uint64_t chunks = (lengths[d] + seq_len) / (seq_len + 1);  // ceil(length / width)
      ASSERT_EQ(pieces[d], lengths[d] <= seq_len + 1 ? whole : static_cast<int>(chunks)) << d;
      split += pieces[d] > 1 ? 1 : 0;
    }
    const PackStats stats = MeasurePacking(*packing, lengths);
    EXPECT_EQ(stats.truncated_documents, split);
    EXPECT_EQ(stats.dropped_tokens, 0u);
    EXPECT_EQ(stats.pad_tokens + stats.document_tokens, stats.row_tokens);
  }
}

TEST(PackTest, PositionIdsAndCuSeqlensOfARow) {
  const std::vector<PackPiece> row = {{2, 10, 2}, {5, 0, 1}};
  std::vector<int32_t> positions(10);
  PositionIds(row, positions);
  EXPECT_THAT(positions, ElementsAre(0, 1, 0, 0, 1, 2, 3, 4, 5, 6));
  EXPECT_THAT(CuSeqlens(row, 10), ElementsAre(0, 2, 3, 10));
  EXPECT_THAT(CuSeqlens(row, 9), ElementsAre(0, 2, 3, 9));
  const std::vector<PackPiece> full = {{1, 0, 7}, {0, 0, 3}};
  positions.assign(9, -1);
  PositionIds(full, positions);  // the inputs: the first seq_len tokens
  EXPECT_THAT(positions, ElementsAre(0, 1, 2, 3, 4, 5, 6, 0, 1));
  EXPECT_THAT(CuSeqlens(full, 9), ElementsAre(0, 7, 9));
  EXPECT_THAT(CuSeqlens(full, 10), ElementsAre(0, 7, 10));
  EXPECT_THAT(CuSeqlens(full, 7), ElementsAre(0, 7));
}

// Pieces longer than the table PositionIds copies from (64 Ki) go on counting past it.
TEST(PackTest, PositionIdsOfPiecesLongerThanTheirTable) {
  const uint64_t long_piece = (uint64_t{1} << 16) + 1000;
  const std::vector<PackPiece> row = {{0, 0, 3}, {1, 5, long_piece}};
  std::vector<int32_t> positions(3 + long_piece + 70000, -1);
  PositionIds(row, positions);
  for (size_t i = 0; i < positions.size(); ++i) {
    const size_t want = i < 3 ? i : i < 3 + long_piece ? i - 3 : i - 3 - long_piece;
    ASSERT_EQ(positions[i], static_cast<int32_t>(want)) << "token " << i;
  }
}

// position_ids restart exactly at cu_seqlens' boundaries, and the sequences' lengths are the
// pieces' (then the padding's), for every row of both packings.
TEST(PackTest, PositionIdsAgreeWithCuSeqlensAndPieces) {
  const std::vector<uint64_t> lengths = LogNormalLengths(2000, 3);
  const uint64_t seq_len = 511;
  for (bool best_fit : {false, true}) {
    absl::StatusOr<Packing> packing =
        best_fit ? PackBestFit(lengths, seq_len) : PackConcat(lengths, seq_len);
    ASSERT_TRUE(packing.ok());
    for (uint64_t r = 0; r < packing->rows(); ++r) {
      const std::span<const PackPiece> row = packing->Row(r);
      for (uint64_t tokens : {seq_len, seq_len + 1}) {
        std::vector<int32_t> positions(tokens);
        PositionIds(row, positions);
        const std::vector<int32_t> cu = CuSeqlens(row, tokens);
        ASSERT_EQ(cu.front(), 0);
        ASSERT_EQ(cu.back(), static_cast<int32_t>(tokens));
        for (size_t s = 0; s + 1 < cu.size(); ++s) {
          ASSERT_LT(cu[s], cu[s + 1]);
          for (int32_t i = cu[s]; i < cu[s + 1]; ++i) ASSERT_EQ(positions[i], i - cu[s]);
          if (s < row.size()) {
            ASSERT_EQ(static_cast<uint64_t>(cu[s + 1] - cu[s]),
                      std::min<uint64_t>(row[s].length, tokens - cu[s]));
          }
        }
      }
    }
  }
}

// RowPiecesBound: the shortest pieces that fit the width (best_fit), plus the two a window
// cuts (concat); a document's copies count as more pieces; best_fit's long documents count
// as their chunks.
TEST(PackTest, RowPiecesBoundOfWorkedExamples) {
  const std::vector<uint64_t> lengths = {3, 0, 5, 2, 40, 9};
  RowPiecesBound best_fit(PackKind::kBestFit, 16);
  best_fit.Add(lengths, 1);
  EXPECT_EQ(best_fit.Bound(), 3u);  // 2 + 3 + 5 = 10; with the 9, 19 > 16
  RowPiecesBound concat(PackKind::kConcat, 16);
  concat.Add(lengths, 1);
  EXPECT_EQ(concat.Bound(), 5u);  // the same 3 inside the window, a piece cut at each end
  RowPiecesBound twice(PackKind::kBestFit, 16);
  twice.Add(lengths, 2);
  EXPECT_EQ(twice.Bound(), 5u);  // 2 + 2 + 3 + 3 + 5 = 15
  // 40 tokens in rows of 16: chunks of 16, 16 and a piece of 8, which fits beside 2 + 3.
  RowPiecesBound chunks(PackKind::kBestFit, 16);
  chunks.Add(std::vector<uint64_t>{40, 3, 2}, 1);
  EXPECT_EQ(chunks.Bound(), 3u);
  // Tokens of one each, more than a row: the width; and never more than the width.
  RowPiecesBound ones(PackKind::kConcat, 16);
  ones.Add(std::vector<uint64_t>(100, 1), 1000);
  EXPECT_EQ(ones.Bound(), 16u);
  // Pieces longer than the histogram (64 Ki tokens) count as shorter than they are.
  const uint64_t wide = uint64_t{1} << 20;
  RowPiecesBound long_pieces(PackKind::kBestFit, wide);
  long_pieces.Add(std::vector<uint64_t>{(uint64_t{1} << 16) + 5, 300000, 500000}, 1);
  EXPECT_EQ(long_pieces.Bound(), 3u);  // 65541 + 300000 + 500000 fit; counted 65537 each
  RowPiecesBound empty(PackKind::kBestFit, 16);
  EXPECT_EQ(empty.Bound(), 0u);
}

// The bound holds for every row of both packings, and is reached where the shortest
// documents can meet in a row.
TEST(PackTest, RowPiecesBoundHoldsForEveryRowAndIsReached) {
  for (const uint64_t seed : {1, 2, 3}) {
    std::vector<uint64_t> lengths = LogNormalLengths(3000, seed);
    for (uint64_t i = 0; i < 20; ++i) lengths[i * 97] = 1 + i % 3;  // some tiny documents
    const uint64_t seq_len = 255;
    for (const PackKind kind : {PackKind::kBestFit, PackKind::kConcat}) {
      const bool best_fit = kind == PackKind::kBestFit;
      RowPiecesBound bound(kind, seq_len + 1);
      bound.Add(lengths, 1);
      absl::StatusOr<Packing> packing =
          best_fit ? PackBestFit(lengths, seq_len, 256) : PackConcat(lengths, seq_len);
      ASSERT_TRUE(packing.ok());
      uint64_t most = 0;
      for (uint64_t r = 0; r < packing->rows(); ++r) most = std::max(most, packing->Row(r).size());
      EXPECT_LE(most, bound.Bound()) << "seed " << seed << (best_fit ? " best_fit" : " concat");
      EXPECT_LT(bound.Bound(), (seq_len + 1) / 2);  // narrow: that is what it is for
    }
  }
  // Tight: best_fit puts the 4 short documents into the room the 60s leave.
  const std::vector<uint64_t> lengths = {60, 1, 60, 1, 1, 60, 1};
  RowPiecesBound bound(PackKind::kBestFit, 64);
  bound.Add(lengths, 1);
  absl::StatusOr<Packing> packing = PackBestFit(lengths, 63, 8);
  ASSERT_TRUE(packing.ok());
  uint64_t most = 0;
  for (uint64_t r = 0; r < packing->rows(); ++r) most = std::max(most, packing->Row(r).size());
  EXPECT_EQ(bound.Bound(), 5u);  // 1 + 1 + 1 + 1 + 60
  EXPECT_EQ(most, 5u);
}

TEST(PackTest, RefusesABadSeqLenOrLookahead) {
  const std::vector<uint64_t> lengths = {4};
  EXPECT_EQ(PackConcat(lengths, 0).status().message(),
            "seq_len is 0; it must be in [1, 2^31 - 2]");
  EXPECT_EQ(PackBestFit(lengths, uint64_t{1} << 31).status().message(),
            "seq_len is 2147483648; it must be in [1, 2^31 - 2]");
  EXPECT_EQ(PackBestFit(lengths, 8, 0).status().message(),
            "lookahead is 0; it must be at least 1 document");
}

}  // namespace
}  // namespace gpufeed::server
