// Token datasets in shards: a directory or a glob of raw, .npy, llm.c and
// Megatron files; windows within each shard, samples in shard (name) order; checked headers.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/shard_list.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/images/dataset.h"
#include "server/reader/shards.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::NpyFile;
using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

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

// llm.c's shard as dev/data/data_common.py's write_datafile writes it: 256 int32 of header
// (magic, version, token count, zeros), then the tokens: "gpt-2" magic 20240520 version 1
// uint16, "llama-3" magic 20240801 version 7 uint32 (version 2 of 20240520: uint32 too).
std::string Llmc(const std::vector<uint32_t>& tokens, uint32_t version, int64_t count = -1) {
  std::string header = Le32(version == 7 ? 20240801 : 20240520) + Le32(version) +
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
      {"x.bin", Llmc(Stretch(0, 10), 3), "", "x.bin: llm.c shard of magic 20240520 version 3"},
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

// ---- Raw only when raw ----------------------------------------------------------------------

TEST(TokenFormatsTest, LlmcVersion7LlamaShardsAreReadAsUint32) {
  TempDir dir;
  // Llama 3 ids past 65535, so a uint16 reading or the header served as tokens shows.
  std::vector<uint32_t> a = Stretch(128000, 30), b = Stretch(70000, 21);
  dir.WriteFile("fineweb_train_000001.bin", Llmc(a, 7));
  dir.WriteFile("fineweb_train_000002.bin", Llmc(b, 7));
  auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kUInt32);
  EXPECT_EQ((*ds)->num_samples(), 7u + 5u);
  ExpectWindows(**ds, {a, b}, 4);
  // One file too.
  auto one = OpenDataset(Tokens(dir.Join("fineweb_train_000001.bin"), 4), PosixFileSystem());
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->tensors()[0].dtype, DType::kUInt32);
  ExpectWindows(**one, {a}, 4);
  // Checked as versions 1 and 2 are: the count against the size, the declared type, the mix.
  struct Case {
    std::string bytes, message;
    DType declared = DType::kUnspecified;
  } cases[] = {
      {Llmc(Stretch(0, 10), 7, 11),
       ": its llm.c header counts 11 tokens (1068 bytes with the "
       "header), the file holds 1064 bytes"},
      {Llmc(Stretch(0, 10), 7), "dataset.token_dtype: uint16, but ", DType::kUInt16},
      {Le32(20240801) + Le32(8) + Le32(0) + std::string(1012, '\0'),
       ": llm.c shard of magic 20240801 version 8; read are magic 20240520 version 1 (uint16 "
       "tokens, GPT-2) or 2 (uint32), and magic 20240801 version 7 (uint32 tokens, Llama 3)"},
      {Le32(20240801) + Le32(7) + Le32(3) + std::string(20, '\0'),
       " starts with llm.c's magic 20240801 but holds 32 bytes, less than llm.c's 1024-byte "
       "header"},
      {Le32(20240522) + Le32(1) + Le32(10) + std::string(2000, '\0'),
       " is an llm.c evaluation file (magic 20240522"},
  };
  for (const Case& c : cases) {
    TempDir one_dir;
    const std::string path = one_dir.WriteFile("x.bin", c.bytes);
    auto refused = OpenDataset(Tokens(path, 4, c.declared), PosixFileSystem());
    ASSERT_FALSE(refused.ok()) << c.message;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr(c.message));
    EXPECT_THAT(refused.status().message(), HasSubstr(path));
  }
  TempDir mixed;
  mixed.WriteFile("a.bin", Llmc(Stretch(0, 20), 1));
  mixed.WriteFile("b.bin", Llmc(Stretch(0, 20), 7));
  auto refused = OpenDataset(Tokens(mixed.path(), 4), PosixFileSystem());
  EXPECT_THAT(refused.status().message(),
              HasSubstr(mixed.Join("a.bin") + " holds uint16 tokens (llm.c) but " +
                        mixed.Join("b.bin") + " holds uint32 (llm.c)"));
}

void WriteAt(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
  ASSERT_TRUE(out.good()) << path;
}

// The directory a client opened, as the client library passes it for a path beneath it.
struct PassedDir {
  explicit PassedDir(const std::string& path)
      : fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)) {}
  ~PassedDir() { ::close(fd); }
  int fd;
};

TEST(TokenFormatsTest, AMegatronBinIsReadWithItsIdxHoweverThePathNamesIt) {
  TempDir dir;
  // int32 tokens (code 4) past 65535: read as uint16 pairs, each would show as two ids.
  const std::vector<uint32_t> tokens = Stretch(100000, 29), other = Stretch(7, 17);
  dir.WriteFile("corpus_text_document.bin", Bytes(tokens, 4));
  dir.WriteFile("corpus_text_document.idx", MegatronIdx({10, 12, 7}, 4, 4));
  const auto read = [&](DatasetSpec spec) -> std::vector<std::vector<uint32_t>> {
    auto ds = OpenDataset(spec, PosixFileSystem());
    EXPECT_TRUE(ds.ok()) << spec.path << ": " << ds.status();
    if (!ds.ok()) return {};
    EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kUInt32) << spec.path;
    std::vector<std::vector<uint32_t>> rows;
    for (uint64_t i = 0; i < (*ds)->num_samples(); ++i) rows.push_back(Row(**ds, i));
    EXPECT_THAT((*ds)->notices(), IsEmpty());
    return rows;
  };
  const auto directory = read(Tokens(dir.path(), 4));
  ASSERT_EQ(directory.size(), 7u);  // (29 - 1) / 4
  {
    auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
    ASSERT_TRUE(ds.ok());
    ExpectWindows(**ds, {tokens}, 4);
  }
  // A glob (the .idx is found among all the directory's names, not only the matching ones),
  // the .bin named alone by an admin's path, and the client's form of that: the directory
  // passed, the path naming the .bin in it.
  EXPECT_EQ(read(Tokens(dir.Join("*.bin"), 4)), directory);
  EXPECT_EQ(read(Tokens(dir.Join("corpus_*_document.bin"), 4)), directory);
  EXPECT_EQ(read(Tokens(dir.Join("corpus_text_document.bin"), 4)), directory);
  PassedDir passed(dir.path());
  DatasetSpec by_client = Tokens(dir.Join("corpus_text_document.bin"), 4);
  by_client.fd = passed.fd;
  EXPECT_EQ(read(by_client), directory);
  // A second pair and a raw file beside it: the one .bin named is read alone with its .idx.
  dir.WriteFile("other.bin", Bytes(other, 4));
  dir.WriteFile("other.idx", MegatronIdx({17}, 4, 4));
  dir.WriteFile("raw.bin", Bytes(Stretch(0, 40), 2));
  EXPECT_EQ(read(Tokens(dir.Join("corpus_text_document.bin"), 4)), directory);
  EXPECT_EQ(read(by_client), directory);
  // The single .bin's set is its own (name, size, mtime) in the fingerprint, as a shard's.
  auto single = OpenDataset(Tokens(dir.Join("corpus_text_document.bin"), 4), PosixFileSystem());
  ASSERT_TRUE(single.ok());
  EXPECT_THAT((*single)->ContentIdentity(), HasSubstr("1 files, fnv1a64 "));
  // A .bin with no .idx named alone is one raw file, exactly as before (no shard set).
  auto raw = OpenDataset(Tokens(dir.Join("raw.bin"), 4), PosixFileSystem());
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ((*raw)->ContentIdentity(), "");
  ExpectWindows(**raw, {Stretch(0, 40)}, 4);
  // The client passed the directory for a name that is not in it: no such file, not the
  // directory's every file.
  DatasetSpec missing = Tokens(dir.Join("gone.bin"), 4);
  missing.fd = passed.fd;
  auto gone = OpenDataset(missing, PosixFileSystem());
  EXPECT_FALSE(gone.ok());
  // A directory passed whose own name ends with .bin is that directory (read whole).
  TempDir outer;
  const std::string named = outer.Join("set.bin");
  ASSERT_EQ(::mkdir(named.c_str(), 0755), 0);
  WriteAt(named + "/a.bin", Bytes(Stretch(0, 9), 2));
  WriteAt(named + "/b.bin", Bytes(Stretch(50, 9), 2));
  PassedDir set(named);
  DatasetSpec whole = Tokens(named, 4);
  whole.fd = set.fd;
  auto ds = OpenDataset(whole, PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 4u);
}

TEST(TokenFormatsTest, AMegatronIndexIsNeverServedAsTokens) {
  TempDir dir;
  dir.WriteFile("doc.bin", Bytes(Stretch(0, 30), 2));
  const std::string idx = dir.WriteFile("doc.idx", MegatronIdx({30}, 8, 2));
  // Named directly, or selected by a glob without its .bin.
  for (const std::string& path : {idx, dir.Join("*.idx")}) {
    auto ds = OpenDataset(Tokens(path, 4), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << path;
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ds.status().message(),
                HasSubstr("dataset.path: " + idx +
                          " is a Megatron-LM index (.idx, magic MMIDIDX), not token ids; name its "
                          ".bin (" +
                          dir.Join("doc.bin") + ") or their directory"));
  }
  // An .idx beside a .bin that is not Megatron's: named, whatever form the path takes.
  TempDir wrong;
  wrong.WriteFile("doc.bin", Bytes(Stretch(0, 30), 2));
  wrong.WriteFile("doc.idx", "# an index of another tool\n");
  for (const std::string& path : {wrong.path(), wrong.Join("*.bin"), wrong.Join("doc.bin")}) {
    auto ds = OpenDataset(Tokens(path, 4), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << path;
    EXPECT_THAT(ds.status().message(),
                HasSubstr("dataset.path: " + wrong.Join("doc.idx") + " (the .idx beside " +
                          wrong.Join("doc.bin") +
                          "): not a Megatron-LM index: it starts '# an inde', not "
                          "'MMIDIDX\\0\\0'"))
        << path;
  }
}

// Files of other formats, as their writers lay them out (enough of them to sniff).
std::string TarHeader(const char* magic) {
  std::string h(512, '\0');
  h.replace(0, 9, "train.jpg");
  h.replace(257, 8, magic, 8);
  return h + std::string(512, 'x');
}
std::string ArrowStream() {
  // A flatbuffer Message: root offset 12; the vtable at 4 (8 bytes: its size, the table's,
  // field 0 version at +4, field 1 header_type at +6); the table at 12 (its vtable 8 back),
  // version 4 (V5) and header_type 1 (Schema).
  std::string m(24, '\0');
  const uint32_t root = 12;
  const uint16_t vtable[4] = {8, 8, 4, 6};
  const int32_t back = 8;
  const uint16_t version = 4;
  std::memcpy(m.data(), &root, 4);
  std::memcpy(m.data() + 4, vtable, 8);
  std::memcpy(m.data() + 12, &back, 4);
  std::memcpy(m.data() + 16, &version, 2);
  m[18] = 1;
  return Le32(0xFFFFFFFF) + Le32(24) + m + Le32(0xFFFFFFFF) + Le32(0);
}

TEST(TokenFormatsTest, ForeignFormatsAreRefusedNamingTheFormat) {
  const std::string text = [] {
    std::string t;
    while (t.size() < 600) t += "First Citizen:\nBefore we proceed any further, hear me speak.\n";
    return t;
  }();
  std::string safetensors_header =
      "{\"tokens\":{\"dtype\":\"I32\",\"shape\":[4],\"data_offsets\":[0,16]}}";
  while (safetensors_header.size() % 8 != 0) safetensors_header += ' ';
  const struct Case {
    std::string bytes, format;
  } cases[] = {
      {TarHeader("ustar\0"
                 "00"),
       "is a tar archive, not token ids: a WebDataset shard is kind "
       "webdataset"},
      {TarHeader("ustar  \0"), "is a tar archive"},
      {std::string("PK\x03\x04\x14\0\0\0", 8) + std::string(40, 'z'),
       "is a zip archive (NumPy .npz and PyTorch .pt files are zip archives)"},
      {std::string("\x1f\x8b\x08\x00\0\0\0\0\0\x03", 10) + std::string(30, 'z'),
       "is a gzip-compressed file, not token ids: decompress it"},
      {std::string("\x28\xb5\x2f\xfd\x04\x58", 6) + std::string(30, 'z'),
       "is a zstd-compressed file"},
      {std::string("BZh91AY&SY") + std::string(30, 'z'), "is a bzip2-compressed file"},
      {std::string("\xfd"
                   "7zXZ\0\0\x04",
                   8) +
           std::string(30, 'z'),
       "is an xz-compressed file"},
      {std::string("ARROW1\0\0", 8) + std::string(64, '\0') + "ARROW1",
       "is an Apache Arrow IPC file, not token ids: tokenize its text"},
      {ArrowStream(), "is an Apache Arrow IPC stream (Hugging Face datasets' .arrow files are)"},
      {"PAR1" + std::string(40, '\x15') + "PAR1", "is an Apache Parquet file"},
      {std::string("\x89HDF\r\n\x1a\n\0\0", 10) + std::string(30, 'z'), "is an HDF5 file"},
      {Le64(safetensors_header.size()) + safetensors_header + std::string(16, '\x01'),
       "is a safetensors file"},
      {std::string("\x80\x04\x95\x20\0\0\0\0\0\0\0}\x94(\x8c\nvocab_size", 25) +
           std::string(20, '.'),
       "is a Python pickle"},
      {std::string("\xff\xd8\xff\xe0\0\x10JFIF\0", 11) + std::string(40, 'z'),
       "is a JPEG image, not token ids: images are kind image_folder or webdataset"},
      {std::string("\x89PNG\r\n\x1a\n\0\0\0\rIHDR", 16) + std::string(40, 'z'), "is a PNG image"},
      {text, "is a text file, not token ids: tokenize it first"},
  };
  for (const Case& c : cases) {
    // Named alone, and as one file of a directory (then the advice says to name only the
    // token files).
    TempDir dir;
    const std::string path = dir.WriteFile("data.bin", c.bytes);
    auto ds = OpenDataset(Tokens(path, 2), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << c.format;
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument) << c.format;
    EXPECT_THAT(ds.status().message(), HasSubstr("dataset.path: " + path + " " + c.format));
    EXPECT_THAT(ds.status().message(), HasSubstr("(docs/howto/token-files.md lists what is read)"));
    dir.WriteFile("a.bin", Bytes(Stretch(0, 40), 2));
    ds = OpenDataset(Tokens(dir.path(), 2), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << c.format;
    EXPECT_THAT(ds.status().message(), HasSubstr("dataset.path: " + path + " " + c.format));
    EXPECT_THAT(ds.status().message(), HasSubstr("or name only the token files (a glob such as " +
                                                 dir.path() + "/*.bin)"));
  }
}

TEST(TokenFormatsTest, RawTokensThatStartLikeASignatureAreServed) {
  // Each starts with a foreign signature's first bytes but not all of it: raw, read exactly.
  const std::vector<std::vector<uint32_t>> raw16 = {
      {0x8b1f, 0x0009, 5, 6, 7, 8, 9, 10},          // gzip's 1f 8b, method 9
      {0x8b1f, 0x2008, 5, 6, 7, 8, 9, 10},          // gzip's, reserved flag bits set
      {0xFFFF, 0xFFFF, 24, 0, 1, 2, 3, 4, 5, 6},    // -1 padding, no Arrow message after it
      {0xD8FF, 0x00FF, 1, 2, 3, 4, 5, 6},           // JPEG's ff d8 ff, no marker
      {0x4B50, 0x0000, 1, 2, 3, 4, 5, 6},           // "PK" alone
      {0x4150, 0x3152, 1, 2, 3, 4, 5, 6},           // "PAR1" at the start only
      {0x0480, 0x2095, 0xFFFF, 0xFFFF, 1, 2, 3, 4}  // pickle's start, a frame past the file
  };
  for (const std::vector<uint32_t>& tokens : raw16) {
    TempDir dir;
    const std::string path = dir.WriteFile("t.bin", Bytes(tokens, 2));
    auto ds = OpenDataset(Tokens(path, 3), PosixFileSystem());
    ASSERT_TRUE(ds.ok()) << ds.status();
    ExpectWindows(**ds, {tokens}, 3);
  }
  // 4 KiB of GPT-2 ids, and of a character-level vocabulary: not text.
  std::vector<uint32_t> gpt2(2048), chars(2048);
  for (uint32_t i = 0; i < 2048; ++i) {
    gpt2[i] = (i * 7919 + 13) % 50257;
    chars[i] = 32 + (i * 31) % 65;
  }
  for (const auto& tokens : {gpt2, chars}) {
    TempDir dir;
    auto ds = OpenDataset(Tokens(dir.WriteFile("t.bin", Bytes(tokens, 2)), 64), PosixFileSystem());
    ASSERT_TRUE(ds.ok()) << ds.status();
    ExpectWindows(**ds, {tokens}, 64);
  }
}

TEST(TokenFormatsTest, ADirectoryMixingTrainAndValWarns) {
  // llm.c's layout: both splits in one folder.
  TempDir dir;
  dir.WriteFile("fineweb_train_000001.bin", Llmc(Stretch(0, 20), 1));
  dir.WriteFile("fineweb_train_000002.bin", Llmc(Stretch(50, 20), 1));
  dir.WriteFile("fineweb_val_000000.bin", Llmc(Stretch(90, 20), 1));
  auto ds = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  const std::vector<DatasetNotice> notices = (*ds)->notices();
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].reason, "warning");
  EXPECT_EQ(notices[0].count, 0);
  EXPECT_EQ(notices[0].example, dir.Join("fineweb_val_000000.bin"));
  EXPECT_EQ(notices[0].message,
            "dataset.path: " + dir.path() + " holds training and held-out files together (" +
                dir.Join("fineweb_train_000001.bin") + " and " +
                dir.Join("fineweb_val_000000.bin") +
                "), and all of them are read as training data; to train on the training split "
                "alone, name it: " +
                dir.Join("*_train_*.bin"));
  // The suggested glob selects the training files alone, and warns no more.
  auto train = OpenDataset(Tokens(dir.Join("*_train_*.bin"), 4), PosixFileSystem());
  ASSERT_TRUE(train.ok()) << train.status();
  EXPECT_EQ((*train)->num_samples(), 8u);
  EXPECT_THAT((*train)->notices(), IsEmpty());
  // nanoGPT's names (the glob that mixes them too); "valid"/"test"/"TRAIN" count as well.
  for (const auto& [train_name, held_out, suggested] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"train.bin", "val.bin", "train.bin"},
           {"owt-train-00001-of-00004.bin", "owt-valid-00000-of-00001.bin", "*-train-*.bin"},
           {"TRAIN_0.npy", "test_0.npy", "TRAIN_*.npy"}}) {
    TempDir nano;
    nano.WriteFile(train_name, Bytes(Stretch(0, 20), 2));
    nano.WriteFile(held_out, Bytes(Stretch(0, 20), 2));
    auto mixed = OpenDataset(Tokens(nano.Join("*"), 4), PosixFileSystem());
    ASSERT_TRUE(mixed.ok()) << mixed.status();
    ASSERT_EQ((*mixed)->notices().size(), 1u) << train_name;
    EXPECT_THAT((*mixed)->notices()[0].message, HasSubstr("name it: " + nano.Join(suggested)));
    EXPECT_EQ((*mixed)->notices()[0].example, nano.Join(held_out));
  }
  // Names that only contain the markers inside a word do not count (trainer, interval).
  TempDir words;
  words.WriteFile("trainer_0.bin", Bytes(Stretch(0, 20), 2));
  words.WriteFile("interval_0.bin", Bytes(Stretch(0, 20), 2));
  words.WriteFile("train_0.bin", Bytes(Stretch(0, 20), 2));
  auto plain = OpenDataset(Tokens(words.path(), 4), PosixFileSystem());
  ASSERT_TRUE(plain.ok());
  EXPECT_THAT((*plain)->notices(), IsEmpty());
}

// ---- An explicit list of shard files -------------------------------------------

DatasetSpec Listed(const std::string& dir, const std::vector<std::string>& paths,
                   int64_t seq_len = 4) {
  DatasetSpec spec = Tokens(dir, seq_len);
  spec.paths = paths;
  return spec;
}

std::vector<std::vector<uint32_t>> AllRows(const Dataset& ds) {
  std::vector<std::vector<uint32_t>> rows;
  for (uint64_t i = 0; i < ds.num_samples(); ++i) rows.push_back(Row(ds, i));
  return rows;
}

TEST(ShardListTest, AListReadsItsFilesInItsOrderAsTheDirectoryDoesInNameOrder) {
  TempDir dir;
  const std::vector<uint32_t> a = Stretch(0, 23), b = Stretch(1000, 9), c = Stretch(5000, 17);
  dir.WriteFile("a.bin", Bytes(a, 2));
  dir.WriteFile("b.npy", NpyFile("<u2", "(9,)", Bytes(b, 2)));
  dir.WriteFile("c.bin", Llmc(c, 1));
  auto whole = OpenDataset(Tokens(dir.path(), 4), PosixFileSystem());
  ASSERT_TRUE(whole.ok()) << whole.status();
  const DatasetSpec in_order =
      Listed(dir.path(), {dir.Join("a.bin"), dir.Join("b.npy"), dir.Join("c.bin")});
  auto listed = OpenDataset(in_order, PosixFileSystem());
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(AllRows(**listed), AllRows(**whole));
  EXPECT_EQ((*listed)->ContentIdentity(), (*whole)->ContentIdentity());
  // Through the directory a client passed, too.
  PassedDir passed(dir.path());
  DatasetSpec by_client = in_order;
  by_client.fd = passed.fd;
  auto through_fd = OpenDataset(by_client, PosixFileSystem());
  ASSERT_TRUE(through_fd.ok()) << through_fd.status();
  EXPECT_EQ(AllRows(**through_fd), AllRows(**whole));
  // The list's order, not the names'.
  auto reordered =
      OpenDataset(Listed(dir.path(), {dir.Join("c.bin"), dir.Join("a.bin"), dir.Join("b.npy")}),
                  PosixFileSystem());
  ASSERT_TRUE(reordered.ok()) << reordered.status();
  ExpectWindows(**reordered, {c, a, b}, 4);
  EXPECT_NE((*reordered)->ContentIdentity(), (*listed)->ContentIdentity());
  EXPECT_NE(ShardPathsIdentity({dir.Join("c.bin"), dir.Join("a.bin")}),
            ShardPathsIdentity({dir.Join("a.bin"), dir.Join("c.bin")}));
  // Files of several directories, beneath their common one; each file's rules hold (a
  // foreign format is refused naming its entry).
  TempDir top;
  ASSERT_EQ(::mkdir(top.Join("x").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(top.Join("y").c_str(), 0755), 0);
  WriteAt(top.Join("x/0.bin"), Bytes(b, 2));
  WriteAt(top.Join("y/0.bin"), Bytes(a, 2));
  auto spread = OpenDataset(Listed(top.path(), {top.Join("y/0.bin"), top.Join("x/0.bin")}),
                            PosixFileSystem());
  ASSERT_TRUE(spread.ok()) << spread.status();
  ExpectWindows(**spread, {a, b}, 4);
  WriteAt(top.Join("x/1.bin"), std::string("\x1f\x8b\x08\x00", 4) + std::string(40, 'z'));
  auto refused = OpenDataset(Listed(top.path(), {top.Join("y/0.bin"), top.Join("x/1.bin")}),
                             PosixFileSystem());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("dataset.paths[1]: " + top.Join("x/1.bin") +
                                                    " is a gzip-compressed file, not token ids"));
}

TEST(ShardListTest, AMegatronBinListedIsReadWithItsIdx) {
  TempDir dir;
  const std::vector<uint32_t> tokens = Stretch(100000, 29);
  dir.WriteFile("doc.bin", Bytes(tokens, 4));
  dir.WriteFile("doc.idx", MegatronIdx({29}, 4, 4));
  for (const std::vector<std::string>& paths :
       std::vector<std::vector<std::string>>{{dir.Join("doc.bin")},
                                             {dir.Join("doc.bin"), dir.Join("doc.idx")},
                                             {dir.Join("doc.idx"), dir.Join("doc.bin")}}) {
    auto ds = OpenDataset(Listed(dir.path(), paths), PosixFileSystem());
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kUInt32);
    ExpectWindows(**ds, {tokens}, 4);
  }
  auto idx = OpenDataset(Listed(dir.path(), {dir.Join("doc.idx")}), PosixFileSystem());
  EXPECT_EQ(idx.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(idx.status().message(),
              HasSubstr("dataset.paths[0]: " + dir.Join("doc.idx") +
                        " is a Megatron-LM index (.idx, magic MMIDIDX), not token ids"));
}

TEST(ShardListTest, BadListsAreRefusedNamingTheEntry) {
  TempDir dir;
  dir.WriteFile("a.bin", Bytes(Stretch(0, 20), 2));
  dir.WriteFile("b.bin", Bytes(Stretch(50, 20), 2));
  ASSERT_EQ(::mkdir(dir.Join("sub").c_str(), 0755), 0);
  ASSERT_EQ(::link(dir.Join("a.bin").c_str(), dir.Join("sub/a-again.bin").c_str()), 0);
  TempDir elsewhere;
  const struct Case {
    std::vector<std::string> paths;
    absl::StatusCode code;
    std::string message;
  } cases[] = {
      {{dir.Join("a.bin"), dir.Join("b.bin"), dir.Join("a.bin")},
       absl::StatusCode::kInvalidArgument,
       "dataset.paths[2]: " + dir.Join("a.bin") +
           " is dataset.paths[0] again; each file may appear once"},
      {{dir.Join("a.bin"), dir.Join("sub/a-again.bin")},
       absl::StatusCode::kInvalidArgument,
       "dataset.paths[1]: " + dir.Join("sub/a-again.bin") +
           " is the same file as dataset.paths[0] (" + dir.Join("a.bin") +
           "): each file may appear once"},
      {{dir.Join("a.bin"), dir.Join("gone.bin")},
       absl::StatusCode::kNotFound,
       "dataset.paths[1]: "},
      {{dir.Join("a.bin"), elsewhere.Join("x.bin")},
       absl::StatusCode::kInvalidArgument,
       "dataset.paths[1]: '" + elsewhere.Join("x.bin") + "' is not a file beneath dataset.path " +
           dir.path() + " (the directory passed)"},
      {{dir.Join("sub/../b.bin")},
       absl::StatusCode::kInvalidArgument,
       "dataset.paths[0]: '" + dir.Join("sub/../b.bin") +
           "' is not an absolute path of names (no empty, '.' or '..' component"},
      {{dir.Join("a.bin"), dir.path() + "//b.bin"},
       absl::StatusCode::kInvalidArgument,
       "dataset.paths[1]: '"},
      {{dir.Join("sub")}, absl::StatusCode::kInvalidArgument, "dataset.paths[0]: "},
  };
  for (const Case& c : cases) {
    auto ds = OpenDataset(Listed(dir.path(), c.paths), PosixFileSystem());
    ASSERT_FALSE(ds.ok()) << c.message;
    EXPECT_EQ(ds.status().code(), c.code) << ds.status();
    EXPECT_THAT(ds.status().message(), HasSubstr(c.message));
  }
  // Too long: counted (and refused) before any file is opened.
  std::vector<std::string> many(kMaxListedShards + 1, dir.Join("a.bin"));
  auto ds = OpenDataset(Listed(dir.path(), many), PosixFileSystem());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(),
              HasSubstr("dataset.paths: 16385 files, at most 16384; name their directory or a "
                        "glob instead"));
  // Only for tokens and webdataset.
  DatasetSpec records = Listed(dir.path(), {dir.Join("a.bin")});
  records.kind = DatasetKind::kRecords;
  records.seq_len = 0;
  ds = OpenDataset(records, PosixFileSystem());
  EXPECT_THAT(ds.status().message(), HasSubstr("dataset.paths: only for kind tokens and "
                                               "webdataset"));
}

TEST(ShardListTest, AnEntryTheCallerCannotReadIsRefusedNamingIt) {
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(dir.WriteFile("a.bin", Bytes(Stretch(0, 20), 2)).c_str(), 0644), 0);
  const std::string hidden = dir.WriteFile("b.bin", Bytes(Stretch(50, 20), 2));
  ASSERT_EQ(::chmod(hidden.c_str(), 0600), 0);  // its owner's (this process's) alone
  PassedDir passed(dir.path());
  DatasetSpec spec = Listed(dir.path(), {dir.Join("a.bin"), hidden});
  spec.fd = passed.fd;
  spec.reader = PeerCred{4242, 4242, 1, {}};  // a caller of another uid
  auto ds = OpenDataset(spec, PosixFileSystem());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(ds.status().message(), HasSubstr("dataset.paths[1]: "));
  EXPECT_THAT(ds.status().message(), HasSubstr(hidden));
  EXPECT_THAT(ds.status().message(), HasSubstr("uid 4242"));
  // The same list for its owner.
  spec.reader = PeerCred{::geteuid(), ::getegid(), 1, {}};
  ds = OpenDataset(spec, PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ExpectWindows(**ds, {Stretch(0, 20), Stretch(50, 20)}, 4);
}

}  // namespace
}  // namespace gpufeed::server
