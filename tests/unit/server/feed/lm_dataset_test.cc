// LmDataset: a blend of token sources and document packing read as one dataset. The order
// arithmetic (Blend, PackBestFit) has its own tests; these check what is read by it: the
// union ids and window bytes of a blend, every document token once in packed rows, the
// per-row tensors, a resume that changes the weights, and the refusals.
#include "server/feed/lm_dataset.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/byte_budget.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/feed/feed.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;

constexpr uint32_t kEos = 0xffffffffu;

std::string U32(const std::vector<uint32_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// Source k's token at place p of its stream: (k + 1) << 24 | p (never kEos).
uint32_t TokenOf(int k, uint64_t p) { return (uint32_t(k + 1) << 24) | uint32_t(p); }

// A raw uint32 file of `n` tokens of source k.
std::string WindowFile(int k, uint64_t n) {
  std::vector<uint32_t> v(n);
  for (uint64_t p = 0; p < n; ++p) v[p] = TokenOf(k, p);
  return U32(v);
}

// Documents of the given lengths (each ending in kEos), tokens (k + 1) << 24 | doc << 12 | i.
std::string DocumentFile(int k, const std::vector<uint32_t>& lengths) {
  std::vector<uint32_t> v;
  for (size_t d = 0; d < lengths.size(); ++d) {
    for (uint32_t i = 0; i + 1 < lengths[d]; ++i) {
      v.push_back((uint32_t(k + 1) << 28) | (uint32_t(d) << 12) | i);
    }
    v.push_back(kEos);
  }
  return U32(v);
}

DatasetSpec Tokens(const std::string& dir, int64_t seq_len) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kTokens;
  spec.path = dir;
  spec.token_dtype = DType::kUInt32;
  spec.seq_len = seq_len;
  return spec;
}

struct Row {
  uint64_t id = 0;
  std::vector<uint32_t> tokens;
  std::vector<int32_t> position_ids;
  std::vector<uint8_t> loss_mask;
  std::vector<int32_t> cu_seqlens;
  bool operator==(const Row&) const = default;
};

// One row read into buffers of its own: the status ReadSampleAt gave.
absl::StatusOr<uint64_t> ReadRowStatus(const LmDataset& d, uint64_t id, int64_t epoch) {
  std::vector<std::vector<std::byte>> buffers;
  std::vector<std::span<std::byte>> rows;
  for (const auto& t : d.tensors()) {
    buffers.emplace_back(t.byte_size);
    rows.emplace_back(buffers.back());
  }
  return d.ReadSampleAt(id, SampleContext{0, epoch}, rows);
}

Row ReadRow(const LmDataset& d, uint64_t id, int64_t epoch = 0) {
  const uint64_t width = d.tensors().front().shape.front();
  Row r;
  r.tokens.resize(width);
  std::vector<std::span<std::byte>> rows;
  rows.emplace_back(reinterpret_cast<std::byte*>(r.tokens.data()), width * 4);
  if (d.tensors().size() == 4) {
    r.position_ids.resize(width);
    r.loss_mask.resize(width);
    const uint64_t cu_width = d.tensors()[3].shape.front();
    EXPECT_LE(cu_width, width);
    EXPECT_EQ(d.tensors()[3].byte_size, cu_width * 4);
    // One int32 more than the tensor, which must stay as it is: a row never writes past it.
    r.cu_seqlens.assign(cu_width + 1, -7);
    rows.emplace_back(reinterpret_cast<std::byte*>(r.position_ids.data()), width * 4);
    rows.emplace_back(reinterpret_cast<std::byte*>(r.loss_mask.data()), width);
    rows.emplace_back(reinterpret_cast<std::byte*>(r.cu_seqlens.data()), cu_width * 4);
  }
  absl::StatusOr<uint64_t> got = d.ReadSampleAt(id, SampleContext{0, epoch}, rows);
  EXPECT_TRUE(got.ok()) << got.status();
  r.id = got.ok() ? *got : ~uint64_t{0};
  if (!r.cu_seqlens.empty()) {
    EXPECT_EQ(r.cu_seqlens.back(), -7) << "row " << id << " wrote past cu_seqlens";
    r.cu_seqlens.pop_back();
  }
  return r;
}

// A blend of three sources of windows over 100,000 rows: union ids in Blend's order (whose
// source sequence is Megatron-Core's build_blending_indices: blend_test.cc), each row the
// source's window, the realised shares within 1 % of the weights at every 1,000-row prefix.
TEST(LmDatasetTest, ABlendReadsEachSourcesWindowInBlendOrder) {
  TempDir dir;
  const int64_t seq_len = 8;
  const uint64_t tokens[] = {40001, 24001, 16001};  // 5000, 3000, 2000 windows
  LmSpec lm;
  const double weights[] = {0.5, 0.3, 0.2};
  for (int k = 0; k < 3; ++k) {
    const std::string name = absl::StrCat("s", k, ".bin");
    dir.WriteFile(name, WindowFile(k, tokens[k]));
    lm.sources.push_back({{dir.Join(name)}, weights[k], name});
  }
  absl::StatusOr<std::unique_ptr<LmDataset>> d =
      LmDataset::Open(Tokens(dir.path(), seq_len), lm, 7, true, PosixFileSystem());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->num_samples(), 10000u);
  ASSERT_EQ((*d)->segments().size(), 1u);

  BlendSpec reference{{5000, 3000, 2000}, 7, true, {{0, {0.5, 0.3, 0.2}, {0, 0, 0}}}};
  std::unique_ptr<Blend> blend = *Blend::Create(reference);
  // 100,000 rows: ten nominal epochs, each source through several of its own.
  std::vector<BlendPick> picks(100000);
  blend->Fill(0, picks);
  uint64_t counts[3] = {0, 0, 0};
  for (uint64_t t = 0; t < picks.size(); ++t) {
    const Row r = ReadRow(**d, t % 10000, static_cast<int64_t>(t / 10000));
    const BlendPick& pick = picks[t];
    ASSERT_EQ(r.id, pick.id) << "row " << t;
    for (int64_t i = 0; i <= seq_len; ++i) {
      ASSERT_EQ(r.tokens[i], TokenOf(pick.source, pick.sample * seq_len + i)) << "row " << t;
    }
    ++counts[pick.source];
    if ((t + 1) % 1000 == 0) {
      for (int k = 0; k < 3; ++k) {
        EXPECT_NEAR(double(counts[k]) / double(t + 1), weights[k], 0.01) << "prefix " << t + 1;
      }
    }
  }
}

// Best-fit packing of documents split at eos_id: over the rows that cover the source's first
// epoch (the lookahead divides the documents), every document token comes exactly once;
// position_ids restart at each piece, loss_mask marks the tokens, cu_seqlens the pieces.
TEST(LmDatasetTest, BestFitDeliversEveryDocumentTokenOnce) {
  TempDir dir;
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> length(3.5, 1.0);
  std::vector<uint32_t> lengths(3072);  // three groups of concat's 1,024, 48 of best_fit's 64
  uint64_t total = 0;
  for (uint32_t& n : lengths) {
    n = static_cast<uint32_t>(std::clamp(length(rng), 1.0, 400.0));
    total += n;
  }
  dir.WriteFile("docs.bin", DocumentFile(0, lengths));
  for (const PackMode mode : {PackMode::kBestFit, PackMode::kConcat}) {
    SCOPED_TRACE(PackModeName(mode));
    LmSpec lm;
    lm.pack = mode;
    lm.eos_id = kEos;
    if (mode == PackMode::kBestFit) lm.lookahead = 64;  // 48 groups make the epoch
    const int64_t seq_len = 63;
    absl::StatusOr<std::unique_ptr<LmDataset>> d = LmDataset::Open(
        Tokens(dir.Join("docs.bin"), seq_len), lm, 11, true, PosixFileSystem());
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_EQ((*d)->tensors().size(), 4u);
    // Each (document, place) delivered, counted; eos tokens by their document.
    std::map<std::pair<uint32_t, uint32_t>, int> seen;
    uint64_t delivered = 0, eos = 0, overshoot = 0;
    for (uint64_t id = 0; delivered < total; ++id) {
      ASSERT_LT(id, 10 * (*d)->num_samples());
      const Row r = ReadRow(**d, id % (*d)->num_samples(), static_cast<int64_t>(id / (*d)->num_samples()));
      EXPECT_EQ(r.id, id);
      // concat rows share their first token with the row before: count it there only.
      const size_t from = (mode == PackMode::kConcat && id > 0) ? 1 : 0;
      int32_t expect_position = 0;
      std::vector<int32_t> cu = {0};
      for (size_t i = 0; i < r.tokens.size(); ++i) {
        if (r.loss_mask[i] == 0) {
          ASSERT_EQ(r.tokens[i], 0u) << "padding at " << i << " of row " << id;
          continue;
        }
        if (r.position_ids[i] == 0) {
          if (i > 0) cu.push_back(static_cast<int32_t>(i));
          expect_position = 0;
        }
        ASSERT_EQ(r.position_ids[i], expect_position++) << "row " << id << " token " << i;
        // best_fit cuts only documents longer than a row, in row-wide chunks: a piece starts
        // at a document's start or a multiple of the width into it.
        if (mode == PackMode::kBestFit && r.position_ids[i] == 0 && r.tokens[i] != kEos) {
          ASSERT_EQ((r.tokens[i] & 0xfff) % (seq_len + 1), 0u) << "row " << id << " token " << i;
        }
        if (i < from) continue;
        if (delivered == total) {
          ++overshoot;
          continue;
        }
        ++delivered;
        if (r.tokens[i] == kEos) {
          ++eos;
        } else {
          ++seen[{(r.tokens[i] >> 12) & 0xffff, r.tokens[i] & 0xfff}];
        }
      }
      // cu_seqlens: 0, each piece's end within the first seq_len tokens, then seq_len.
      std::vector<int32_t> want;
      for (int32_t c : cu) {
        if (c < seq_len) want.push_back(c);
      }
      for (size_t i = 1; i < r.cu_seqlens.size(); ++i) {
        ASSERT_GE(r.cu_seqlens[i], r.cu_seqlens[i - 1]) << "row " << id;
      }
      EXPECT_EQ(r.cu_seqlens[0], 0);
      EXPECT_EQ(r.cu_seqlens.back(), seq_len);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(r.cu_seqlens[i], want[i]) << "row " << id;
    }
    EXPECT_EQ(delivered, total);
    EXPECT_EQ(eos, lengths.size());
    // best_fit's groups end where the epoch does (64 divides 256): its rows too.
    if (mode == PackMode::kBestFit) {
      EXPECT_EQ(overshoot, 0u);
    }
    // Every non-eos token of every document exactly once.
    for (uint32_t doc = 0; doc < lengths.size(); ++doc) {
      for (uint32_t i = 0; i + 1 < lengths[doc]; ++i) {
        EXPECT_EQ((seen[{doc, i}]), 1) << "document " << doc << " token " << i;
      }
    }
    // Rows read again after their groups left the cache, and by two threads at once, are the
    // rows read first.
    std::vector<Row> first;
    for (uint64_t id = 0; id < 200; ++id) first.push_back(ReadRow(**d, id));
    std::vector<Row> a(200), b(200);
    std::thread other([&] {
      for (uint64_t id = 200; id-- > 0;) b[id] = ReadRow(**d, id);
    });
    for (uint64_t id = 0; id < 200; ++id) a[id] = ReadRow(**d, id);
    other.join();
    for (uint64_t id = 0; id < 200; ++id) {
      ASSERT_EQ(a[id].tokens, first[id].tokens) << "row " << id;
      ASSERT_EQ(b[id].tokens, first[id].tokens) << "row " << id;
      ASSERT_EQ(b[id].position_ids, first[id].position_ids) << "row " << id;
    }
  }
}

// Groups are packed with no lock held, by the ahead workers or by the fill thread that needs
// one: eight threads taking batches of a fresh blend the way a feed's fill threads do (a
// ninth rereading from the start, its groups long evicted, a tenth reading rows anywhere)
// read exactly the rows a single reader of another copy reads, every tensor, across groups,
// chunks of picks and the epoch's end; and the stream's report counts each group once.
TEST(LmDatasetTest, RowsReadByManyThreadsAreOneThreadsRows) {
  TempDir dir;
  std::mt19937_64 rng(5);
  std::lognormal_distribution<double> length(1.8, 0.9);
  LmSpec blend;
  const double weights[] = {0.5, 0.3, 0.2};
  for (int k = 0; k < 3; ++k) {
    // 90,000 documents in all: past the first chunk of 65,536 picks within the epoch.
    std::vector<uint32_t> lengths(static_cast<size_t>(90000 * weights[k]));
    for (uint32_t& n : lengths) n = static_cast<uint32_t>(std::clamp(length(rng), 1.0, 200.0));
    const std::string name = absl::StrCat("s", k, ".bin");
    dir.WriteFile(name, DocumentFile(k, lengths));
    blend.sources.push_back({{dir.Join(name)}, weights[k], name});
  }
  blend.eos_id = kEos;
  for (const PackMode mode : {PackMode::kBestFit, PackMode::kConcat}) {
    SCOPED_TRACE(PackModeName(mode));
    LmSpec lm = blend;
    lm.pack = mode;
    if (mode == PackMode::kBestFit) lm.lookahead = 16;  // thousands of groups
    auto open = [&] {
      return *LmDataset::Open(Tokens(dir.path(), 31), lm, 3, true, PosixFileSystem());
    };
    const std::unique_ptr<LmDataset> alone = open();
    const std::unique_ptr<LmDataset> shared = open();
    const uint64_t rows = alone->num_samples() + 3000;  // into the second epoch
    const uint64_t n = alone->num_samples();
    std::vector<Row> want(rows), got(rows), again(rows);
    for (uint64_t r = 0; r < rows; ++r)
      want[r] = ReadRow(*alone, r % n, static_cast<int64_t>(r / n));

    constexpr uint64_t kBatch = 16;
    std::atomic<uint64_t> next{0};
    std::vector<std::thread> fill;
    for (int t = 0; t < 8; ++t) {
      fill.emplace_back([&] {
        for (uint64_t b = next++; b * kBatch < rows; b = next++) {
          for (uint64_t r = b * kBatch; r < std::min(rows, (b + 1) * kBatch); ++r) {
            got[r] = ReadRow(*shared, r % n, static_cast<int64_t>(r / n));
          }
        }
      });
    }
    std::thread behind([&] {
      for (uint64_t r = 0; r < rows; r += 7)
        again[r] = ReadRow(*shared, r % n, static_cast<int64_t>(r / n));
    });
    // Rows anywhere, in no order: groups packed far from the others, evicted, packed again,
    // and concat rows running into a group no thread has packed yet.
    std::vector<std::pair<uint64_t, Row>> random(3000);
    std::thread anywhere([&] {
      std::mt19937_64 pick(9);
      for (auto& [r, row] : random) {
        r = pick() % rows;
        row = ReadRow(*shared, r % n, static_cast<int64_t>(r / n));
      }
    });
    for (auto& t : fill) t.join();
    behind.join();
    anywhere.join();
    for (uint64_t r = 0; r < rows; ++r) {
      ASSERT_EQ(got[r], want[r]) << "row " << r;
      if (r % 7 == 0) {
        ASSERT_EQ(again[r], want[r]) << "row " << r << ", reread";
      }
    }
    for (const auto& [r, row] : random) ASSERT_EQ(row, want[r]) << "row " << r << ", read anywhere";
    // The stream's report counts each group once, whichever thread packed it: its document
    // tokens are its rows' tokens less their padding (best_fit cuts, never drops), and its
    // documents whole groups.
    for (const LmDataset* d : {alone.get(), shared.get()}) {
      const LmDataset::Stats st = d->stats();
      ASSERT_EQ(st.source_tokens.size(), 3u);
      const uint64_t tokens = st.source_tokens[0] + st.source_tokens[1] + st.source_tokens[2];
      EXPECT_EQ(st.documents % (mode == PackMode::kBestFit ? 16 : 1024), 0u);
      if (mode == PackMode::kBestFit) {
        EXPECT_GE(st.rows,
                  rows - n);  // every row read was counted (the epoch's end: rows - n past)
        EXPECT_EQ(tokens, st.row_tokens - st.pad_tokens);
        EXPECT_EQ(st.row_tokens, st.rows * 32);
      } else {
        EXPECT_GE(tokens, rows * 31);  // every token read, counted once
      }
    }
  }
}

// A blend of windows read by eight threads at once: the rows a single reader reads, across
// chunks of picks (the workers fill the next one ahead), and every window read counted once
// in the tokens per source (a chunk filled ahead of its turn waits to be counted in order).
TEST(LmDatasetTest, AnUnpackedBlendReadByManyThreadsIsOneReadersAndCountsEachWindowOnce) {
  TempDir dir;
  const int64_t seq_len = 7;
  const uint64_t windows[] = {45000, 27000, 18000};  // 90,000: past the first chunk of 65,536
  LmSpec lm;
  const double weights[] = {0.5, 0.3, 0.2};
  for (int k = 0; k < 3; ++k) {
    const std::string name = absl::StrCat("w", k, ".bin");
    dir.WriteFile(name, WindowFile(k, windows[k] * (seq_len + 1) + 1));
    lm.sources.push_back({{dir.Join(name)}, weights[k], name});
  }
  auto open = [&] {
    return *LmDataset::Open(Tokens(dir.path(), seq_len), lm, 5, true, PosixFileSystem());
  };
  const std::unique_ptr<LmDataset> alone = open();
  const std::unique_ptr<LmDataset> shared = open();
  const uint64_t n = alone->num_samples();
  const uint64_t rows = n + 70000;  // into the second epoch, past another chunk
  std::vector<Row> want(rows), got(rows);
  for (uint64_t r = 0; r < rows; ++r) want[r] = ReadRow(*alone, r % n, static_cast<int64_t>(r / n));
  std::atomic<uint64_t> next{0};
  std::vector<std::thread> fill;
  for (int t = 0; t < 8; ++t) {
    fill.emplace_back([&] {
      for (uint64_t b = next++; b * 16 < rows; b = next++) {
        for (uint64_t r = b * 16; r < std::min(rows, (b + 1) * 16); ++r) {
          got[r] = ReadRow(*shared, r % n, static_cast<int64_t>(r / n));
        }
      }
    });
  }
  for (auto& t : fill) t.join();
  for (uint64_t r = 0; r < rows; ++r) ASSERT_EQ(got[r], want[r]) << "row " << r;
  for (const LmDataset* d : {alone.get(), shared.get()}) {
    const LmDataset::Stats st = d->stats();
    ASSERT_EQ(st.source_tokens.size(), 3u);
    const uint64_t tokens = st.source_tokens[0] + st.source_tokens[1] + st.source_tokens[2];
    // Whole chunks of 65,536 windows, in order, covering every row read: at least 3 chunks,
    // and no more than were filled (the readers' 3 and the one ahead).
    EXPECT_EQ(tokens % (65536 * (seq_len + 1)), 0u) << tokens;
    EXPECT_GE(tokens, 3 * 65536 * uint64_t{seq_len + 1});
    EXPECT_LE(tokens, 4 * 65536 * uint64_t{seq_len + 1});
  }
}

// A Megatron .bin's .idx sequences are the documents when no eos_id is given; a raw file
// without eos_id is refused, naming the way out.
TEST(LmDatasetTest, DocumentsComeFromMegatronIdxOrEosAndNothingElse) {
  TempDir dir;
  dir.WriteFile("raw.bin", WindowFile(0, 1000));
  LmSpec lm;
  lm.pack = PackMode::kBestFit;
  absl::StatusOr<std::unique_ptr<LmDataset>> raw =
      LmDataset::Open(Tokens(dir.Join("raw.bin"), 15), lm, 1, true, PosixFileSystem());
  ASSERT_FALSE(raw.ok());
  EXPECT_EQ(raw.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(raw.status().message(), HasSubstr("set eos_id"));
  EXPECT_THAT(raw.status().message(), HasSubstr("Megatron .bin/.idx"));

  // Megatron: version 1, dtype 4 (int32), 3 sequences of 5, 0 (left out) and 7 tokens.
  std::string idx("MMIDIDX\0\0", 9);
  auto put = [&idx](const void* p, size_t n) { idx.append(static_cast<const char*>(p), n); };
  const uint64_t version = 1, sequences = 3, documents = 4;
  put(&version, 8);
  idx.push_back(4);
  put(&sequences, 8);
  put(&documents, 8);
  for (int32_t s : {5, 0, 7}) put(&s, 4);
  for (int64_t o : {0, 20, 20}) put(&o, 8);
  for (int64_t doc : {0, 1, 2, 3}) put(&doc, 8);
  dir.WriteFile("m.idx", idx);
  dir.WriteFile("m.bin", WindowFile(1, 12));
  DatasetSpec spec = Tokens(dir.path(), 15);
  spec.paths = {dir.Join("m.bin")};
  lm.lookahead = 2;  // one group: the two documents
  spec.token_dtype = DType::kUnspecified;
  absl::StatusOr<std::unique_ptr<LmDataset>> m =
      LmDataset::Open(spec, lm, 1, false, PosixFileSystem());
  ASSERT_TRUE(m.ok()) << m.status();
  // One row of 16: the 7 and the 5 (longest first), then 4 padding.
  const Row r = ReadRow(**m, 0);
  // The padding counts as a sequence of its own (PositionIds).
  const std::vector<int32_t> positions = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3};
  EXPECT_EQ(r.position_ids, positions);
  EXPECT_EQ(r.tokens[0], TokenOf(1, 5));
  EXPECT_EQ(r.tokens[7], TokenOf(1, 0));
  EXPECT_EQ(r.tokens[12], 0u);
  EXPECT_EQ(std::count(r.loss_mask.begin(), r.loss_mask.end(), 1), 12);
  // cu_seqlens is 5 wide, not 16: a group of 2 picks over 2 documents holds each at most
  // 2 + 2 / 2 = 3 times, and 3 of the 5 fit a row (RowPiecesBound), plus 0 and the end.
  const std::vector<int32_t> cu = {0, 7, 12, 15, 15};
  EXPECT_EQ(r.cu_seqlens, cu);
}

std::string I64(const std::vector<int64_t>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 8);
}

// A shard's offsets file (S.offsets.npy) gives its documents as a Megatron .idx does: found
// beside the shard however the shard is named (its directory, a glob, a list, the file
// alone), never read as a shard itself, and refused, naming the entry, where it is not a
// CSR offsets array of the shard's tokens.
TEST(LmDatasetTest, DocumentsComeFromAShardsOffsetsFile) {
  TempDir dir;
  // 12 uint32 tokens; documents of 5, 0 (left out) and 7 tokens: the Megatron test's.
  dir.WriteFile("o.npy", gpufeed::testing::NpyFile("<u4", "(12,)", WindowFile(1, 12)));
  dir.WriteFile("o.offsets.npy", gpufeed::testing::NpyFile("<i8", "(4,)", I64({0, 5, 5, 12})));
  LmSpec lm;
  lm.pack = PackMode::kBestFit;
  lm.lookahead = 2;
  const std::vector<int32_t> positions = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 0, 1, 2, 3};
  const auto expect_row = [&](const DatasetSpec& spec, const std::string& how) {
    SCOPED_TRACE(how);
    absl::StatusOr<std::unique_ptr<LmDataset>> d =
        LmDataset::Open(spec, lm, 1, false, PosixFileSystem());
    ASSERT_TRUE(d.ok()) << d.status();
    const Row r = ReadRow(**d, 0);
    EXPECT_EQ(r.position_ids, positions);
    EXPECT_EQ(r.tokens[0], TokenOf(1, 5));
    EXPECT_EQ(r.tokens[7], TokenOf(1, 0));
    EXPECT_EQ(std::count(r.loss_mask.begin(), r.loss_mask.end(), 1), 12);
  };
  DatasetSpec spec = Tokens(dir.path(), 15);
  spec.token_dtype = DType::kUnspecified;
  expect_row(spec, "the directory");
  spec.path = dir.Join("*.npy");
  expect_row(spec, "a glob that selects both files");
  spec.path = dir.Join("o.npy");
  expect_row(spec, "the shard named alone");
  spec.path = dir.path();
  spec.paths = {dir.Join("o.npy")};
  expect_row(spec, "a list of the shard");
  spec.paths = {dir.Join("o.offsets.npy"), dir.Join("o.npy")};
  expect_row(spec, "a list of both");

  // Not packed: the offsets file is no shard (12 tokens: one window of 12).
  DatasetSpec plain = Tokens(dir.path(), 11);
  plain.token_dtype = DType::kUnspecified;
  absl::StatusOr<std::unique_ptr<Dataset>> windows = OpenDataset(plain, PosixFileSystem());
  ASSERT_TRUE(windows.ok()) << windows.status();
  EXPECT_EQ((*windows)->num_samples(), 1u);

  // An offsets file alone is refused by its name, not read as uint32 tokens.
  TempDir lone;
  lone.WriteFile("x.offsets.npy", gpufeed::testing::NpyFile("<u4", "(2,)", U32({0, 12})));
  DatasetSpec alone = Tokens(lone.path(), 15);
  alone.token_dtype = DType::kUnspecified;
  absl::StatusOr<std::unique_ptr<LmDataset>> refused =
      LmDataset::Open(alone, lm, 1, false, PosixFileSystem());
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("x.offsets.npy is a document-offsets file"));

  // Each malformed offsets file, refused naming the file and what is wrong.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {gpufeed::testing::NpyFile("<i8", "(3,)", I64({1, 5, 12})), "entry 0 is 1, not 0"},
      {gpufeed::testing::NpyFile("<i8", "(4,)", I64({0, 6, 5, 12})),
       "entry 2 (5) is less than entry 1 (6)"},
      {gpufeed::testing::NpyFile("<i8", "(3,)", I64({0, 5, 11})),
       "the last entry is 11, not the shard's token count 12"},
      {gpufeed::testing::NpyFile("<i8", "(3,)", I64({0, 5, 13})), "entry 2 is 13, outside"},
      {gpufeed::testing::NpyFile("<i8", "(3,)", I64({0, -5, 12})), "entry 1 is negative"},
      {gpufeed::testing::NpyFile("<f4", "(2,)", std::string(8, '\0')), "an array of float32"},
      {gpufeed::testing::NpyFile("<i8", "(1, 2)", I64({0, 12})), "an array of 2 dimensions"},
      {gpufeed::testing::NpyFile("<i8", "(0,)", ""), "no entries"},
      {gpufeed::testing::NpyFile("<i8", "(14,)", I64(std::vector<int64_t>(14, 0))),
       "13 documents for 12 tokens"},
      {"not a npy", "not a .npy file"},
  };
  for (const auto& [bytes, want] : bad) {
    SCOPED_TRACE(want);
    dir.WriteFile("o.offsets.npy", bytes);
    spec.paths.clear();
    absl::StatusOr<std::unique_ptr<LmDataset>> d =
        LmDataset::Open(spec, lm, 1, false, PosixFileSystem());
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(d.status().message(), HasSubstr("o.offsets.npy (the document offsets of "));
    EXPECT_THAT(d.status().message(), HasSubstr(want));
  }
}

// A session starting far into the stream: Attach's Reach packs the groups before its start
// (with the ahead workers), the rows there equal those a reader from the start reads, and no
// group is packed twice (stale fronts once had the workers pack evicted groups again).
TEST(LmDatasetTest, AFarStartIsReachedPackingEachGroupOnce) {
  TempDir dir;
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> length(1.8, 0.9);
  LmSpec lm;
  for (int k = 0; k < 2; ++k) {
    std::vector<uint32_t> lengths(6000);
    for (uint32_t& n : lengths) n = static_cast<uint32_t>(std::clamp(length(rng), 1.0, 200.0));
    const std::string name = absl::StrCat("f", k, ".bin");
    dir.WriteFile(name, DocumentFile(k, lengths));
    lm.sources.push_back({{dir.Join(name)}, k == 0 ? 0.6 : 0.4, name});
  }
  lm.eos_id = kEos;
  for (const PackMode mode : {PackMode::kBestFit, PackMode::kConcat}) {
    SCOPED_TRACE(PackModeName(mode));
    lm.pack = mode;
    lm.lookahead = mode == PackMode::kBestFit ? 8 : 0;  // best_fit: thousands of groups
    const uint64_t per_group = mode == PackMode::kBestFit ? 8 : 1024;
    auto open = [&] {
      return *LmDataset::Open(Tokens(dir.path(), 31), lm, 4, true, PosixFileSystem());
    };
    const std::unique_ptr<LmDataset> far = open();
    const uint64_t n = far->num_samples();
    const uint64_t start = 2 * n + n / 2;  // epoch 2, half way
    ASSERT_TRUE(far->Reach(start).ok());
    std::vector<Row> got;
    for (uint64_t r = start; r < start + 40; ++r) got.push_back(ReadRow(*far, r % n, r / n));
    const LmDataset::Stats st = far->stats();
    EXPECT_EQ(st.groups, st.documents / per_group);
    EXPECT_GT(st.groups, mode == PackMode::kBestFit ? 1000u : 20u);
    // Each group once: none placed, evicted and packed again for a front left behind.
    EXPECT_EQ(st.groups_again, 0u) << "groups placed " << st.groups;
    const std::unique_ptr<LmDataset> along = open();
    for (uint64_t r = 0; r < start; r += 97) ReadRow(*along, r % n, r / n);
    for (uint64_t r = start; r < start + 40; ++r)
      ASSERT_EQ(got[r - start], ReadRow(*along, r % n, r / n)) << "row " << r;
  }
}

// cu_seqlens is as wide as the most pieces a row can hold (plus 0 and the end), counting the
// repeats of a source that wraps into its next epoch within a group or a window: a source of
// two short documents blended with long ones fills rows with copies of them. Every row of
// three epochs fits, and the width is the bound's, computed here by hand.
TEST(LmDatasetTest, CuSeqlensIsAsWideAsTheMostPiecesARowCanHold) {
  TempDir dir;
  dir.WriteFile("tiny.bin", DocumentFile(0, {2, 3}));
  dir.WriteFile("long.bin", DocumentFile(1, std::vector<uint32_t>(40, 50)));
  LmSpec lm;
  lm.sources.push_back({{dir.Join("tiny.bin")}, 0.5, "tiny.bin"});
  lm.sources.push_back({{dir.Join("long.bin")}, 0.5, "long.bin"});
  lm.eos_id = kEos;
  const int64_t seq_len = 63;
  for (const PackMode mode : {PackMode::kBestFit, PackMode::kConcat}) {
    SCOPED_TRACE(PackModeName(mode));
    lm.pack = mode;
    lm.lookahead = mode == PackMode::kBestFit ? 16 : 0;
    absl::StatusOr<std::unique_ptr<LmDataset>> d =
        LmDataset::Open(Tokens(dir.path(), seq_len), lm, 5, true, PosixFileSystem());
    ASSERT_TRUE(d.ok()) << d.status();
    // best_fit: groups of 16 picks; tiny's 2 documents at most 2 + 16 / 2 = 10 times each,
    // long's 40 at most 2 + 1 = 3: ten 2s, ten 3s (50 tokens) fit 64, a 50 not: 20 pieces.
    // concat: windows of 64 tokens; tiny's 5 tokens wrap, 2 + ceil(64 / 5) = 15 times each:
    // fifteen 2s, eleven 3s (63 tokens): 26, plus the 2 a window cuts: 28.
    const uint64_t pieces = mode == PackMode::kBestFit ? 20 : 28;
    ASSERT_EQ((*d)->tensors()[3].shape, std::vector<int64_t>{static_cast<int64_t>(pieces + 2)});
    const uint64_t n = (*d)->num_samples();
    size_t most = 0;
    for (uint64_t r = 0; r < 3 * n; ++r) {
      const Row row = ReadRow(**d, r % n, static_cast<int64_t>(r / n));
      ASSERT_EQ(row.id, r);
      size_t used = 1;
      while (used < row.cu_seqlens.size() && row.cu_seqlens[used] < seq_len) ++used;
      most = std::max(most, used);
      ASSERT_EQ(row.cu_seqlens.back(), seq_len) << "row " << r;
    }
    // best_fit: a row of a 50 and four 3s and a 2 (six pieces in the first 63 tokens), more
    // than one copy of each tiny document can make: counted without the repeats, the bound
    // would be 3 pieces. concat: a window cuts a 50, holds a 2 and a 3, and cuts the next.
    EXPECT_EQ(most, mode == PackMode::kBestFit ? 6u : 4u);
  }
}

// A hand-made blend_history whose ledgers add up but rewind a source at each segment start
// repeats one document past the bound (a review's example): refused, naming the history,
// never written past cu_seqlens.
TEST(LmDatasetTest, AHistoryThatRewindsASourcePastTheBoundIsRefused) {
  TempDir dir;
  std::vector<uint32_t> a(16, 64);
  a[0] = 1;  // an eos alone
  dir.WriteFile("a.bin", DocumentFile(0, a));
  dir.WriteFile("b.bin", DocumentFile(1, std::vector<uint32_t>(16, 30)));
  LmSpec lm;
  lm.sources.push_back({{dir.Join("a.bin")}, 1.0, "a.bin"});
  lm.sources.push_back({{dir.Join("b.bin")}, 1.0, "b.bin"});
  lm.eos_id = kEos;
  lm.pack = PackMode::kBestFit;
  lm.lookahead = 16;
  // Segment i starts at pick i with ledger (0, i): each pick is a's document 0 again.
  for (uint64_t i = 0; i < 16; ++i) lm.history.push_back({i, {1.0, 1.0}, {0, i}});
  absl::StatusOr<std::unique_ptr<LmDataset>> d =
      LmDataset::Open(Tokens(dir.path(), 63), lm, 1, false, PosixFileSystem());
  ASSERT_TRUE(d.ok()) << d.status();
  // 3 copies of each document: three 1s and two 30s fit a row, plus 0 and the end.
  ASSERT_EQ((*d)->tensors()[3].shape, std::vector<int64_t>{7});
  std::vector<uint32_t> tokens(64);
  std::vector<int32_t> positions(64), cu(8, -7);
  std::vector<uint8_t> mask(64);
  const std::vector<std::span<std::byte>> rows = {
      {reinterpret_cast<std::byte*>(tokens.data()), 64 * 4},
      {reinterpret_cast<std::byte*>(positions.data()), 64 * 4},
      {reinterpret_cast<std::byte*>(mask.data()), 64},
      {reinterpret_cast<std::byte*>(cu.data()), 7 * 4}};
  absl::StatusOr<uint64_t> got = (*d)->ReadSampleAt(0, SampleContext{}, rows);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_THAT(got.status().message(),
              HasSubstr("stream row 0 holds 16 pieces, more than cu_seqlens' 7 entries"));
  EXPECT_THAT(got.status().message(), HasSubstr("dataset.blend_history sends a source back"));
  EXPECT_EQ(cu[7], -7);  // nothing past the tensor
}

// `documents` short documents in one source, packed best_fit `lookahead` at a time (by
// default a feed cheap to open many times: the lm-ahead thread bounds' tests).
LmSpec SmallBestFit(TempDir& dir, size_t documents = 400, uint64_t lookahead = 4) {
  std::vector<uint32_t> lengths(documents);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = 1 + static_cast<uint32_t>(i * 37 % 60);
  dir.WriteFile("d.bin", DocumentFile(0, lengths));
  LmSpec lm;
  lm.sources.push_back({{dir.Join("d.bin")}, 1.0, "d.bin"});
  lm.eos_id = kEos;
  lm.pack = PackMode::kBestFit;
  lm.lookahead = lookahead;
  return lm;
}

// Each thread keeps the group of the row it read last (RowPieces' hint): rows of three packed
// feeds (two seeds of best_fit, and concat) read in turn on one thread, the same row numbers,
// are each feed's own, read alone on a thread of its own; so are those of a feed opened
// anew in place of a closed one.
TEST(LmDatasetTest, RowsOfFeedsReadInTurnOnOneThreadAreEachFeedsOwn) {
  TempDir dir;
  const LmSpec best_fit = SmallBestFit(dir);
  LmSpec concat = best_fit;
  concat.pack = PackMode::kConcat;
  concat.lookahead = 0;  // best_fit's only
  const std::vector<std::pair<const LmSpec*, uint64_t>> feeds = {
      {&best_fit, 2}, {&best_fit, 3}, {&concat, 2}};
  auto open = [&](size_t k) {
    return *LmDataset::Open(Tokens(dir.path(), 31), *feeds[k].first, feeds[k].second, true,
                            PosixFileSystem());
  };
  auto read = [](const LmDataset& d, uint64_t r) {
    return ReadRow(d, r % d.num_samples(), static_cast<int64_t>(r / d.num_samples()));
  };
  constexpr uint64_t kRows = 600;  // ~2 epochs, ~150 groups of best_fit
  std::vector<std::vector<Row>> alone(feeds.size());
  for (size_t k = 0; k < feeds.size(); ++k) {
    std::thread([&, k] {
      const std::unique_ptr<LmDataset> d = open(k);
      for (uint64_t r = 0; r < kRows; ++r) alone[k].push_back(read(*d, r));
    }).join();
  }
  ASSERT_NE(alone[0], alone[1]);
  std::vector<std::unique_ptr<LmDataset>> open_now;
  for (size_t k = 0; k < feeds.size(); ++k) open_now.push_back(open(k));
  for (uint64_t r = 0; r < kRows; ++r) {
    for (size_t k = 0; k < feeds.size(); ++k) {
      ASSERT_EQ(read(*open_now[k], r), alone[k][r]) << "feed " << k << " row " << r;
    }
  }
  ASSERT_EQ(read(*open_now[0], kRows - 1), alone[0][kRows - 1]);  // the hint: feed 0's group
  open_now[0].reset();
  open_now[0] = open(1);  // seed 3 where seed 2 was, read from the row this thread read last
  for (uint64_t r = kRows - 1; r < kRows; --r) {
    ASSERT_EQ(read(*open_now[0], r), alone[1][r]) << "row " << r;
  }
}

// The process's lm-ahead threads are bounded (a user's many packed feeds must not cost the
// node unbounded threads): past kMaxAheadThreads a feed gets no workers and its fill
// threads pack, giving the same rows; a closed feed's workers go back to the budget.
TEST(LmDatasetTest, AheadWorkersAreBoundedInTheProcessAndAFeedWithoutThemReadsTheSameRows) {
  TempDir dir;
  const LmSpec lm = SmallBestFit(dir);
  auto open = [&] {
    return *LmDataset::Open(Tokens(dir.path(), 31), lm, 2, true, PosixFileSystem());
  };
  const int before = LmDataset::AheadThreads();
  ASSERT_EQ(before, 0) << "another test left datasets open";
  std::vector<std::unique_ptr<LmDataset>> feeds;
  for (int i = 0; i < LmDataset::kMaxAheadThreads / LmDataset::kAheadWorkers; ++i) {
    feeds.push_back(open());
    ASSERT_EQ(feeds.back()->ahead_workers(), LmDataset::kAheadWorkers) << "feed " << i;
  }
  EXPECT_EQ(LmDataset::AheadThreads(), LmDataset::kMaxAheadThreads);
  std::unique_ptr<LmDataset> without = open();
  EXPECT_EQ(without->ahead_workers(), 0);
  EXPECT_EQ(LmDataset::AheadThreads(), LmDataset::kMaxAheadThreads);
  const uint64_t n = without->num_samples();
  for (uint64_t r = 0; r < 2 * n; ++r) {
    ASSERT_EQ(ReadRow(*without, r % n, r / n), ReadRow(*feeds[0], r % n, r / n)) << "row " << r;
  }
  EXPECT_EQ(without->ahead_workers(), 0);  // none to be had while it read
  feeds.pop_back();
  EXPECT_EQ(LmDataset::AheadThreads(), LmDataset::kMaxAheadThreads - LmDataset::kAheadWorkers);
  // One feed gone: the feed without workers takes its 4 as its rows find the workers behind
  // (a try at a new front while the process has some to spare), and reads the same rows on.
  for (uint64_t r = 2 * n; r < 4 * n; ++r) {
    ASSERT_EQ(ReadRow(*without, r % n, r / n), ReadRow(*feeds[0], r % n, r / n)) << "row " << r;
  }
  EXPECT_EQ(without->ahead_workers(), LmDataset::kAheadWorkers);
  EXPECT_EQ(LmDataset::AheadThreads(), LmDataset::kMaxAheadThreads);
  without.reset();
  EXPECT_EQ(open()->ahead_workers(), LmDataset::kAheadWorkers);
  feeds.clear();
  EXPECT_EQ(LmDataset::AheadThreads(), 0);
}

// One uid's feeds hold at most kMaxAheadThreadsPerUid of the workers, so that another uid's
// packed feed gets its own however many feeds one user opens (a feed past the share packs on
// its fill threads, the same rows, until one of its uid's feeds ends); an admin's feeds count
// in the process's bound only.
TEST(LmDatasetTest, OneUidsFeedsHoldAtMostItsShareOfTheAheadWorkers) {
  TempDir dir;
  const LmSpec lm = SmallBestFit(dir);
  auto open = [&](std::optional<uint32_t> uid) {
    DatasetSpec spec = Tokens(dir.path(), 31);
    spec.walk.charge_uid = uid;
    return *LmDataset::Open(spec, lm, 2, true, PosixFileSystem());
  };
  ASSERT_EQ(LmDataset::AheadThreads(), 0) << "another test left datasets open";
  std::vector<std::unique_ptr<LmDataset>> mine;
  for (int i = 0; i < LmDataset::kMaxAheadThreadsPerUid / LmDataset::kAheadWorkers; ++i) {
    mine.push_back(open(1001));
    ASSERT_EQ(mine.back()->ahead_workers(), LmDataset::kAheadWorkers) << "feed " << i;
  }
  EXPECT_EQ(LmDataset::AheadThreadsOf(1001), LmDataset::kMaxAheadThreadsPerUid);
  std::unique_ptr<LmDataset> past = open(1001);
  EXPECT_EQ(past->ahead_workers(), 0);
  const uint64_t n = past->num_samples();
  for (uint64_t r = 0; r < 2 * n; ++r) {
    ASSERT_EQ(ReadRow(*past, r % n, r / n), ReadRow(*mine[0], r % n, r / n)) << "row " << r;
  }
  // The process had workers to spare all along; the uid had none.
  EXPECT_EQ(past->ahead_workers(), 0);
  EXPECT_EQ(LmDataset::AheadThreads(), LmDataset::kMaxAheadThreadsPerUid);
  std::unique_ptr<LmDataset> other = open(1002);
  EXPECT_EQ(other->ahead_workers(), LmDataset::kAheadWorkers);
  EXPECT_EQ(LmDataset::AheadThreadsOf(1002), LmDataset::kAheadWorkers);
  std::unique_ptr<LmDataset> admin = open(std::nullopt);
  EXPECT_EQ(admin->ahead_workers(), LmDataset::kAheadWorkers);
  EXPECT_EQ(LmDataset::AheadThreadsOf(1001), LmDataset::kMaxAheadThreadsPerUid);
  EXPECT_EQ(LmDataset::AheadThreads(),
            LmDataset::kMaxAheadThreadsPerUid + 2 * LmDataset::kAheadWorkers);
  // One of the uid's feeds gone: the feed past its share takes the 4 at a new front.
  mine.pop_back();
  EXPECT_EQ(LmDataset::AheadThreadsOf(1001),
            LmDataset::kMaxAheadThreadsPerUid - LmDataset::kAheadWorkers);
  for (uint64_t r = 2 * n; r < 4 * n; ++r) {
    ASSERT_EQ(ReadRow(*past, r % n, r / n), ReadRow(*mine[0], r % n, r / n)) << "row " << r;
  }
  EXPECT_EQ(past->ahead_workers(), LmDataset::kAheadWorkers);
  EXPECT_EQ(LmDataset::AheadThreadsOf(1001), LmDataset::kMaxAheadThreadsPerUid);
  mine.clear();
  past.reset();
  other.reset();
  admin.reset();
  EXPECT_EQ(LmDataset::AheadThreads(), 0);
  EXPECT_EQ(LmDataset::AheadThreadsOf(1001), 0);
  EXPECT_EQ(LmDataset::AheadThreadsOf(1002), 0);
}

// The groups a best_fit feed holds at once are charged to max_index_bytes at their most for
// its documents (a review: bounded by count only, one user's feeds of long documents could
// hold gigabytes each, unaccounted): past the uid's share Open is refused naming them, and
// the charge goes back with the feed.
TEST(LmDatasetTest, APackedFeedsGroupsAreChargedToTheIndexBudgetAtTheirMost) {
  TempDir dir;
  dir.WriteFile("d.bin", DocumentFile(0, std::vector<uint32_t>(64, 1280)));  // 40 rows each
  LmSpec lm;
  lm.sources.push_back({{dir.Join("d.bin")}, 1.0, "d.bin"});
  lm.eos_id = kEos;
  auto open = [&](PackMode mode, uint64_t per_uid) {
    DatasetSpec spec = Tokens(dir.path(), 31);
    spec.walk.index_bytes = ByteBudget::Create("max_index_bytes", uint64_t{1} << 30,
                                               "max_index_bytes_per_uid", per_uid, "retry");
    spec.walk.charge_uid = 1001;
    lm.pack = mode;
    lm.lookahead = mode == PackMode::kBestFit ? 16 : 0;
    absl::StatusOr<std::unique_ptr<LmDataset>> d =
        LmDataset::Open(spec, lm, 2, true, PosixFileSystem());
    return std::make_pair(std::move(d), spec.walk.index_bytes);
  };
  // The document tables alone: concat keeps no groups.
  auto [concat, tables] = open(PackMode::kConcat, 64 << 20);
  ASSERT_TRUE(concat.ok()) << concat.status();
  // A group of 16 documents of 40 pieces each (16 + 16 x 39 = 640 pieces); 28 kept and 9 being
  // packed: 640 x (64 x 28 + 256 x 9) bytes of pieces and 16 x 48 x 37 of picks.
  auto [best_fit, budget] = open(PackMode::kBestFit, 64 << 20);
  ASSERT_TRUE(best_fit.ok()) << best_fit.status();
  EXPECT_EQ(budget->used_by(1001) - tables->used_by(1001), 640u * (64 * 28 + 256 * 9) + 16 * 48 * 37);
  best_fit->reset();
  EXPECT_EQ(budget->used_by(1001), 0u);
  auto [refused, small] = open(PackMode::kBestFit, 1 << 20);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("the packed groups kept at once (37 groups of 16 documents, up to 640 "
                        "pieces each: lower pack_lookahead or raise seq_len to need less)"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("max_index_bytes_per_uid"));
  EXPECT_EQ(small->used_by(1001), 0u);
}

// A budget of max_index_bytes whose uid share is 1 MiB, and a best_fit feed (SmallBestFit)
// charged to uid 1001's share of it.
std::shared_ptr<ByteBudget> MiBShare() {
  return ByteBudget::Create("max_index_bytes", uint64_t{1} << 30, "max_index_bytes_per_uid",
                            1 << 20, "retry");
}
absl::StatusOr<std::unique_ptr<LmDataset>> OpenCharged(TempDir& dir,
                                                       std::shared_ptr<ByteBudget> budget) {
  const LmSpec lm = SmallBestFit(dir);
  DatasetSpec spec = Tokens(dir.path(), 31);
  spec.walk.index_bytes = std::move(budget);
  spec.walk.charge_uid = 1001;
  return LmDataset::Open(spec, lm, 2, true, PosixFileSystem());
}

// An Attach far into a packed stream places every group before its start: their prefix
// tables (16 bytes a group, millions for a far start) are charged to max_index_bytes as they
// grow, and past the uid's share the Reach is refused naming them (a review: they grew
// unaccounted with each far Attach).
TEST(LmDatasetTest, AFarReachChargesThePlacedGroupsTablesToTheIndexBudget) {
  TempDir dir;
  const std::shared_ptr<ByteBudget> budget = MiBShare();
  absl::StatusOr<std::unique_ptr<LmDataset>> d = OpenCharged(dir, budget);
  ASSERT_TRUE(d.ok()) << d.status();
  const uint64_t opened = budget->used_by(1001);
  ASSERT_TRUE((*d)->Reach(10'000).ok());
  const uint64_t near = budget->used_by(1001);
  EXPECT_GT(near, opened);
  EXPECT_LE(near, opened + (64 << 10));  // ~2,500 groups: room for 4,096 in each table
  const absl::Status far = (*d)->Reach(uint64_t{1} << 24);
  EXPECT_EQ(far.code(), absl::StatusCode::kResourceExhausted) << far;
  EXPECT_THAT(std::string(far.message()), HasSubstr(" placed groups (reaching row 16777216 of "
                                                    "the packed stream) need "));
  EXPECT_THAT(std::string(far.message()), HasSubstr("max_index_bytes_per_uid 1048576"));
  EXPECT_LE(budget->used_by(1001), uint64_t{1} << 20);
  // The far Attach refused, the feed's sessions reading near the start read on: their rows'
  // groups are within the tables charged (a review: the tables grown past their charge
  // failed every row of the feed from then on).
  const uint64_t n = (*d)->num_samples();
  for (uint64_t r = 0; r < 10'000; r += 7) {
    absl::StatusOr<uint64_t> got = ReadRowStatus(**d, r % n, static_cast<int64_t>(r / n));
    ASSERT_TRUE(got.ok()) << "row " << r << ": " << got.status();
  }
  d->reset();
  EXPECT_EQ(budget->used_by(1001), 0u);
}

// The prefix tables grow by 16 bytes a group placed for as long as a feed is read, not only at
// a far Reach: a row that finds them grown charges them, so that one read for days (a hostile
// one, epochs a second over a small corpus: ~2 GB a day) ends RESOURCE_EXHAUSTED at its share
// instead of growing uncharged (a review: only Reach charged them).
TEST(LmDatasetTest, TablesGrownByReadingAreChargedToTheIndexBudget) {
  TempDir dir;
  const std::shared_ptr<ByteBudget> budget = MiBShare();
  absl::StatusOr<std::unique_ptr<LmDataset>> d = OpenCharged(dir, budget);
  ASSERT_TRUE(d.ok()) << d.status();
  // All but 32 KiB of the uid's share held elsewhere: room for ~2,000 groups' entries.
  const uint64_t opened = budget->used_by(1001);
  absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> rest =
      budget->Take(1001, (uint64_t{1} << 20) - opened - (32 << 10), "the rest");
  ASSERT_TRUE(rest.ok()) << rest.status();
  const uint64_t n = (*d)->num_samples();
  absl::Status failed;
  uint64_t r = 0;
  for (; r < 200'000 && failed.ok(); ++r) {
    failed = ReadRowStatus(**d, r % n, static_cast<int64_t>(r / n)).status();
  }
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed << " at row " << r;
  EXPECT_THAT(std::string(failed.message()), HasSubstr(" placed groups (reaching row "));
  EXPECT_THAT(std::string(failed.message()), HasSubstr("max_index_bytes_per_uid 1048576"));
  EXPECT_GT(r, 1000u);  // the 32 KiB held the first ~2,000 groups' entries
  EXPECT_LE(budget->used_by(1001), uint64_t{1} << 20);
  rest->reset();
  d->reset();
  EXPECT_EQ(budget->used_by(1001), 0u);
}

// An unpacked blend counts each chunk of picks once, in order, also where a reader ran more
// than kCachedChunks ahead of the count (sessions of a shared feed far apart): a chunk filled
// too far ahead to wait for the count but still cached is counted when the count reaches it
// (a review: it was never counted, read from the cache from then on, and the per-source
// tokens stopped there for good).
TEST(LmDatasetTest, AnUnpackedBlendCountsAChunkFilledFarAheadOfTheCount) {
  TempDir workers_dir;
  const LmSpec small = SmallBestFit(workers_dir);
  std::vector<std::unique_ptr<LmDataset>> holders;  // hold every ahead worker: none fills
  while (LmDataset::AheadThreads() < LmDataset::kMaxAheadThreads) {
    holders.push_back(*LmDataset::Open(Tokens(workers_dir.path(), 31), small, 1, true,
                                       PosixFileSystem()));
  }
  TempDir dir;
  const int64_t seq_len = 7;
  LmSpec lm;
  const uint64_t windows[] = {45000, 27000, 18000};
  for (int k = 0; k < 3; ++k) {
    const std::string name = absl::StrCat("w", k, ".bin");
    dir.WriteFile(name, WindowFile(k, windows[k] * (seq_len + 1) + 1));
    lm.sources.push_back({{dir.Join(name)}, 1.0 + k, name});
  }
  const std::unique_ptr<LmDataset> d =
      *LmDataset::Open(Tokens(dir.path(), seq_len), lm, 5, true, PosixFileSystem());
  ASSERT_EQ(d->ahead_workers(), 0);
  const uint64_t n = d->num_samples();
  auto read_chunk = [&](uint64_t c) {
    const uint64_t r = c * 65536;
    ReadRow(*d, r % n, static_cast<int64_t>(r / n));
  };
  auto counted = [&] {
    const LmDataset::Stats st = d->stats();
    return (st.source_tokens[0] + st.source_tokens[1] + st.source_tokens[2]) /
           (65536 * uint64_t{seq_len + 1});
  };
  read_chunk(5);  // the count starts here: 5 counted
  EXPECT_EQ(counted(), 1u);
  for (uint64_t c = 10; c <= 15; ++c) read_chunk(c);  // 10-14 wait for 6-9; 15 is too far
  EXPECT_EQ(counted(), 1u);
  for (uint64_t c = 6; c <= 9; ++c) read_chunk(c);  // 6-14 counted, and 15 from the cache
  EXPECT_EQ(counted(), 11u);
  read_chunk(15);
  read_chunk(16);
  EXPECT_EQ(counted(), 12u);
}

// However many readers need groups that are not kept (sessions of one feed far apart), at
// most kGroupsPacking groups are packed at once, the memory Open charged for (a review: each
// fill thread packed its own, as many groups as fill threads); the others wait for a turn,
// and every row is the one a lone reader gets.
TEST(LmDatasetTest, GroupsPackedAtOnceAreBoundedWhateverTheReaders) {
  TempDir dir;
  // ~15,000 rows a group, milliseconds to pack.
  const LmSpec lm = SmallBestFit(dir, 40000, kMaxPackLookahead);
  auto open = [&] { return *LmDataset::Open(Tokens(dir.path(), 31), lm, 2, true, PosixFileSystem()); };
  const std::unique_ptr<LmDataset> lone = open();
  const std::unique_ptr<LmDataset> d = open();
  const uint64_t n = d->num_samples();
  constexpr int kReaders = 32;
  constexpr uint64_t kApart = 16'000;  // each reader in a group of its own
  ASSERT_TRUE(d->Reach(kReaders * kApart).ok());  // ~34 groups placed, the last 20 kept
  std::vector<Row> got(kReaders);
  std::atomic<int> ready{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < kReaders; ++i) {
    readers.emplace_back([&, i] {
      ++ready;
      while (ready.load() < kReaders) std::this_thread::yield();
      const uint64_t r = static_cast<uint64_t>(i) * kApart;  // the early groups: evicted
      got[i] = ReadRow(*d, r % n, static_cast<int64_t>(r / n));
    });
  }
  for (std::thread& t : readers) t.join();
  for (int i = 0; i < kReaders; ++i) {
    const uint64_t r = static_cast<uint64_t>(i) * kApart;
    ASSERT_EQ(got[i], ReadRow(*lone, r % n, static_cast<int64_t>(r / n))) << "reader " << i;
  }
  const LmDataset::Stats st = d->stats();
  EXPECT_GE(st.groups_again, 10u);
  EXPECT_LE(st.packing_peak, 9u);
}

// Weights changed at a resume: the rows before it are the old run's, the new weights start at
// the first pick those rows left untouched, each source carrying on from its ledger.
TEST(LmDatasetTest, AResumeWithOtherWeightsKeepsTheRowsBeforeIt) {
  TempDir dir;
  std::mt19937_64 rng(5);
  LmSpec lm;
  uint64_t totals[2] = {0, 0};
  for (int k = 0; k < 2; ++k) {
    std::vector<uint32_t> lengths(300);
    for (uint32_t& n : lengths) {
      n = 1 + static_cast<uint32_t>(rng() % 90);
      totals[k] += n;
    }
    const std::string name = absl::StrCat("d", k, ".bin");
    dir.WriteFile(name, DocumentFile(k, lengths));
    lm.sources.push_back({{dir.Join(name)}, k == 0 ? 0.7 : 0.3, name});
  }
  lm.eos_id = kEos;
  for (const PackMode mode : {PackMode::kNone, PackMode::kBestFit, PackMode::kConcat}) {
    SCOPED_TRACE(PackModeName(mode));
    lm.pack = mode;
    lm.eos_id = mode == PackMode::kNone ? std::nullopt : std::optional<int64_t>(kEos);
    lm.lookahead = mode == PackMode::kBestFit ? 32 : 0;
    lm.history.clear();
    std::unique_ptr<LmDataset> old =
        *LmDataset::Open(Tokens(dir.path(), 31), lm, 9, true, PosixFileSystem());
    LmSpec resumed = lm;
    resumed.history = old->segments();
    resumed.sources[0].weight = 0.2;
    resumed.sources[1].weight = 0.8;
    ASSERT_TRUE(resumed.changes_weights());
    for (const uint64_t at : {uint64_t{0}, uint64_t{37}, uint64_t{150}}) {
      resumed.change_epoch = 0;
      resumed.change_samples = at;
      absl::StatusOr<std::unique_ptr<LmDataset>> now =
          LmDataset::Open(Tokens(dir.path(), 31), resumed, 9, true, PosixFileSystem());
      ASSERT_TRUE(now.ok()) << now.status();
      const std::vector<BlendSegment>& segments = (*now)->segments();
      ASSERT_EQ(segments.size(), at == 0 ? 1u : 2u) << "resume at " << at;
      EXPECT_EQ(segments.back().weights, (std::vector<double>{0.2, 0.8}));
      if (mode == PackMode::kNone) {
        EXPECT_EQ(segments.back().start, at);
      }
      if (mode == PackMode::kBestFit) {
        EXPECT_EQ(segments.back().start % 32, 0u);
      }
      for (uint64_t row = 0; row < at; ++row) {
        const Row a = ReadRow(*old, row), b = ReadRow(**now, row);
        ASSERT_EQ(a.tokens, b.tokens) << "row " << row << " of a resume at " << at;
        ASSERT_EQ(a.id, b.id);
      }
      if (mode == PackMode::kNone) {
        // The old run's rows before the resume, then the new run's: each source's windows
        // (the union ids say which) once per own epoch, none repeated, none skipped.
        const uint64_t n = (*now)->num_samples();
        const uint64_t offset1 = (totals[0] - 1) / 31;
        std::vector<std::vector<uint64_t>> per(2);
        for (uint64_t row = 0; row < 3 * n; ++row) {
          const LmDataset& from = row < at ? *old : **now;
          const Row r = ReadRow(from, row % n, static_cast<int64_t>(row / n));
          if (r.id < offset1) {
            per[0].push_back(r.id);
          } else {
            per[1].push_back(r.id - offset1);
          }
        }
        for (int k = 0; k < 2; ++k) {
          const uint64_t windows = (totals[k] - 1) / 31;
          for (size_t start = 0; start < per[k].size(); start += windows) {
            std::vector<uint64_t> epoch(per[k].begin() + start,
                                        per[k].begin() + std::min(per[k].size(), start + windows));
            std::sort(epoch.begin(), epoch.end());
            EXPECT_EQ(std::adjacent_find(epoch.begin(), epoch.end()), epoch.end())
                << "source " << k << " repeats a window in own epoch " << start / windows
                << " (a resume at " << at << ")";
            if (epoch.size() == windows) {
              EXPECT_EQ(epoch.back(), windows - 1);
              EXPECT_EQ(epoch.front(), 0u);
            }
          }
        }
      }
    }
  }
  // A resume that lost its history shows in the fingerprint's first weights.
  LmSpec forgot = lm;
  forgot.sources[0].weight = 0.2;
  forgot.sources[1].weight = 0.8;
  const std::string before =
      (*LmDataset::Open(Tokens(dir.path(), 31), lm, 9, true, PosixFileSystem()))->Identity();
  const std::string after =
      (*LmDataset::Open(Tokens(dir.path(), 31), forgot, 9, true, PosixFileSystem()))->Identity();
  EXPECT_NE(before, after);
}

TEST(LmDatasetTest, RefusesWhatCannotBeServedNamingTheField) {
  TempDir dir;
  dir.WriteFile("a.bin", WindowFile(0, 100));
  LmSpec lm;
  lm.sources.push_back({{dir.Join("a.bin")}, 0.5, "a"});
  lm.sources.push_back({{}, 0.5, "/data/none/*.bin"});
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.sources[1].paths: empty (/data/none/*.bin names no file)"));
  lm.sources[1] = {{dir.Join("a.bin")}, -1, "b"};
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.sources[1].weight: must be finite and > 0, got -1 (b)"));
  lm.sources[1].weight = 1;
  DatasetSpec images = Tokens(dir.path(), 7);
  images.kind = DatasetKind::kImageFolder;
  EXPECT_THAT(lm.Validate(images).message(),
              HasSubstr("for kind tokens only"));
  lm.eos_id = 3;
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.eos_id: documents are for packing"));
  lm.pack = PackMode::kConcat;
  lm.lookahead = 8;
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.pack_lookahead: only for pack best_fit"));
  lm.pack = PackMode::kBestFit;
  lm.lookahead = kMaxPackLookahead + 1;  // a group's packing is bounded
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.pack_lookahead: at most 16384 documents, got 16385"));
  lm.lookahead = kMaxPackLookahead;
  EXPECT_TRUE(lm.Validate(Tokens(dir.path(), 7)).ok());
  lm.pack = PackMode::kConcat;
  lm.lookahead = 0;
  lm.history.push_back({0, {1.0}, {0}});
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.blend_history[0]: 1 weights and 1 ledger counts for 2 sources"));

  lm.history.clear();
  lm.history.assign(kMaxBlendHistory + 1, BlendSegment{0, {1.0, 1.0}, {0, 0}});
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("dataset.blend_history: 1025 segments, more than 1024"));
  lm.history.clear();
  DatasetSpec listed = Tokens(dir.path(), 7);
  listed.paths = {dir.Join("a.bin")};
  EXPECT_THAT(lm.Validate(listed).message(),
              HasSubstr("dataset.paths: must be empty with sources"));
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), int64_t{1} << 31)).message(),
              HasSubstr("dataset.seq_len: at most 2^30 for a packed feed"));
  lm.sources[0].weight = 1e308;
  lm.sources[1].weight = 1e308;
  EXPECT_THAT(lm.Validate(Tokens(dir.path(), 7)).message(),
              HasSubstr("the weights' sum is not finite"));

  // A document of more rows than a group's pieces allow, at a wide lookahead.
  TempDir long_docs;
  long_docs.WriteFile("one.bin", DocumentFile(0, {3000}));
  LmSpec wide_look;
  wide_look.pack = PackMode::kBestFit;
  wide_look.eos_id = kEos;
  wide_look.lookahead = 1 << 14;
  absl::StatusOr<std::unique_ptr<LmDataset>> pieces = LmDataset::Open(
      Tokens(long_docs.Join("one.bin"), 1), wide_look, 1, true, PosixFileSystem());
  ASSERT_FALSE(pieces.ok());
  EXPECT_THAT(pieces.status().message(),
              HasSubstr("dataset.pack_lookahead: 16384 documents of up to 1500 rows each"));

  // A resume far down the stream with other weights packs up to it within the attach-time
  // scan's limits: past them, DEADLINE_EXCEEDED, not a daemon busy for hours.
  TempDir far;
  far.WriteFile("d.bin", DocumentFile(0, std::vector<uint32_t>(2000, 20)));
  LmSpec resumed;
  resumed.pack = PackMode::kBestFit;
  resumed.eos_id = kEos;
  resumed.history = {{0, {2.0}, {0}}};
  resumed.change_epoch = int64_t{1} << 30;
  resumed.change_samples = 0;
  DatasetSpec slow = Tokens(far.Join("d.bin"), 63);
  slow.walk.timeout = absl::Milliseconds(50);
  absl::StatusOr<std::unique_ptr<LmDataset>> stuck =
      LmDataset::Open(slow, resumed, 1, true, PosixFileSystem());
  ASSERT_FALSE(stuck.ok());
  EXPECT_EQ(stuck.status().code(), absl::StatusCode::kDeadlineExceeded) << stuck.status();

  // An eos_id no uint16 token can be.
  TempDir two;
  std::vector<uint16_t> small(100, 7);
  two.WriteFile("b.bin", std::string(reinterpret_cast<const char*>(small.data()), 200));
  DatasetSpec spec = Tokens(two.Join("b.bin"), 7);
  spec.token_dtype = DType::kUInt16;
  LmSpec packed;
  packed.pack = PackMode::kBestFit;
  packed.eos_id = 70000;
  absl::StatusOr<std::unique_ptr<LmDataset>> wide =
      LmDataset::Open(spec, packed, 1, true, PosixFileSystem());
  ASSERT_FALSE(wide.ok());
  EXPECT_THAT(wide.status().message(), HasSubstr("dataset.eos_id: 70000 is no uint16 token"));
}

}  // namespace
}  // namespace gpufeed::server
