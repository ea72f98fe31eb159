#include "server/images/dataset.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/os/fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_file_system.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::FakeFileSystem;
using ::gpufeed::testing::NpyFile;
using ::gpufeed::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// `count` little-endian tokens of `width` bytes; token t has value (t * 2654435761 + 17) cut
// to the width, so that every token differs from its neighbours and bytes are not symmetric.
std::string TokenBytes(uint64_t count, int width) {
  std::string out;
  for (uint64_t t = 0; t < count; ++t) {
    const uint64_t v = t * 2654435761u + 17;
    for (int b = 0; b < width; ++b) out += static_cast<char>((v >> (8 * b)) & 0xff);
  }
  return out;
}

DatasetSpec TokensSpec(const std::string& path, DType dtype, int64_t seq_len) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kTokens;
  spec.path = path;
  spec.token_dtype = dtype;
  spec.seq_len = seq_len;
  return spec;
}

DatasetSpec RecordsSpec(const std::string& path) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kRecords;
  spec.path = path;
  return spec;
}

// Reads sample `id` of a one-tensor dataset into a string.
absl::StatusOr<std::string> ReadOne(const Dataset& ds, uint64_t id) {
  std::string row(ds.tensors().at(0).byte_size, '\xEE');
  std::span<std::byte> span(reinterpret_cast<std::byte*>(row.data()), row.size());
  const std::span<std::byte> rows[] = {span};
  absl::Status s = ds.ReadSample(id, rows);
  if (!s.ok()) return s;
  return row;
}

void ExpectTokensDataset(FileSystem* fs, const std::string& path, const std::string& bytes,
                         DType dtype, int width, int64_t seq_len) {
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(TokensSpec(path, dtype, seq_len), fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  const uint64_t tokens = bytes.size() / static_cast<uint64_t>(width);
  const uint64_t expected_samples = (tokens - 1) / static_cast<uint64_t>(seq_len);
  EXPECT_EQ((*ds)->num_samples(), expected_samples);
  ASSERT_EQ((*ds)->tensors().size(), 1u);
  const SampleTensor& t = (*ds)->tensors()[0];
  EXPECT_EQ(t.name, "tokens");
  EXPECT_EQ(t.dtype, dtype);
  EXPECT_THAT(t.shape, ElementsAre(seq_len + 1));
  EXPECT_EQ(t.byte_size, static_cast<uint64_t>((seq_len + 1) * width));
  for (uint64_t i = 0; i < expected_samples; ++i) {
    absl::StatusOr<std::string> row = ReadOne(**ds, i);
    ASSERT_TRUE(row.ok()) << row.status();
    // Tokens [i*seq_len, i*seq_len + seq_len], both ends included.
    const std::string expected =
        bytes.substr(i * static_cast<uint64_t>(seq_len * width), t.byte_size);
    ASSERT_EQ(*row, expected) << "sample " << i;
  }
}

// ---- tokens ----

TEST(TokensDatasetTest, Uint16WithFakeFileSystem) {
  FakeFileSystem fs;
  const std::string bytes = TokenBytes(101, 2);
  fs.AddFile("/data/tokens.bin", bytes);
  ExpectTokensDataset(&fs, "/data/tokens.bin", bytes, DType::kUInt16, 2, 10);  // 10 samples
}

TEST(TokensDatasetTest, Uint32WithFakeFileSystem) {
  FakeFileSystem fs;
  const std::string bytes = TokenBytes(100, 4);  // (100-1)/7 = 14 samples, 1 token left over
  fs.AddFile("/data/tokens.bin", bytes);
  ExpectTokensDataset(&fs, "/data/tokens.bin", bytes, DType::kUInt32, 4, 7);
}

TEST(TokensDatasetTest, SampleCountIsFloorOfTokensMinusOneOverSeqLen) {
  FakeFileSystem fs;
  const struct {
    uint64_t tokens;
    int64_t seq_len;
    uint64_t samples;
  } cases[] = {{11, 10, 1}, {20, 10, 1}, {21, 10, 2}, {2, 1, 1}, {5, 1, 4}, {1000, 999, 1}};
  for (const auto& c : cases) {
    fs.AddFile("/t", TokenBytes(c.tokens, 2));
    absl::StatusOr<std::unique_ptr<Dataset>> ds =
        OpenDataset(TokensSpec("/t", DType::kUInt16, c.seq_len), &fs);
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ((*ds)->num_samples(), c.samples) << c.tokens << " tokens, seq_len " << c.seq_len;
  }
}

TEST(TokensDatasetTest, ExactValuesOfFirstSample) {
  // A hand-written file: tokens 1..6 as uint16; seq_len 2 -> sample 1 is tokens 2, 3, 4
  // (values 3, 4, 5).
  FakeFileSystem fs;
  const std::string bytes("\x01\x00\x02\x00\x03\x00\x04\x00\x05\x00\x06\x00", 12);
  fs.AddFile("/t", bytes);
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("/t", DType::kUInt16, 2), &fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 2u);
  absl::StatusOr<std::string> row = ReadOne(**ds, 1);
  ASSERT_TRUE(row.ok()) << row.status();
  EXPECT_EQ(*row, std::string("\x03\x00\x04\x00\x05\x00", 6));
}

// ---- records ----

std::string Int32Rows(int rows, int per_row) {
  std::string data;
  for (int i = 0; i < rows * per_row; ++i) {
    const int32_t v = i * 1000 - 7;  // negative first value: sign bytes matter
    data.append(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  return data;
}

void ExpectRecords(FileSystem* fs, const std::string& path, const std::string& file,
                   const std::string& data) {
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(RecordsSpec(path), fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 6u);
  ASSERT_EQ((*ds)->tensors().size(), 1u);
  const SampleTensor& t = (*ds)->tensors()[0];
  EXPECT_EQ(t.name, "data");
  EXPECT_EQ(t.dtype, DType::kInt32);
  EXPECT_THAT(t.shape, ElementsAre(2, 3));
  EXPECT_EQ(t.byte_size, 24u);
  const size_t data_offset = file.size() - data.size();
  for (uint64_t i = 0; i < 6; ++i) {
    absl::StatusOr<std::string> row = ReadOne(**ds, i);
    ASSERT_TRUE(row.ok()) << row.status();
    ASSERT_EQ(*row, file.substr(data_offset + i * 24, 24)) << "row " << i;
    int32_t first;
    std::memcpy(&first, row->data(), 4);
    EXPECT_EQ(first, static_cast<int32_t>(i * 6 * 1000 - 7));
  }
}

TEST(RecordsDatasetTest, NpyRowsWithFakeFileSystem) {
  FakeFileSystem fs;
  const std::string data = Int32Rows(6, 6);
  const std::string file = NpyFile("<i4", "(6, 2, 3)", data);
  fs.AddFile("/data/x.npy", file);
  ExpectRecords(&fs, "/data/x.npy", file, data);
}

TEST(RecordsDatasetTest, OneDimensionalArrayHasScalarRows) {
  FakeFileSystem fs;
  fs.AddFile("/v.npy", NpyFile("<f8", "(4,)", std::string(32, '\x11')));
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(RecordsSpec("/v.npy"), &fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 4u);
  EXPECT_TRUE((*ds)->tensors()[0].shape.empty());
  EXPECT_EQ((*ds)->tensors()[0].byte_size, 8u);
  EXPECT_EQ((*ds)->tensors()[0].dtype, DType::kFloat64);
}

TEST(RecordsDatasetTest, ExtraBytesAfterTheArrayAreIgnored) {
  FakeFileSystem fs;
  const std::string data = Int32Rows(6, 6);
  const std::string file = NpyFile("<i4", "(6, 2, 3)", data);
  fs.AddFile("/x.npy", file + "trailing garbage");
  ExpectRecords(&fs, "/x.npy", file, data);
}

// ---- refusals ----

void ExpectError(const absl::StatusOr<std::unique_ptr<Dataset>>& ds, absl::StatusCode code,
                 const std::string& substring) {
  ASSERT_FALSE(ds.ok()) << "opened a dataset that should be refused";
  EXPECT_EQ(ds.status().code(), code) << ds.status();
  EXPECT_THAT(ds.status().message(), HasSubstr(substring));
}

TEST(DatasetErrorsTest, EmptyFile) {
  FakeFileSystem fs;
  fs.AddFile("/empty", "");
  ExpectError(OpenDataset(TokensSpec("/empty", DType::kUInt16, 4), &fs),
              absl::StatusCode::kInvalidArgument, "empty");
  ExpectError(OpenDataset(RecordsSpec("/empty"), &fs), absl::StatusCode::kInvalidArgument,
              "dataset.path");
}

TEST(DatasetErrorsTest, SeqLenZeroOrNegative) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(100, 2));
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt16, 0), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.seq_len");
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt16, -5), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.seq_len");
}

TEST(DatasetErrorsTest, SeqLenTooLargeForFile) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(10, 2));
  // 10 tokens hold one window of seq_len 9 (10 tokens) but none of seq_len 10.
  EXPECT_TRUE(OpenDataset(TokensSpec("/t", DType::kUInt16, 9), &fs).ok());
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("/t", DType::kUInt16, 10), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.seq_len");
  EXPECT_THAT(ds.status().message(), HasSubstr("11"));  // tokens needed
  EXPECT_THAT(ds.status().message(), HasSubstr("holds 10"));
}

TEST(DatasetErrorsTest, SingleTokenFileHasNoSample) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(1, 4));
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt32, 1), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.seq_len");
}

TEST(DatasetErrorsTest, TokenDtypeMustBeUint16OrUint32) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(100, 4));
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("/t", DType::kFloat32, 4), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.token_dtype");
  EXPECT_THAT(ds.status().message(), HasSubstr("float32"));
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt8, 4), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.token_dtype");
}

TEST(DatasetErrorsTest, OddByteSizeForUint16) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(100, 2) + "x");
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("/t", DType::kUInt16, 4), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.path");
  EXPECT_THAT(ds.status().message(), HasSubstr("201 bytes"));
  EXPECT_THAT(ds.status().message(), HasSubstr("uint16"));
  // 202 bytes are not whole uint32 tokens either.
  fs.AddFile("/t", TokenBytes(101, 2));
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt32, 4), &fs),
              absl::StatusCode::kInvalidArgument, "uint32");
}

TEST(DatasetErrorsTest, RelativePath) {
  FakeFileSystem fs;
  fs.AddFile("data/t", TokenBytes(100, 2));
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("data/t", DType::kUInt16, 4), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.path");
  EXPECT_THAT(ds.status().message(), HasSubstr("data/t"));
  ExpectError(OpenDataset(TokensSpec("", DType::kUInt16, 4), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.path");
  EXPECT_EQ(fs.open_count(), 0) << "a relative path must be refused before any open";
}

TEST(DatasetErrorsTest, UnknownKind) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(100, 2));
  DatasetSpec spec = TokensSpec("/t", DType::kUInt16, 4);
  spec.kind = DatasetKind::kUnspecified;
  ExpectError(OpenDataset(spec, &fs), absl::StatusCode::kInvalidArgument, "dataset.kind");
  spec.kind = static_cast<DatasetKind>(42);
  ExpectError(OpenDataset(spec, &fs), absl::StatusCode::kInvalidArgument, "42");
}

TEST(DatasetErrorsTest, MissingFileInFakeIsNotFound) {
  FakeFileSystem fs;
  ExpectError(OpenDataset(TokensSpec("/nope", DType::kUInt16, 4), &fs), absl::StatusCode::kNotFound,
              "/nope");
}

TEST(DatasetErrorsTest, OpenFailureIsPassedThrough) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(100, 2));
  fs.FailOpen("/t", absl::PermissionDeniedError("opening dataset /t: Permission denied"));
  ExpectError(OpenDataset(TokensSpec("/t", DType::kUInt16, 4), &fs),
              absl::StatusCode::kPermissionDenied, "/t");
  fs.FailOpen("/t", absl::DataLossError("opening dataset /t: Input/output error"));
  ExpectError(OpenDataset(RecordsSpec("/t"), &fs), absl::StatusCode::kDataLoss, "/t");
  fs.ClearOpenFailure("/t");
  EXPECT_TRUE(OpenDataset(TokensSpec("/t", DType::kUInt16, 4), &fs).ok());
}

TEST(DatasetErrorsTest, TruncatedNpy) {
  FakeFileSystem fs;
  // The header promises 6 rows of 24 bytes; the file holds 5 and a half.
  const std::string file = NpyFile("<i4", "(6, 2, 3)", Int32Rows(6, 6).substr(0, 5 * 24 + 12));
  fs.AddFile("/x.npy", file);
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(RecordsSpec("/x.npy"), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "truncated");
  EXPECT_THAT(ds.status().message(), HasSubstr("dataset.path"));
  EXPECT_THAT(ds.status().message(), HasSubstr(std::to_string(128 + 6 * 24)));  // needed
  EXPECT_THAT(ds.status().message(), HasSubstr(std::to_string(file.size())));   // has
}

TEST(DatasetErrorsTest, BadNpyHeaderNamesThePath) {
  FakeFileSystem fs;
  fs.AddFile("/bad.npy", NpyFile(">f4", "(6,)", std::string(24, '\0')));
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(RecordsSpec("/bad.npy"), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.path: /bad.npy");
  EXPECT_THAT(ds.status().message(), HasSubstr("big-endian"));
  fs.AddFile("/tokens.bin", TokenBytes(100, 2));
  ExpectError(OpenDataset(RecordsSpec("/tokens.bin"), &fs), absl::StatusCode::kInvalidArgument,
              "magic");
}

TEST(DatasetErrorsTest, NpyWithoutData) {
  FakeFileSystem fs;
  fs.AddFile("/zero_rows.npy", NpyFile("<i4", "(0, 3)", ""));
  ExpectError(OpenDataset(RecordsSpec("/zero_rows.npy"), &fs), absl::StatusCode::kInvalidArgument,
              "no data");
  fs.AddFile("/zero_cols.npy", NpyFile("<i4", "(5, 0)", ""));
  ExpectError(OpenDataset(RecordsSpec("/zero_cols.npy"), &fs), absl::StatusCode::kInvalidArgument,
              "no data");
}

TEST(DatasetErrorsTest, HugeRowsAreRefusedWithoutOverflow) {
  FakeFileSystem fs;
  fs.AddFile("/huge.npy",
             NpyFile("<f8", "(2, 4294967296, 4294967296, 4294967296)", std::string(64, '\0')));
  ExpectError(OpenDataset(RecordsSpec("/huge.npy"), &fs), absl::StatusCode::kInvalidArgument,
              "1 TiB");
  // Many rows of a small size: the product overflows 64 bits unless computed wide.
  fs.AddFile("/many.npy", NpyFile("<f8", "(9223372036854775807, 4)", std::string(64, '\0')));
  ExpectError(OpenDataset(RecordsSpec("/many.npy"), &fs), absl::StatusCode::kInvalidArgument,
              "truncated");
}

// ---- a file that shrinks after it was opened ----

TEST(DatasetShrinkTest, FakeFileShrinksAfterOpen) {
  FakeFileSystem fs;
  fs.AddFile("/t", TokenBytes(101, 2));
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec("/t", DType::kUInt16, 10), &fs);
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->num_samples(), 10u);
  fs.Shrink("/t", 100);  // 50 tokens left: samples 0..3 still whole, 4 is cut
  EXPECT_TRUE(ReadOne(**ds, 3).ok());
  absl::StatusOr<std::string> row = ReadOne(**ds, 4);
  EXPECT_EQ(row.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(row.status().message(), HasSubstr("shrank"));
  EXPECT_EQ(ReadOne(**ds, 9).status().code(), absl::StatusCode::kDataLoss);
  const absl::Status check = (*ds)->CheckNotShrunk();
  EXPECT_EQ(check.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(check.message(), HasSubstr("shrank"));
}

// ---- the real file systems: pread (PosixFileSystem) and the guarded mapping
// (MappedFileSystem, the daemon's default) must behave the same ----

struct RealFs {
  const char* name;
  FileSystem* (*get)();
  bool mapped;
};

void PrintTo(const RealFs& fs, std::ostream* os) { *os << fs.name; }

class RealFileDatasetTest : public ::testing::TestWithParam<RealFs> {
 protected:
  FileSystem* fs() const { return GetParam().get(); }
  TempDir dir_;
};

INSTANTIATE_TEST_SUITE_P(FileSystems, RealFileDatasetTest,
                         ::testing::Values(RealFs{"pread", &PosixFileSystem, false},
                                           RealFs{"mmap", &MappedFileSystem, true}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST_P(RealFileDatasetTest, TokensUint16) {
  const std::string bytes = TokenBytes(1000, 2);
  const std::string path = dir_.WriteFile("tokens_u16.bin", bytes);
  ExpectTokensDataset(fs(), path, bytes, DType::kUInt16, 2, 64);  // 15 samples
}

TEST_P(RealFileDatasetTest, TokensUint32) {
  const std::string bytes = TokenBytes(513, 4);
  const std::string path = dir_.WriteFile("tokens_u32.bin", bytes);
  ExpectTokensDataset(fs(), path, bytes, DType::kUInt32, 4, 32);  // exactly 16
}

TEST_P(RealFileDatasetTest, TokensSpanningManyPages) {
  const std::string bytes = TokenBytes(50001, 2);  // 100 KB
  const std::string path = dir_.WriteFile("tokens_big.bin", bytes);
  ExpectTokensDataset(fs(), path, bytes, DType::kUInt16, 2, 1000);  // 50 samples
}

TEST_P(RealFileDatasetTest, NpyRows) {
  const std::string data = Int32Rows(6, 6);
  const std::string file = NpyFile("<i4", "(6, 2, 3)", data);
  ExpectRecords(fs(), dir_.WriteFile("x.npy", file), file, data);
}

TEST_P(RealFileDatasetTest, NpyVersion2Rows) {
  const std::string data = Int32Rows(6, 6);
  const std::string file = NpyFile("<i4", "(6, 2, 3)", data, /*major=*/2);
  ExpectRecords(fs(), dir_.WriteFile("x2.npy", file), file, data);
}

TEST_P(RealFileDatasetTest, EmptyTokensFile) {
  const std::string path = dir_.WriteFile("empty.bin", "");
  ExpectError(OpenDataset(TokensSpec(path, DType::kUInt16, 4), fs()),
              absl::StatusCode::kInvalidArgument, "empty");
}

TEST_P(RealFileDatasetTest, EmptyNpyFile) {
  // Regression: an empty file has no mapping, and reading its 0-byte prefix used to call
  // memcpy(dst, nullptr, 0), which UBSan aborts on.
  const std::string path = dir_.WriteFile("empty.npy", "");
  ExpectError(OpenDataset(RecordsSpec(path), fs()), absl::StatusCode::kInvalidArgument, "magic");
}

TEST_P(RealFileDatasetTest, MissingFileIsNotFoundNamingThePath) {
  const std::string path = dir_.Join("no_such_file.bin");
  ExpectError(OpenDataset(TokensSpec(path, DType::kUInt16, 4), fs()), absl::StatusCode::kNotFound,
              path);
  ExpectError(OpenDataset(RecordsSpec(path), fs()), absl::StatusCode::kNotFound, path);
  // A missing directory on the way is NOT_FOUND too.
  const std::string deeper = dir_.Join("nodir/file.bin");
  ExpectError(OpenDataset(TokensSpec(deeper, DType::kUInt16, 4), fs()), absl::StatusCode::kNotFound,
              deeper);
}

TEST_P(RealFileDatasetTest, UnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) {
    GTEST_SKIP() << "running as root: root reads a mode-000 file, so there is nothing to test";
  }
  const std::string path = dir_.WriteFile("secret.bin", TokenBytes(100, 2));
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  ExpectError(OpenDataset(TokensSpec(path, DType::kUInt16, 4), fs()),
              absl::StatusCode::kPermissionDenied, path);
}

TEST_P(RealFileDatasetTest, DirectoryIsInvalidArgument) {
  ExpectError(OpenDataset(TokensSpec(dir_.path(), DType::kUInt16, 4), fs()),
              absl::StatusCode::kInvalidArgument, dir_.path());
  ExpectError(OpenDataset(RecordsSpec(dir_.path()), fs()), absl::StatusCode::kInvalidArgument,
              "not a regular file");
}

TEST_P(RealFileDatasetTest, TruncatedNpy) {
  const std::string path = dir_.WriteFile("t.npy", NpyFile("<i4", "(6, 2, 3)", Int32Rows(1, 6)));
  ExpectError(OpenDataset(RecordsSpec(path), fs()), absl::StatusCode::kInvalidArgument,
              "truncated");
}

// The file loses whole pages after OpenDataset: samples past the new end are DATA_LOSS.
TEST_P(RealFileDatasetTest, FileTruncatedAtAPageBoundaryAfterOpen) {
  const uint64_t page = PageSize();
  const std::string bytes = TokenBytes(3 * page / 2 + 1, 2);  // 3 pages of uint16 tokens
  const std::string path = dir_.WriteFile("t.bin", bytes);
  const int64_t seq_len = static_cast<int64_t>(page / 2);  // one page per sample
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec(path, DType::kUInt16, seq_len), fs());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->num_samples(), 3u);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(page)), 0);
  // Sample 2 starts on page 2, wholly gone.
  absl::StatusOr<std::string> gone = ReadOne(**ds, 2);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(gone.status().message(), HasSubstr("shrank"));
  EXPECT_THAT(gone.status().message(), HasSubstr(path));
  // Sample 1 starts on page 1: gone as well.
  EXPECT_EQ(ReadOne(**ds, 1).status().code(), absl::StatusCode::kDataLoss);
  // Sample 0 needs one token of page 1: gone.
  EXPECT_EQ(ReadOne(**ds, 0).status().code(), absl::StatusCode::kDataLoss);
}

// A read of a sample the file no longer (wholly) holds must not pass unnoticed: either
// ReadSample says DATA_LOSS (pread: a short read) or, when a mapping read the cut tail of
// its last page as zeros without a fault, the CheckNotShrunk that readers run after a batch
// does. Returns the status a reader ends up with for the batch made of sample `id`.
absl::Status ReadBatchOf(const Dataset& ds, uint64_t id) {
  absl::StatusOr<std::string> row = ReadOne(ds, id);
  if (!row.ok()) return row.status();
  return ds.CheckNotShrunk();
}

// The file is cut in the middle of a page: the part of a sample past the new end is gone.
TEST_P(RealFileDatasetTest, FileTruncatedMidPageAfterOpen) {
  const std::string bytes = TokenBytes(101, 2);
  const std::string path = dir_.WriteFile("t.bin", bytes);
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec(path, DType::kUInt16, 10), fs());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->num_samples(), 10u);
  EXPECT_TRUE((*ds)->CheckNotShrunk().ok());
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  // Bytes [60, 82) are still there and read right.
  absl::StatusOr<std::string> ok = ReadOne(**ds, 3);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, bytes.substr(60, 22));
  // Sample 4 is bytes [80, 102): cut in the middle. Sample 9 lies wholly past the new end.
  for (uint64_t id : {4, 9}) {
    const absl::Status s = ReadBatchOf(**ds, id);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "sample " << id << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("shrank"));
    EXPECT_THAT(s.message(), HasSubstr(path));
  }
  if (GetParam().mapped) {
    // The mapping's check reports the shrink whatever was read.
    const absl::Status s = (*ds)->CheckNotShrunk();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(s.message(), HasSubstr("from 202 to 100 bytes"));
  }
}

TEST_P(RealFileDatasetTest, NpyTruncatedMidPageAfterOpen) {
  const std::string file = NpyFile("<i4", "(6, 2, 3)", Int32Rows(6, 6));
  const std::string path = dir_.WriteFile("x.npy", file);
  absl::StatusOr<std::unique_ptr<Dataset>> ds = OpenDataset(RecordsSpec(path), fs());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ(::truncate(path.c_str(), 128 + 2 * 24), 0);
  absl::StatusOr<std::string> row1 = ReadOne(**ds, 1);
  ASSERT_TRUE(row1.ok()) << row1.status();
  EXPECT_EQ(*row1, file.substr(128 + 24, 24));
  const absl::Status s = ReadBatchOf(**ds, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("shrank"));
}

TEST_P(RealFileDatasetTest, CheckNotShrunkIsOkForAnIntactOrGrownFile) {
  const std::string bytes = TokenBytes(101, 2);
  const std::string path = dir_.WriteFile("t.bin", bytes);
  absl::StatusOr<std::unique_ptr<Dataset>> ds =
      OpenDataset(TokensSpec(path, DType::kUInt16, 10), fs());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_TRUE(ReadBatchOf(**ds, 9).ok());
  // Appending (a dataset being extended) is not a loss: the opened size is still served.
  {
    std::ofstream out(path, std::ios::binary | std::ios::app);
    const std::string more = TokenBytes(50, 2);
    out.write(more.data(), static_cast<std::streamsize>(more.size()));
  }
  EXPECT_TRUE((*ds)->CheckNotShrunk().ok());
  EXPECT_EQ((*ds)->num_samples(), 10u);
}

}  // namespace
}  // namespace gpufeed::server

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::FakeFileSystem;
using ::gpufeed::testing::NpyFile;
using ::testing::HasSubstr;

// Tokens files are checked, not guessed.

// A .npy of tokens (np.save) is read through its header: the same samples as the raw file,
// the dtype from the header whether token_dtype is unset or agrees.
TEST(TokensNpyTest, ReadThroughItsHeaderWithTheHeadersDtype) {
  FakeFileSystem fs;
  const std::string raw16 = TokenBytes(101, 2), raw32 = TokenBytes(101, 4);
  fs.AddFile("/t16.npy", NpyFile("<u2", "(101,)", raw16));
  fs.AddFile("/t32.npy", NpyFile("<u4", "(101,)", raw32));
  ExpectTokensDataset(&fs, "/t16.npy", raw16, DType::kUInt16, 2, 10);
  ExpectTokensDataset(&fs, "/t32.npy", raw32, DType::kUInt32, 4, 10);
  for (const char* path : {"/t16.npy", "/t32.npy"}) {
    auto ds = OpenDataset(TokensSpec(path, DType::kUnspecified, 2), &fs);
    ASSERT_TRUE(ds.ok()) << ds.status();
    const DType want = std::string(path) == "/t16.npy" ? DType::kUInt16 : DType::kUInt32;
    EXPECT_EQ((*ds)->tensors()[0].dtype, want) << path;
    EXPECT_EQ((*ds)->num_samples(), 50u);
    // Sample 3: tokens 6..8, read after the header, not from byte 0.
    const std::string& raw = want == DType::kUInt16 ? raw16 : raw32;
    const size_t w = want == DType::kUInt16 ? 2 : 4;
    EXPECT_EQ(*ReadOne(**ds, 3), raw.substr(6 * w, 3 * w)) << path;
  }
  // A raw file with token_dtype unset is uint16, as before.
  fs.AddFile("/raw", raw16);
  auto raw = OpenDataset(TokensSpec("/raw", DType::kUnspecified, 2), &fs);
  ASSERT_TRUE(raw.ok()) << raw.status();
  EXPECT_EQ((*raw)->tensors()[0].dtype, DType::kUInt16);
}

TEST(TokensNpyTest, AHeaderThatContradictsTokenDtypeIsRefused) {
  FakeFileSystem fs;
  fs.AddFile("/t.npy", NpyFile("<u2", "(101,)", TokenBytes(101, 2)));
  auto ds = OpenDataset(TokensSpec("/t.npy", DType::kUInt32, 2), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "dataset.token_dtype: uint32");
  EXPECT_THAT(ds.status().message(), HasSubstr("/t.npy is a .npy array of uint16"));
  EXPECT_THAT(ds.status().message(), HasSubstr("set it to uint16"));
}

TEST(TokensNpyTest, AFloatOrSignedNpyIsNotTokens) {
  FakeFileSystem fs;
  fs.AddFile("/f.npy", NpyFile("<f4", "(100,)", std::string(400, '\0')));
  fs.AddFile("/i.npy", NpyFile("<i8", "(100,)", std::string(800, '\0')));
  auto f = OpenDataset(TokensSpec("/f.npy", DType::kUnspecified, 2), &fs);
  ExpectError(f, absl::StatusCode::kInvalidArgument, "/f.npy is a .npy array of float32");
  EXPECT_THAT(f.status().message(), HasSubstr("tokens must be uint16 or uint32"));
  ExpectError(OpenDataset(TokensSpec("/i.npy", DType::kUInt16, 2), &fs),
              absl::StatusCode::kInvalidArgument, "/i.npy is a .npy array of int64");
}

TEST(TokensNpyTest, ATruncatedNpyIsRefusedNamingTheCounts) {
  FakeFileSystem fs;
  fs.AddFile("/t.npy", NpyFile("<u2", "(101,)", TokenBytes(90, 2)));
  auto ds = OpenDataset(TokensSpec("/t.npy", DType::kUnspecified, 2), &fs);
  ExpectError(ds, absl::StatusCode::kInvalidArgument, "/t.npy is truncated");
  EXPECT_THAT(ds.status().message(), HasSubstr("promises 101 tokens, the file holds 90"));
}

DatasetSpec WithVocabulary(DatasetSpec spec, uint64_t vocab_size) {
  spec.vocab_size = vocab_size;
  return spec;
}

// A uint16 file read as uint32, and float32 data read as tokens, show tokens no vocabulary
// has: with vocab_size declared they are refused at open, naming the token and its index.
TEST(TokensVocabularyTest, WrongTokenDtypeIsCaughtByTheVocabularyCheck) {
  FakeFileSystem fs;
  std::string gpt2;  // uint16 tokens below GPT-2's 50257
  for (uint32_t t = 0; t < 100000; ++t) {
    const uint16_t v = static_cast<uint16_t>((t * 7919u) % 50257u);
    gpt2.append(reinterpret_cast<const char*>(&v), 2);
  }
  fs.AddFile("/gpt2.bin", gpt2);
  EXPECT_TRUE(OpenDataset(WithVocabulary(TokensSpec("/gpt2.bin", DType::kUInt16, 64), 50257), &fs).ok());
  auto wide = OpenDataset(WithVocabulary(TokensSpec("/gpt2.bin", DType::kUInt32, 64), 50257), &fs);
  ExpectError(wide, absl::StatusCode::kInvalidArgument, "dataset.vocab_size: /gpt2.bin holds token ");
  EXPECT_THAT(wide.status().message(), HasSubstr("not below vocab_size 50257 (read as uint32)"));
  EXPECT_THAT(wide.status().message(), HasSubstr("is token_dtype right?"));

  std::string floats;
  for (int i = 0; i < 4096; ++i) {
    const float f = 1.0f + static_cast<float>(i) / 4096;
    floats.append(reinterpret_cast<const char*>(&f), 4);
  }
  fs.AddFile("/floats.bin", floats);
  ExpectError(OpenDataset(WithVocabulary(TokensSpec("/floats.bin", DType::kUInt32, 8), 50257), &fs),
              absl::StatusCode::kInvalidArgument, "dataset.vocab_size: /floats.bin holds token 1065353216 at index 0");
  // Without vocab_size nothing is checked (the raw file cannot say).
  EXPECT_TRUE(OpenDataset(TokensSpec("/floats.bin", DType::kUInt32, 8), &fs).ok());
}

// The sample reaches the end of the file: a bad token in the last span is found.
TEST(TokensVocabularyTest, TheLastTokensAreSampledToo) {
  FakeFileSystem fs;
  std::string bytes(2 * 300000, '\0');
  const uint16_t big = 60000;
  std::memcpy(bytes.data() + bytes.size() - 2, &big, 2);
  fs.AddFile("/t.bin", bytes);
  ExpectError(OpenDataset(WithVocabulary(TokensSpec("/t.bin", DType::kUInt16, 64), 50257), &fs),
              absl::StatusCode::kInvalidArgument, "holds token 60000 at index 299999");
}

}  // namespace
}  // namespace gpufeed::server
