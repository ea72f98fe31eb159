// Token datasets in shards (issue 16): a directory or a glob of raw, .npy, llm.c and
// Megatron files; windows within each shard, samples in shard (name) order; checked headers.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/pipeline/dataset.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::NpyFile;
using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;

// Tokens [first, first + count) of one running sequence, little-endian of `width` bytes: each
// shard holds another stretch, so a row read from the wrong shard or offset shows.
std::vector<uint32_t> Stretch(uint32_t first, uint32_t count) {
  std::vector<uint32_t> v(count);
  for (uint32_t i = 0; i < count; ++i) v[i] = (first + i) * 7 + 3;
  return v;
}
std::string Bytes(const std::vector<uint32_t>& tokens, int width) {
  std::string out;
  for (uint32_t t : tokens) {
    for (int b = 0; b < width; ++b) out += static_cast<char>((t >> (8 * b)) & 0xff);
  }
  return out;
}
std::string Le32(uint32_t v) { return Bytes({v}, 4); }
std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

// llm.c's shard: 256 int32 of header (magic, version, token count, zeros), then the tokens.
std::string Llmc(const std::vector<uint32_t>& tokens, uint32_t version, int64_t count = -1) {
  std::string header = Le32(20240520) + Le32(version) +
                       Le32(static_cast<uint32_t>(count < 0 ? tokens.size() : count));
  header.resize(1024, '\0');
  return header + Bytes(tokens, version == 1 ? 2 : 4);
}

// Megatron-LM's indexed dataset, written from the published layout (megatron/core/datasets/
// indexed_dataset.py): .idx = "MMIDIDX\0\0", version 1 (u64), dtype code (u8), sequence
// count (u64), document count (u64), sizes (i32), pointers (i64, byte offsets into the
// .bin), document index (i64, sequence indices where documents start, ending with the count).
std::string MegatronIdx(const std::vector<int32_t>& sizes, uint8_t code, int width) {
  std::string idx("MMIDIDX\0\0", 9);
  idx += Le64(1);
  idx += static_cast<char>(code);
  idx += Le64(sizes.size());
  idx += Le64(2);  // documents: [0, n]
  for (int32_t s : sizes) idx += Le32(static_cast<uint32_t>(s));
  int64_t at = 0;
  for (int32_t s : sizes) {
    idx += Le64(static_cast<uint64_t>(at));
    at += s * width;
  }
  idx += Le64(0);
  idx += Le64(sizes.size());
  return idx;
}

DatasetSpec Tokens(const std::string& path, int64_t seq_len, DType dtype = DType::kUnspecified) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kTokens;
  spec.path = path;
  spec.seq_len = seq_len;
  spec.token_dtype = dtype;
  return spec;
}

std::vector<uint32_t> Row(const Dataset& ds, uint64_t id) {
  const SampleTensor& t = ds.tensors().at(0);
  std::string row(t.byte_size, '\xEE');
  const std::span<std::byte> rows[] = {
      std::span<std::byte>(reinterpret_cast<std::byte*>(row.data()), row.size())};
  EXPECT_TRUE(ds.ReadSample(id, rows).ok());
  const int width = t.dtype == DType::kUInt16 ? 2 : 4;
  std::vector<uint32_t> out(row.size() / width);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t v = 0;
    std::memcpy(&v, row.data() + i * width, width);
    out[i] = v;
  }
  return out;
}

// Every sample of `ds` equals the window of `shards` (in order) it should be.
void ExpectWindows(const Dataset& ds, const std::vector<std::vector<uint32_t>>& shards,
                   int64_t seq_len) {
  uint64_t id = 0;
  for (size_t k = 0; k < shards.size(); ++k) {
    const uint64_t windows =
        shards[k].size() > static_cast<size_t>(seq_len) ? (shards[k].size() - 1) / seq_len : 0;
    for (uint64_t w = 0; w < windows; ++w, ++id) {
      const std::vector<uint32_t> want(shards[k].begin() + w * seq_len,
                                       shards[k].begin() + w * seq_len + seq_len + 1);
      ASSERT_EQ(Row(ds, id), want) << "sample " << id << " (shard " << k << " window " << w << ")";
    }
  }
  EXPECT_EQ(ds.num_samples(), id);
}

TEST(TokenShardsTest, ADirectoryOfRawNpyAndLlmcShardsInNameOrder) {
  TempDir dir;
  // Names out of creation order; a hidden file, a subdirectory and an .idx without its .bin
  // are not shards.
  const std::vector<uint32_t> a = Stretch(0, 23), b = Stretch(1000, 9), c = Stretch(5000, 17),
                              d = Stretch(9, 3);
  dir.WriteFile("c_llmc.bin", Llmc(c, 1));
  dir.WriteFile("a_raw.bin", Bytes(a, 2));
  dir.WriteFile("b.npy", NpyFile("<u2", "(9,)", Bytes(b, 2)));
  dir.WriteFile("d_short.bin", Bytes(d, 2));  // 3 tokens: no window of 4 + 1
  dir.WriteFile(".hidden", "junk");
  dir.WriteFile("zz.idx", "not a shard");
  ASSERT_EQ(::mkdir(dir.Join("sub").c_str(), 0755), 0);
  auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kUInt16);
  // Windows: a 22/4 = 5, b 8/4 = 2, c 16/4 = 4, d 0.
  EXPECT_EQ((*ds)->num_samples(), 11u);
  ExpectWindows(**ds, {a, b, c, d}, 4);
  EXPECT_THAT((*ds)->ContentIdentity(), HasSubstr("4 files, fnv1a64 "));
}

TEST(TokenShardsTest, AGlobTakesTheMatchingFilesOnly) {
  TempDir dir;
  const std::vector<uint32_t> x = Stretch(0, 41), y = Stretch(300, 21), z = Stretch(700, 30);
  dir.WriteFile("train_001.bin", Llmc(y, 2));
  dir.WriteFile("train_000.bin", Llmc(x, 2));
  dir.WriteFile("val_000.bin", Llmc(z, 2));
  auto ds = OpenDataset(Tokens(dir.Join("train_*.bin"), 10), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kUInt32);  // llm.c version 2
  EXPECT_EQ((*ds)->num_samples(), 4u + 2u);
  ExpectWindows(**ds, {x, y}, 10);
  // A file literally named with glob characters is that file, not a pattern.
  dir.WriteFile("odd[1].bin", Bytes(Stretch(0, 11), 2));
  auto odd = OpenDataset(Tokens(dir.Join("odd[1].bin"), 10), PosixFileSystem());
  ASSERT_TRUE(odd.ok()) << odd.status();
  EXPECT_EQ((*odd)->num_samples(), 1u);
}

TEST(TokenShardsTest, MegatronBinWithItsIdxReadsBackEqual) {
  TempDir dir;
  // Three documents of 7, 12 and 5 tokens, uint16 (code 8), one .bin.
  const std::vector<uint32_t> tokens = Stretch(42, 24);
  dir.WriteFile("corpus_text_document.bin", Bytes(tokens, 2));
  dir.WriteFile("corpus_text_document.idx", MegatronIdx({7, 12, 5}, 8, 2));
  auto ds = OpenDataset(Tokens(dir.path(), 5), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 4u);  // (24 - 1) / 5, windows across document boundaries
  ExpectWindows(**ds, {tokens}, 5);
  // int32 tokens (code 4) are read as uint32.
  TempDir wide;
  wide.WriteFile("w.bin", Bytes(tokens, 4));
  wide.WriteFile("w.idx", MegatronIdx({24}, 4, 4));
  auto w = OpenDataset(Tokens(wide.path(), 5), PosixFileSystem());
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->tensors()[0].dtype, DType::kUInt32);
  ExpectWindows(**w, {tokens}, 5);
}

TEST(TokenShardsTest, BadShardsAreRefusedNamingTheShard) {
  struct Case {
    std::string name, bytes, companion, message;
  } cases[] = {
      {"x.bin", Llmc(Stretch(0, 10), 1, 12), "",
       "x.bin: its llm.c header counts 12 tokens (1048 bytes with the header), the file holds "
       "1044 bytes"},
      {"x.bin", Llmc(Stretch(0, 10), 3), "", "x.bin: llm.c shard version 3"},
      {"x.bin", Bytes(Stretch(0, 10), 2), MegatronIdx({10}, 5, 8), "Megatron dtype code 5"},
      {"x.bin", Bytes(Stretch(0, 10), 2), MegatronIdx({11}, 8, 2),
       "x.bin holds 20 bytes, but its .idx counts 11 uint16 tokens"},
      {"x.npy", NpyFile("<f4", "(10,)", Bytes(Stretch(0, 10), 4)), "",
       "x.npy is a .npy array of float32; tokens must be uint16 or uint32"},
  };
  for (const Case& c : cases) {
    TempDir dir;
    dir.WriteFile("a_good.bin", Bytes(Stretch(0, 20), 2));
    dir.WriteFile(c.name, c.bytes);
    if (!c.companion.empty()) dir.WriteFile("x.idx", c.companion);
    auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << c.message;
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(ds.status().message(), HasSubstr(c.message)) << ds.status();
    EXPECT_THAT(ds.status().message(), HasSubstr(dir.path())) << ds.status();
  }
  // Two token types in one set, named both.
  TempDir mixed;
  mixed.WriteFile("a.npy", NpyFile("<u2", "(20,)", Bytes(Stretch(0, 20), 2)));
  mixed.WriteFile("b.bin", Llmc(Stretch(0, 20), 2));
  auto ds = OpenDataset(Tokens(mixed.path(), 4), PosixFileSystem());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      ds.status().message(),
      HasSubstr(mixed.Join("a.npy") + " holds uint16 tokens (npy) but " + mixed.Join("b.bin") +
                " holds uint32 (llm.c): every shard must hold one token type"));
  // A declared token_dtype the header contradicts.
  TempDir declared;
  declared.WriteFile("a.bin", Llmc(Stretch(0, 20), 1));
  ds = OpenDataset(Tokens(declared.path(), 4, DType::kUInt32), PosixFileSystem());
  EXPECT_THAT(ds.status().message(),
              HasSubstr("dataset.token_dtype: uint32, but " + declared.Join("a.bin") +
                        " is an llm.c shard of uint16"));
  // Nothing to read.
  TempDir empty;
  ds = OpenDataset(Tokens(empty.Join("train_*.bin"), 4), PosixFileSystem());
  EXPECT_THAT(ds.status().message(), HasSubstr("no token files match the pattern"));
  empty.WriteFile("tiny.bin", Bytes(Stretch(0, 3), 2));
  ds = OpenDataset(Tokens(empty.path(), 4), PosixFileSystem());
  EXPECT_THAT(ds.status().message(),
              HasSubstr("dataset.seq_len: 4 needs at least 5 tokens in one shard, but " +
                        empty.path() + " holds 3 in 1 shards"));
}

TEST(TokenShardsTest, AShardThatShrinksIsDataLossNamingIt) {
  TempDir dir;
  dir.WriteFile("a.bin", Bytes(Stretch(0, 40), 2));
  const std::string b = dir.WriteFile("b.bin", Bytes(Stretch(100, 40), 2));
  // The daemon's default reads (mmap) notice a file that shrank since it was opened.
  auto ds = OpenDataset(Tokens(dir.path(), 4), MappedFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE((*ds)->CheckNotShrunk().ok());
  ASSERT_EQ(::truncate(b.c_str(), 10), 0);
  const absl::Status s = (*ds)->CheckNotShrunk();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr(b));
  // A batch checks the shards it read: a's windows are samples 0..8, b's 9..17.
  const std::vector<int64_t> from_a = {0, 3, 8}, from_both = {2, 15};
  EXPECT_TRUE((*ds)->CheckReadNotShrunk(from_a).ok());
  const absl::Status both = (*ds)->CheckReadNotShrunk(from_both);
  EXPECT_EQ(both.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(both.message(), HasSubstr(b));
}

TEST(TokenShardsTest, TheContentIdentityChangesWithTheSetOrderAndSizes) {
  TempDir dir;
  dir.WriteFile("a.bin", Bytes(Stretch(0, 40), 2));
  dir.WriteFile("b.bin", Bytes(Stretch(100, 40), 2));
  auto identity = [&] {
    auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
    EXPECT_TRUE(ds.ok()) << ds.status();
    return ds.ok() ? (*ds)->ContentIdentity() : std::string();
  };
  const std::string first = identity();
  EXPECT_EQ(identity(), first);
  ASSERT_EQ(::rename(dir.Join("b.bin").c_str(), dir.Join("0.bin").c_str()), 0);  // reordered
  const std::string reordered = identity();
  EXPECT_NE(reordered, first);
  dir.WriteFile("0.bin", Bytes(Stretch(100, 42), 2));  // resized
  EXPECT_NE(identity(), reordered);
  // One file, not a set: the path and its size say it all.
  auto one = OpenDataset(Tokens(dir.Join("a.bin"), 4), PosixFileSystem());
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)->ContentIdentity(), "");
}

}  // namespace
}  // namespace gpufeed::server
