#include "server/sampler/pack.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::server {
namespace {

absl::Status CheckSeqLen(uint64_t seq_len) {
  if (seq_len < 1 || seq_len >= (uint64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("seq_len is ", seq_len, "; it must be in [1, 2^31 - 2]"));
  }
  return absl::OkStatus();
}

double Fraction(uint64_t part, uint64_t whole) {
  return whole == 0 ? 0.0 : static_cast<double>(part) / static_cast<double>(whole);
}

// Packs one group of documents [first, end) by best-fit-decreasing into `out`.
void PackGroup(std::span<const uint64_t> lengths, uint64_t first, uint64_t end, uint64_t width,
               Packing& out) {
  std::vector<PackPiece> pieces;
  for (uint64_t d = first; d < end; ++d) {
    for (uint64_t offset = 0; offset < lengths[d]; offset += width) {
      pieces.push_back(PackPiece{d, offset, std::min(width, lengths[d] - offset)});
    }
  }
  // Pieces are in (document, offset) order already, so a stable sort breaks ties by it.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const PackPiece& a, const PackPiece& b) { return a.length > b.length; });
  std::vector<std::vector<PackPiece>> rows;
  std::vector<uint64_t> room;
  std::set<std::pair<uint64_t, size_t>> open;  // (room, row): least room first, then oldest
  for (const PackPiece& piece : pieces) {
    auto fit = open.lower_bound({piece.length, 0});
    size_t row;
    if (fit == open.end()) {
      row = rows.size();
      rows.emplace_back();
      room.push_back(width);
    } else {
      row = fit->second;
      open.erase(fit);
    }
    rows[row].push_back(piece);
    room[row] -= piece.length;
    if (room[row] > 0) open.emplace(room[row], row);
  }
  for (const std::vector<PackPiece>& row : rows) {
    out.pieces.insert(out.pieces.end(), row.begin(), row.end());
    out.row_begin.push_back(out.pieces.size());
  }
}

}  // namespace

absl::StatusOr<Packing> PackConcat(std::span<const uint64_t> lengths, uint64_t seq_len) {
  if (absl::Status status = CheckSeqLen(seq_len); !status.ok()) return status;
  Packing packing;
  packing.width = seq_len + 1;
  uint64_t total = 0;
  for (uint64_t length : lengths) total += length;
  const uint64_t rows = total == 0 ? 0 : (total - 1) / seq_len;
  // Walks the stream once: `document`/`offset` is where the next row begins.
  uint64_t document = 0;
  uint64_t offset = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    uint64_t need = packing.width;
    uint64_t d = document;
    uint64_t o = offset;
    while (need > 0) {
      while (o == lengths[d]) {
        ++d;
        o = 0;
      }
      const uint64_t take = std::min(need, lengths[d] - o);
      packing.pieces.push_back(PackPiece{d, o, take});
      need -= take;
      o += take;
    }
    packing.row_begin.push_back(packing.pieces.size());
    // The next row starts at this row's last token: step back one from (d, o).
    document = d;
    offset = o - 1;
  }
  return packing;
}

absl::StatusOr<Packing> PackBestFit(std::span<const uint64_t> lengths, uint64_t seq_len,
                                    uint64_t lookahead) {
  if (absl::Status status = CheckSeqLen(seq_len); !status.ok()) return status;
  if (lookahead < 1) {
    return absl::InvalidArgumentError("lookahead is 0; it must be at least 1 document");
  }
  Packing packing;
  packing.width = seq_len + 1;
  for (uint64_t first = 0; first < lengths.size(); first += lookahead) {
    PackGroup(lengths, first, std::min<uint64_t>(lengths.size(), first + lookahead),
              packing.width, packing);
  }
  return packing;
}

double PackStats::padding_fraction() const { return Fraction(pad_tokens, row_tokens); }
double PackStats::truncation_fraction() const { return Fraction(truncated_documents, documents); }
double PackStats::dropped_fraction() const { return Fraction(dropped_tokens, document_tokens); }

PackStats MeasurePacking(const Packing& packing, std::span<const uint64_t> lengths) {
  PackStats stats;
  stats.rows = packing.rows();
  stats.row_tokens = stats.rows * packing.width;
  std::vector<uint64_t> pieces(lengths.size(), 0);
  std::vector<uint64_t> covered(lengths.size(), 0);  // distinct tokens: concat shares one a row
  std::vector<uint64_t> end(lengths.size(), 0);
  for (uint64_t r = 0; r < packing.rows(); ++r) {
    uint64_t used = 0;
    for (const PackPiece& piece : packing.Row(r)) {
      used += piece.length;
      ++pieces[piece.document];
      // Pieces of a document come in offset order in both packers' output.
      const uint64_t from = std::max(piece.offset, end[piece.document]);
      if (piece.offset + piece.length > from) covered[piece.document] += piece.offset + piece.length - from;
      end[piece.document] = std::max(end[piece.document], piece.offset + piece.length);
    }
    stats.pad_tokens += packing.width - used;
  }
  for (size_t d = 0; d < lengths.size(); ++d) {
    if (lengths[d] == 0) continue;
    ++stats.documents;
    stats.document_tokens += lengths[d];
    stats.dropped_tokens += lengths[d] - covered[d];
    if (pieces[d] != 1 || covered[d] != lengths[d]) ++stats.truncated_documents;
  }
  return stats;
}

namespace {

// 0, 1, 2, ... for PositionIds to copy: libc's memcpy (as wide as the CPU has: AVX2 or
// AVX-512, chosen at run time) writes a piece's positions several times faster than the loop
// a baseline x86-64 build vectorizes to SSE2 (lm_rows_bench: PositionIds was 30 % of a packed
// row). 256 KiB, made once; a piece longer than it is finished by the loop.
constexpr size_t kIotaLength = size_t{1} << 16;

const int32_t* Iota() {
  static const int32_t* const table = [] {
    auto* t = new int32_t[kIotaLength];  // never freed: rows may be read at exit
    std::iota(t, t + kIotaLength, 0);
    return t;
  }();
  return table;
}

void Ascending(int32_t* p, size_t n) {
  const size_t copied = std::min(n, kIotaLength);
  std::memcpy(p, Iota(), copied * sizeof(int32_t));
  for (size_t i = copied; i < n; ++i) p[i] = static_cast<int32_t>(i);
}

}  // namespace

void PositionIds(std::span<const PackPiece> row, std::span<int32_t> out) {
  int32_t* p = out.data();
  size_t left = out.size();
  for (const PackPiece& piece : row) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(piece.length, left));
    Ascending(p, n);
    p += n;
    left -= n;
  }
  Ascending(p, left);
}

std::vector<int32_t> CuSeqlens(std::span<const PackPiece> row, uint64_t tokens) {
  std::vector<int32_t> cu = {0};
  uint64_t end = 0;
  for (const PackPiece& piece : row) {
    if (end >= tokens) break;
    end = std::min(tokens, end + piece.length);
    cu.push_back(static_cast<int32_t>(end));
  }
  if (end < tokens) cu.push_back(static_cast<int32_t>(tokens));
  return cu;
}

RowPiecesBound::RowPiecesBound(PackKind kind, uint64_t width)
    // 64 Ki lengths (512 KiB): past that, a piece's exact length barely moves the bound.
    : kind_(kind), width_(width), count_(std::min<uint64_t>(width, uint64_t{1} << 16) + 1, 0) {}

void RowPiecesBound::Count(uint64_t length, uint64_t n) {
  if (length == 0 || n == 0) return;
  uint64_t& c = length < count_.size() ? count_[length] : longer_;
  c = std::min(width_ + 1, c + std::min(n, width_ + 1));
}

void RowPiecesBound::Add(std::span<const uint64_t> lengths, uint64_t copies) {
  for (const uint64_t n : lengths) {
    if (kind_ == PackKind::kBestFit && n > width_) {
      // Chunks of the width (each a row's whole) and the rest.
      Count(width_, std::min(n / width_, width_ + 1) * copies);
      Count(n % width_, copies);
    } else {
      Count(n, copies);
    }
  }
}

uint64_t RowPiecesBound::Bound() const {
  uint64_t room = width_, pieces = 0;
  bool full = false;
  for (uint64_t n = 1; n < count_.size() && !full; ++n) {
    const uint64_t take = std::min(count_[n], room / n);
    pieces += take;
    room -= take * n;
    full = take < count_[n];
  }
  if (!full) pieces += std::min(longer_, room / count_.size());
  // concat: the window also cuts a document at each end.
  if (kind_ == PackKind::kConcat) pieces += 2;
  return std::min(pieces, width_);
}

}  // namespace gpufeed::server
