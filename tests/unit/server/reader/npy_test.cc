#include "server/reader/npy.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/npy_builder.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::NpyFile;
using ::gpufeed::testing::NpyHeaderBytes;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::StatusOr<NpyHeader> Parse(const std::string& bytes) { return ParseNpyHeader(bytes); }

std::string Dict(const std::string& descr, const std::string& fortran, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

TEST(NpyHeaderBuilderTest, MatchesWhatNumpyWrites) {
  // np.save of np.zeros(10, np.uint8) writes exactly these 128 header bytes.
  const std::string h = NpyHeaderBytes(Dict("|u1", "False", "(10,)"));
  const std::string dict = "{'descr': '|u1', 'fortran_order': False, 'shape': (10,), }";
  ASSERT_EQ(h.size(), 128u);
  EXPECT_EQ(h.substr(0, 10), std::string("\x93NUMPY\x01\x00\x76\x00", 10));
  EXPECT_EQ(h.substr(10, dict.size()), dict);
  EXPECT_EQ(h.substr(10 + dict.size(), 128 - 10 - dict.size() - 1),
            std::string(128 - 10 - dict.size() - 1, ' '));
  EXPECT_EQ(h.back(), '\n');
}

TEST(NpyTest, ParsesVersion1Uint8Vector) {
  const std::string file = NpyHeaderBytes(Dict("<u1", "False", "(10,)"));
  absl::StatusOr<NpyHeader> h = Parse(file + std::string(10, '\0'));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kUInt8);
  EXPECT_THAT(h->shape, ElementsAre(10));
  EXPECT_FALSE(h->fortran_order);
  EXPECT_EQ(h->data_offset, file.size());
  EXPECT_EQ(h->data_offset % 64, 0u);
}

TEST(NpyTest, ParsesFloat32ThreeDims) {
  const std::string file = NpyHeaderBytes(Dict("<f4", "False", "(5, 3, 2)"));
  absl::StatusOr<NpyHeader> h = Parse(file);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kFloat32);
  EXPECT_THAT(h->shape, ElementsAre(5, 3, 2));
  EXPECT_EQ(h->data_offset, 128u);
}

TEST(NpyTest, ParsesEachSupportedDescr) {
  const struct {
    const char* descr;
    DType dtype;
  } cases[] = {
      {"|b1", DType::kBool},    {"|i1", DType::kInt8},      {"|u1", DType::kUInt8},
      {"<u1", DType::kUInt8},   {"<i2", DType::kInt16},     {"<u2", DType::kUInt16},
      {"<i4", DType::kInt32},   {"<u4", DType::kUInt32},    {"<i8", DType::kInt64},
      {"<u8", DType::kUInt64},  {"<f2", DType::kFloat16},   {"<f4", DType::kFloat32},
      {"<f8", DType::kFloat64}, {"<c8", DType::kComplex64}, {"<c16", DType::kComplex128},
  };
  for (const auto& c : cases) {
    absl::StatusOr<NpyHeader> h = Parse(NpyHeaderBytes(Dict(c.descr, "False", "(3,)")));
    ASSERT_TRUE(h.ok()) << c.descr << ": " << h.status();
    EXPECT_EQ(h->dtype, c.dtype) << c.descr;
  }
}

TEST(NpyTest, ParsesShapeSpellings) {
  const struct {
    const char* shape;
    std::vector<int64_t> dims;
  } cases[] = {
      {"(7,)", {7}},
      {"(7, )", {7}},
      {"( 7 , )", {7}},
      {"(5, 3, 2)", {5, 3, 2}},
      {"(5,3,2)", {5, 3, 2}},
      {"(5, 3, 2,)", {5, 3, 2}},
      {"(  4 ,  1  )", {4, 1}},
      {"(0,)", {0}},
      {"(123456789012,)", {123456789012}},
  };
  for (const auto& c : cases) {
    absl::StatusOr<NpyHeader> h = Parse(NpyHeaderBytes(Dict("<i8", "False", c.shape)));
    ASSERT_TRUE(h.ok()) << c.shape << ": " << h.status();
    EXPECT_EQ(h->shape, c.dims) << c.shape;
    EXPECT_EQ(h->dtype, DType::kInt64);
  }
}

TEST(NpyTest, ParsesKeysInAnyOrderAndDoubleQuotes) {
  const std::string dict = "{\"shape\": (2, 2), \"fortran_order\": False, \"descr\": \"<c8\"}";
  absl::StatusOr<NpyHeader> h = Parse(NpyHeaderBytes(dict));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kComplex64);
  EXPECT_THAT(h->shape, ElementsAre(2, 2));
}

// A 1.0 header of 300 bytes or more (numpy pads the dict to the data's 64-byte boundary; a
// long shape or a writer's extra padding gets there): both bytes of its uint16 length count.
TEST(NpyTest, ParsesVersion1WithAHeaderOverAByteLong) {
  const std::string file =
      NpyHeaderBytes(Dict("<i4", "False", "(7, 2)"), /*major=*/1, /*min_header_len=*/300);
  const uint32_t len = static_cast<uint32_t>(static_cast<unsigned char>(file[8])) |
                       static_cast<uint32_t>(static_cast<unsigned char>(file[9])) << 8;
  ASSERT_GE(len, 300u);
  ASSERT_EQ(file.size(), 10u + len);
  absl::StatusOr<NpyHeader> h = Parse(file + std::string(56, '\0'));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kInt32);
  EXPECT_THAT(h->shape, ElementsAre(7, 2));
  EXPECT_EQ(h->data_offset, file.size());
}

// Byte order means nothing for a 1-byte dtype: numpy writes '|u1', and np.load reads '>u1'
// and '<u1' as uint8 too; so do we. Wider big-endian dtypes stay refused (RejectsBigEndian).
TEST(NpyTest, ParsesAnyByteOrderOfOneByteDtypes) {
  const struct {
    const char* descr;
    DType dtype;
  } cases[] = {
      {">u1", DType::kUInt8},
      {"=u1", DType::kUInt8},
      {">i1", DType::kInt8},
      {">b1", DType::kBool},
  };
  for (const auto& c : cases) {
    absl::StatusOr<NpyHeader> h = Parse(NpyHeaderBytes(Dict(c.descr, "False", "(3,)")));
    ASSERT_TRUE(h.ok()) << c.descr << ": " << h.status();
    EXPECT_EQ(h->dtype, c.dtype) << c.descr;
  }
}

TEST(NpyTest, ParsesVersion2WithUint32Length) {
  const std::string file = NpyHeaderBytes(Dict("<f4", "False", "(5, 3, 2)"), /*major=*/2);
  ASSERT_EQ(file.substr(0, 8), std::string("\x93NUMPY\x02\x00", 8));
  absl::StatusOr<NpyHeader> h = Parse(file + "data");
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kFloat32);
  EXPECT_THAT(h->shape, ElementsAre(5, 3, 2));
  EXPECT_EQ(h->data_offset, file.size());
  EXPECT_EQ(h->data_offset % 64, 0u);
}

TEST(NpyTest, ParsesVersion2WithLongHeader) {
  // A header longer than 64 KiB cannot be written as 1.0: numpy switches to 2.0. Build one
  // with 70000 bytes of padding; the uint32 length must be read in full.
  std::string dict = Dict("<u2", "False", "(9,)");
  const std::string file = NpyHeaderBytes(dict, /*major=*/2, /*min_header_len=*/70000);
  const uint32_t len = static_cast<uint32_t>(static_cast<unsigned char>(file[8])) |
                       static_cast<uint32_t>(static_cast<unsigned char>(file[9])) << 8 |
                       static_cast<uint32_t>(static_cast<unsigned char>(file[10])) << 16 |
                       static_cast<uint32_t>(static_cast<unsigned char>(file[11])) << 24;
  ASSERT_GT(len, 65535u);
  absl::StatusOr<NpyHeader> h = Parse(file);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kUInt16);
  EXPECT_EQ(h->data_offset, 12u + len);
}

TEST(NpyTest, ParsesVersion3) {
  absl::StatusOr<NpyHeader> h = Parse(NpyHeaderBytes(Dict("<i4", "False", "(1,)"), 3));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->dtype, DType::kInt32);
}

// ---- refusals: all INVALID_ARGUMENT ----

void ExpectInvalid(const std::string& bytes, const std::string& substring) {
  absl::StatusOr<NpyHeader> h = Parse(bytes);
  ASSERT_FALSE(h.ok()) << "accepted: " << bytes;
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_THAT(h.status().message(), HasSubstr(substring));
}

TEST(NpyTest, RejectsBadMagic) {
  std::string file = NpyHeaderBytes(Dict("<f4", "False", "(3,)"));
  file[1] = 'n';
  ExpectInvalid(file, "magic");
  ExpectInvalid("", "magic");
  ExpectInvalid("\x93NUMP", "magic");
  ExpectInvalid("PK\x03\x04 this is a zip file", "magic");
}

TEST(NpyTest, RejectsUnknownVersion) {
  std::string file = NpyHeaderBytes(Dict("<f4", "False", "(3,)"));
  file[6] = 9;
  ExpectInvalid(file, "version 9");
  file[6] = 0;
  ExpectInvalid(file, "version 0");
}

TEST(NpyTest, RejectsHeaderLongerThanPrefix) {
  const std::string file = NpyHeaderBytes(Dict("<f4", "False", "(3,)"));
  ExpectInvalid(file.substr(0, file.size() - 1), "past");
  ExpectInvalid(file.substr(0, 20), "past");
  // Version 2 needs 12 fixed bytes.
  const std::string v2 = NpyHeaderBytes(Dict("<f4", "False", "(3,)"), 2);
  ExpectInvalid(v2.substr(0, 11), "truncated");
  ExpectInvalid(v2.substr(0, 40), "past");
  // A 4 GiB length in a version 2 header does not overflow anything.
  std::string huge = v2;
  huge[8] = huge[9] = huge[10] = huge[11] = '\xff';
  ExpectInvalid(huge, "4294967295");
}

TEST(NpyTest, RejectsFortranOrder) {
  ExpectInvalid(NpyHeaderBytes(Dict("<f4", "True", "(3, 2)")), "Fortran");
}

TEST(NpyTest, RejectsObjectDtypeO8) {
  // '|O8' (an older spelling of the object dtype) reaches the object check.
  ExpectInvalid(NpyHeaderBytes(Dict("|O8", "False", "(3,)")), "object");
}

TEST(NpyTest, RejectsObjectDtype) {
  // numpy writes object arrays with descr '|O' (np.dtype(object).str == '|O'): two
  // characters, shorter than any numeric descr, and still reported as an object dtype.
  ExpectInvalid(NpyHeaderBytes(Dict("|O", "False", "(3,)")), "object");
  ExpectInvalid(NpyHeaderBytes(Dict("|O", "False", "(3,)")), "fixed-size numeric");
}

TEST(NpyTest, RejectsStructuredDtype) {
  const std::string dict =
      "{'descr': [('a', '<i4'), ('b', '<f8')], 'fortran_order': False, 'shape': (3,), }";
  ExpectInvalid(NpyHeaderBytes(dict), "structured");
}

TEST(NpyTest, RejectsBigEndian) {
  ExpectInvalid(NpyHeaderBytes(Dict(">f4", "False", "(3,)")), "big-endian");
  ExpectInvalid(NpyHeaderBytes(Dict(">i8", "False", "(3,)")), "big-endian");
  ExpectInvalid(NpyHeaderBytes(Dict(">u2", "False", "(3,)")), "big-endian");
}

TEST(NpyTest, RejectsStringAndOtherDtypes) {
  ExpectInvalid(NpyHeaderBytes(Dict("<U10", "False", "(3,)")), "<U10");
  ExpectInvalid(NpyHeaderBytes(Dict("|S5", "False", "(3,)")), "|S5");
  ExpectInvalid(NpyHeaderBytes(Dict("<M8[ns]", "False", "(3,)")), "<M8[ns]");
  ExpectInvalid(NpyHeaderBytes(Dict("<f3", "False", "(3,)")), "<f3");
  ExpectInvalid(NpyHeaderBytes(Dict("<u", "False", "(3,)")), "<u");
  ExpectInvalid(NpyHeaderBytes(Dict("", "False", "(3,)")), "descr");
  ExpectInvalid(NpyHeaderBytes(Dict("!f4", "False", "(3,)")), "!f4");
}

TEST(NpyTest, RejectsZeroDimensionalArray) {
  ExpectInvalid(NpyHeaderBytes(Dict("<f4", "False", "()")), "0-d");
}

TEST(NpyTest, RejectsMissingKeys) {
  ExpectInvalid(NpyHeaderBytes("{'fortran_order': False, 'shape': (3,), }"), "descr");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'shape': (3,), }"), "fortran_order");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, }"), "shape");
  ExpectInvalid(NpyHeaderBytes("{}"), "descr");
}

TEST(NpyTest, RejectsWrongValueKinds) {
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': 0, 'shape': (3,), }"),
                "fortran_order");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, 'shape': 3, }"), "shape");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-3,), }"),
                "non-negative");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3.5,), }"),
                "unterminated tuple");
  ExpectInvalid(NpyHeaderBytes(
                    "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }"),
                "non-negative integers");
}

TEST(NpyTest, RejectsMalformedText) {
  ExpectInvalid(NpyHeaderBytes("{'descr: '<f4', 'fortran_order': False, 'shape': (3,)}"),
                "malformed");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4, 'fortran_order': False, 'shape': (3,)"),
                "malformed");
  ExpectInvalid(NpyHeaderBytes("{'descr"), "unterminated string");
  ExpectInvalid(NpyHeaderBytes("'descr': '<f4', 'fortran_order': False, 'shape': (3,)"),
                "expected '{'");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,)"),
                "expected '}'");
  ExpectInvalid(NpyHeaderBytes("{'descr' '<f4'}"), "expected ':'");
  ExpectInvalid(NpyHeaderBytes("{descr: '<f4'}"), "quoted string");
  ExpectInvalid(NpyHeaderBytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3,"), "tuple");
  ExpectInvalid(NpyHeaderBytes(""), "expected '{'");
}

TEST(NpyFileBuilderTest, AppendsDataAfterHeader) {
  const std::string file = NpyFile("<i4", "(2, 3)", std::string(24, 'z'));
  absl::StatusOr<NpyHeader> h = Parse(file);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(file.size(), h->data_offset + 24);
  EXPECT_THAT(h->shape, ElementsAre(2, 3));
  EXPECT_EQ(file.substr(h->data_offset), std::string(24, 'z'));
}

}  // namespace
}  // namespace gpufeed::server
