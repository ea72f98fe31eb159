// Records of several arrays: named .npy files of one directory, one tensor each,
// sample i = row i of every array; unequal row counts, bad names and bad files refused.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/os/fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/feed/feed.h"
#include "server/images/dataset.h"
#include "tests/testing/npy_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::NpyFile;
using ::gpufeed::testing::TempDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// n little-endian values of `width` bytes: value k of the array is base + k, so a row read
// from the wrong array, offset or length shows.
std::string Values(int64_t n, int width, uint64_t base) {
  std::string out;
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t v = base + static_cast<uint64_t>(k);
    for (int b = 0; b < width; ++b) out += static_cast<char>((v >> (8 * b)) & 0xff);
  }
  return out;
}

DatasetSpec Arrays(const std::string& dir, std::vector<RecordArraySpec> arrays) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kRecords;
  spec.path = dir;
  spec.arrays = std::move(arrays);
  return spec;
}

// Sample `id`'s rows, one string per tensor.
std::vector<std::string> Rows(const Dataset& ds, uint64_t id) {
  std::vector<std::string> rows;
  std::vector<std::span<std::byte>> spans;
  for (const SampleTensor& t : ds.tensors()) rows.emplace_back(t.byte_size, '\xEE');
  for (std::string& r : rows) {
    spans.emplace_back(reinterpret_cast<std::byte*>(r.data()), r.size());
  }
  EXPECT_TRUE(ds.ReadSample(id, spans).ok());
  return rows;
}

class RecordArraysTest : public ::testing::Test {
 protected:
  // x: float32 [N, 3, 4] (4-byte values), y: int64 [N].
  void WriteXY(int64_t nx, int64_t ny) {
    x_ = Values(nx * 12, 4, 1000);
    y_ = Values(ny, 8, 7);
    dir_.WriteFile("x.npy", NpyFile("<f4", absl::StrCat("(", nx, ", 3, 4)"), x_));
    dir_.WriteFile("y.npy", NpyFile("<i8", absl::StrCat("(", ny, ",)"), y_));
  }

  TempDir dir_;
  std::string x_, y_;
};

TEST_F(RecordArraysTest, EqualLengthsGiveOneTensorEachWithItsOwnDtypeAndShape) {
  WriteXY(10, 10);
  auto ds = OpenDataset(Arrays(dir_.path(), {{"x", "x.npy"}, {"y", "y.npy"}}), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->num_samples(), 10u);
  ASSERT_EQ((*ds)->tensors().size(), 2u);
  const SampleTensor& x = (*ds)->tensors()[0];
  const SampleTensor& y = (*ds)->tensors()[1];
  EXPECT_EQ(x.name, "x");
  EXPECT_EQ(x.dtype, DType::kFloat32);
  EXPECT_THAT(x.shape, ElementsAre(3, 4));
  EXPECT_EQ(x.byte_size, 48u);
  EXPECT_EQ(y.name, "y");
  EXPECT_EQ(y.dtype, DType::kInt64);
  EXPECT_TRUE(y.shape.empty());
  EXPECT_EQ(y.byte_size, 8u);
  for (uint64_t id : {0u, 3u, 9u}) {
    const std::vector<std::string> rows = Rows(**ds, id);
    EXPECT_EQ(rows[0], x_.substr(id * 48, 48)) << id;
    EXPECT_EQ(rows[1], y_.substr(id * 8, 8)) << id;
  }
  EXPECT_TRUE((*ds)->CheckNotShrunk().ok());
}

TEST_F(RecordArraysTest, TensorsFollowTheGivenOrder) {
  WriteXY(4, 4);
  auto ds = OpenDataset(Arrays(dir_.path(), {{"label", "y.npy"}, {"features", "x.npy"}}),
                        PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ((*ds)->tensors()[0].name, "label");
  EXPECT_EQ((*ds)->tensors()[1].name, "features");
  EXPECT_EQ(Rows(**ds, 2)[0], y_.substr(16, 8));
}

TEST_F(RecordArraysTest, ThroughTheDirectoryDescriptorTheClientPassed) {
  WriteXY(5, 5);
  UniqueFd fd(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  DatasetSpec spec = Arrays("/display/name", {{"x", "x.npy"}, {"y", "y.npy"}});
  spec.fd = fd.get();
  auto ds = OpenDataset(spec, MappedFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(Rows(**ds, 4)[1], y_.substr(32, 8));
  // A regular file's descriptor is no directory of arrays.
  UniqueFd file(::open(dir_.Join("x.npy").c_str(), O_RDONLY | O_CLOEXEC));
  spec.fd = file.get();
  auto refused = OpenDataset(spec, PosixFileSystem());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("not a directory"));
}

TEST_F(RecordArraysTest, UnequalLengthsAreRefusedNamingBothFilesAndLengths) {
  WriteXY(10, 9);
  auto ds = OpenDataset(Arrays(dir_.path(), {{"x", "x.npy"}, {"y", "y.npy"}}), PosixFileSystem());
  ASSERT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(),
              AllOf(HasSubstr("dataset.arrays"), HasSubstr(dir_.Join("x.npy")),
                    HasSubstr("has 10 rows"), HasSubstr(dir_.Join("y.npy")), HasSubstr("has 9")));
}

TEST_F(RecordArraysTest, BadNamesAreRefusedNamingTheEntry) {
  WriteXY(3, 3);
  struct Case {
    std::vector<RecordArraySpec> arrays;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{{"", "x.npy"}}, "dataset.arrays[0].name: ''"},
      {{{"x", "x.npy"}, {"1y", "y.npy"}}, "dataset.arrays[1].name: '1y'"},
      {{{"x-y", "x.npy"}}, "dataset.arrays[0].name: 'x-y'"},
      {{{"x\n", "x.npy"}}, "dataset.arrays[0].name: 'x\\n'"},
      {{{std::string(65, 'a'), "x.npy"}}, "...' is not a tensor name"},
      {{{"x", "x.npy"}, {"x", "y.npy"}}, "dataset.arrays[1].name: 'x' names dataset.arrays[0]"},
      {{{"x", ""}}, "dataset.arrays[0].file (x): ''"},
      {{{"x", "../x.npy"}}, "dataset.arrays[0].file (x): '../x.npy'"},
      {{{"x", ".."}}, "dataset.arrays[0].file (x): '..'"},
      {{{"x", std::string("x\0y", 3)}}, "dataset.arrays[0].file (x): 'x\\x00y'"},
      {{{"x", std::string(256, 'f')}}, "is not a file name"},
  };
  for (const Case& c : cases) {
    auto ds = OpenDataset(Arrays(dir_.path(), c.arrays), PosixFileSystem());
    EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(ds.status().message(), HasSubstr(c.want));
  }
  std::vector<RecordArraySpec> many;
  for (size_t i = 0; i <= kMaxRecordArrays; ++i) many.push_back({absl::StrCat("a", i), "x.npy"});
  auto ds = OpenDataset(Arrays(dir_.path(), many), PosixFileSystem());
  EXPECT_THAT(ds.status().message(), HasSubstr("33 arrays, at most 32"));
  // One file may well serve two tensors.
  auto twice =
      OpenDataset(Arrays(dir_.path(), {{"a", "y.npy"}, {"b", "y.npy"}}), PosixFileSystem());
  EXPECT_TRUE(twice.ok()) << twice.status();
}

TEST_F(RecordArraysTest, BadFilesAreRefusedNamingTheArray) {
  WriteXY(3, 3);
  dir_.WriteFile("big_endian.npy", NpyFile(">f4", "(3,)", std::string(12, '\0')));
  dir_.WriteFile("short.npy", NpyFile("<i4", "(3, 2)", std::string(20, '\0')));
  ASSERT_EQ(::symlink("/etc/passwd", dir_.Join("outside.npy").c_str()), 0);
  struct Case {
    std::string file;
    absl::StatusCode code;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"missing.npy", absl::StatusCode::kNotFound, "dataset.arrays[1] (b): "},
      {"big_endian.npy", absl::StatusCode::kInvalidArgument, "big_endian.npy: "},
      {"short.npy", absl::StatusCode::kInvalidArgument, "short.npy is truncated"},
      {"outside.npy", absl::StatusCode::kPermissionDenied, "dataset.arrays[1] (b): "},
  };
  for (const Case& c : cases) {
    auto ds = OpenDataset(Arrays(dir_.path(), {{"a", "x.npy"}, {"b", c.file}}), PosixFileSystem());
    EXPECT_EQ(ds.status().code(), c.code) << c.file << ": " << ds.status();
    EXPECT_THAT(ds.status().message(), HasSubstr(c.want)) << c.file;
  }
  // Arrays are for records only; records of arrays need a directory.
  DatasetSpec tokens = Arrays(dir_.path(), {{"a", "x.npy"}});
  tokens.kind = DatasetKind::kTokens;
  tokens.seq_len = 4;
  EXPECT_THAT(OpenDataset(tokens, PosixFileSystem()).status().message(),
              HasSubstr("dataset.arrays: only for kind records"));
  auto file = OpenDataset(Arrays(dir_.Join("x.npy"), {{"a", "x.npy"}}), PosixFileSystem());
  EXPECT_THAT(file.status().message(), HasSubstr("not a directory"));
}

TEST_F(RecordArraysTest, ShrinkingAnyArrayIsDataLoss) {
  WriteXY(8, 8);
  auto ds = OpenDataset(Arrays(dir_.path(), {{"x", "x.npy"}, {"y", "y.npy"}}), MappedFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ(::truncate(dir_.Join("y.npy").c_str(), 64), 0);
  const absl::Status s = (*ds)->CheckNotShrunk();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("y.npy"));
}

// The feed's fingerprint covers every array: names, files and each file's size and time.
TEST_F(RecordArraysTest, FingerprintCoversEveryArray) {
  WriteXY(6, 6);
  FeedSpec spec;
  spec.dataset = Arrays(dir_.path(), {{"x", "x.npy"}, {"y", "y.npy"}});
  spec.batch_size = 2;
  spec.world_size = 1;
  auto feed = Feed::Create(spec, PosixFileSystem());
  ASSERT_TRUE(feed.ok()) << feed.status();
  const std::string before = (*feed)->fingerprint();
  EXPECT_THAT(before, AllOf(HasSubstr("files=x:x.npy:"), HasSubstr(",y:y.npy:176 bytes:mtime_ns "),
                            HasSubstr("tensors=x:float32[3,4] y:int64[]")));
  // Rewritten with other values, same shape and size: its time differs.
  struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, dir_.Join("y.npy").c_str(), times, 0), 0);
  auto again = Feed::Create(spec, PosixFileSystem());
  ASSERT_TRUE(again.ok()) << again.status();
  const absl::Status differs = CompareFingerprints(before, (*again)->fingerprint());
  EXPECT_EQ(differs.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(differs.message(), AllOf(HasSubstr("files was"), HasSubstr("y:y.npy:")));
  // Another set of arrays over the same directory is another feed.
  FeedSpec other = spec;
  other.dataset.arrays = {{"x", "x.npy"}};
  EXPECT_NE(spec.Canonical(), other.Canonical());
  // File names may hold ',' and ':': no two lists make one key.
  FeedSpec a = spec, b = spec;
  a.dataset.arrays = {{"a", "b,c:d"}};
  b.dataset.arrays = {{"a", "b"}, {"c", "d"}};
  EXPECT_NE(a.Canonical(), b.Canonical());
  // The single-file form keeps its canonical text (no arrays item).
  FeedSpec one = spec;
  one.dataset.arrays.clear();
  EXPECT_THAT(one.Canonical(), ::testing::Not(HasSubstr("arrays")));
}

}  // namespace
}  // namespace gpufeed::server
