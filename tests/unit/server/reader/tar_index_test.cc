// The tar index (WebDataset shards): ustar, the prefix field, GNU long names, pax paths,
// base-256 sizes, skipped non-regular members, and malformed archives refused naming the
// shard and the member or offset; brace expansion of shard patterns.
#include "server/reader/tar_index.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/reader/shards.h"
#include "tests/testing/tar_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::TarEnd;
using ::gpufeed::testing::TarFile;
using ::gpufeed::testing::TarGnuLongName;
using ::gpufeed::testing::TarHeaderBlock;
using ::gpufeed::testing::TarHeaderSpec;
using ::gpufeed::testing::TarMemberBytes;
using ::gpufeed::testing::TarPaxPath;
using ::gpufeed::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

struct Indexed {
  absl::StatusOr<std::vector<TarMember>> members;
  std::string path;
  std::string bytes;
};

Indexed Index(const TempDir& dir, const std::string& bytes, FolderWalkLimits limits = {}) {
  Indexed out;
  out.path = dir.WriteFile("shard.tar", bytes);
  out.bytes = bytes;
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = PosixFileSystem()->OpenForRead(out.path);
  EXPECT_TRUE(file.ok()) << file.status();
  WalkBudget budget(limits, out.path, "indexing");
  out.members = IndexTar(**file, out.path, &budget);
  return out;
}

std::vector<std::string> Paths(const std::vector<TarMember>& members) {
  std::vector<std::string> out;
  for (const TarMember& m : members) out.push_back(m.path);
  return out;
}

TEST(TarIndexTest, UstarMembersWithTheirOffsetsAndSizes) {
  TempDir dir;
  const std::string big(700, 'b');
  TarHeaderSpec d{"dir/"};
  d.type = '5';
  const Indexed t = Index(dir, TarFile("a.txt", "hello") + TarMemberBytes(d, "") +
                                   TarFile("dir/b.bin", big) + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  ASSERT_THAT(Paths(*t.members), ElementsAre("a.txt", "dir/b.bin"));
  const TarMember& a = (*t.members)[0];
  const TarMember& b = (*t.members)[1];
  EXPECT_EQ(a.offset, 512u);
  EXPECT_EQ(a.size, 5u);
  EXPECT_EQ(a.data, "hello");  // small: read with its header
  EXPECT_EQ(b.offset, 512u * 4);
  EXPECT_EQ(b.size, 700u);
  EXPECT_EQ(b.data, "");  // larger than kTarInlineBytes
  EXPECT_EQ(t.bytes.substr(b.offset, b.size), big);
}

TEST(TarIndexTest, ThePrefixFieldOfPosixUstarButNotOfGnu) {
  TempDir dir;
  TarHeaderSpec posix{"x.jpg"};
  posix.prefix = "a/long/directory";
  TarHeaderSpec gnu{"y.jpg"};
  gnu.gnu = true;
  gnu.prefix = "ignored";  // GNU keeps times there; the builder writes none for GNU
  const Indexed t = Index(dir, TarMemberBytes(posix, "1") + TarMemberBytes(gnu, "2") + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  EXPECT_THAT(Paths(*t.members), ElementsAre("a/long/directory/x.jpg", "y.jpg"));
}

TEST(TarIndexTest, GnuLongNamesAndPaxPathsNameTheNextMember) {
  TempDir dir;
  const std::string long_name = std::string(150, 'd') + "/sample000001.jpg";
  const std::string pax_name = std::string(120, 'p') + "/sample000002.cls";
  const Indexed t = Index(dir, TarGnuLongName(long_name, "jpeg bytes") + TarPaxPath(pax_name, "7") +
                                   TarFile("plain.txt", "x") + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  ASSERT_THAT(Paths(*t.members), ElementsAre(long_name, pax_name, "plain.txt"));
  EXPECT_EQ(t.bytes.substr((*t.members)[0].offset, (*t.members)[0].size), "jpeg bytes");
  EXPECT_EQ((*t.members)[1].data, "7");
}

TEST(TarIndexTest, APaxSizeOverridesTheHeaderSize) {
  TempDir dir;
  TarHeaderSpec x{"PaxHeaders/big"};
  x.type = 'x';
  TarHeaderSpec m{"big.bin"};
  m.size = 0;  // as a writer leaves it when the size does not fit the field
  const std::string data(1000, 'z');
  const Indexed t = Index(dir, TarMemberBytes(x, testing::PaxRecord("size", "1000")) +
                                   TarHeaderBlock(m) + testing::TarPadded(data) + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  ASSERT_EQ(t.members->size(), 1u);
  EXPECT_EQ((*t.members)[0].size, 1000u);
}

TEST(TarIndexTest, NonRegularMembersAreSkipped) {
  TempDir dir;
  std::string bytes;
  for (char type : {'1', '2', '3', '4', '5', '6', 'K', 'g'}) {
    TarHeaderSpec h{std::string("other.") + type};
    h.type = type;
    bytes += TarMemberBytes(h, type == 'g' ? testing::PaxRecord("comment", "c") : "");
  }
  TarHeaderSpec old{"old.jpg"};
  old.type = '\0';  // pre-POSIX regular file
  TarHeaderSpec contiguous{"c.jpg"};
  contiguous.type = '7';
  const Indexed t =
      Index(dir, bytes + TarMemberBytes(old, "o") + TarMemberBytes(contiguous, "c") + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  EXPECT_THAT(Paths(*t.members), ElementsAre("old.jpg", "c.jpg"));
}

TEST(TarIndexTest, Base256Sizes) {
  TempDir dir;
  TarHeaderSpec h{"b256.bin"};
  h.base256 = true;
  h.gnu = true;
  const std::string data(700, 'q');
  const Indexed t = Index(dir, TarMemberBytes(h, data) + TarEnd());
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  ASSERT_EQ(t.members->size(), 1u);
  EXPECT_EQ((*t.members)[0].size, 700u);

  std::string negative = TarHeaderBlock(h);
  negative[124] = static_cast<char>(0xff);
  absl::StatusOr<std::optional<TarHeader>> parsed =
      ParseTarHeader(std::as_bytes(std::span<const char>(negative.data(), 512)));
  // The checksum no longer matches either; either way it is refused.
  EXPECT_FALSE(parsed.ok());
}

TEST(TarIndexTest, ABadChecksumIsRefusedNamingTheShardAndOffset) {
  TempDir dir;
  const Indexed t = Index(dir, TarFile("a.jpg", "1") + TarHeaderBlock({"b.jpg", 1}, 1) +
                                   testing::TarPadded("2") + TarEnd());
  ASSERT_EQ(t.members.status().code(), absl::StatusCode::kInvalidArgument) << t.members.status();
  EXPECT_THAT(t.members.status().message(), HasSubstr(t.path));
  EXPECT_THAT(t.members.status().message(), HasSubstr("header at byte 1024 (after member a.jpg)"));
  EXPECT_THAT(t.members.status().message(), HasSubstr("checksum"));
}

TEST(TarIndexTest, NotATarIsRefusedAtItsFirstHeader) {
  TempDir dir;
  const Indexed t = Index(dir, std::string("\x1f\x8b\x08\x00", 4) + std::string(2000, 'g'));
  ASSERT_EQ(t.members.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.members.status().message(), HasSubstr("header at byte 0"));
}

TEST(TarIndexTest, ATruncatedMemberIsDataLossNamingIt) {
  TempDir dir;
  const std::string whole = TarFile("a.jpg", "1") + TarFile("b.jpg", std::string(3000, 'x'));
  const Indexed t = Index(dir, whole.substr(0, 1024 + 512 + 100));
  ASSERT_EQ(t.members.status().code(), absl::StatusCode::kDataLoss) << t.members.status();
  EXPECT_THAT(t.members.status().message(), HasSubstr(t.path));
  EXPECT_THAT(t.members.status().message(), HasSubstr("member b.jpg (header at byte 1024)"));
  EXPECT_THAT(t.members.status().message(), HasSubstr("truncated"));
}

TEST(TarIndexTest, ATruncatedHeaderIsDataLoss) {
  TempDir dir;
  const Indexed t = Index(dir, TarFile("a.jpg", "1") + std::string(100, 'h'));
  ASSERT_EQ(t.members.status().code(), absl::StatusCode::kDataLoss) << t.members.status();
  EXPECT_THAT(t.members.status().message(), HasSubstr("header at byte 1024 is cut"));
}

TEST(TarIndexTest, AnArchiveWithoutEndBlocksOrWithCutPaddingReadsWhole) {
  TempDir dir;
  const std::string whole = TarFile("a.jpg", "1") + TarFile("b.jpg", "22");
  const Indexed t = Index(dir, whole.substr(0, whole.size() - 400));  // b's padding cut
  ASSERT_TRUE(t.members.ok()) << t.members.status();
  EXPECT_THAT(Paths(*t.members), ElementsAre("a.jpg", "b.jpg"));
}

TEST(TarIndexTest, TheMemberCountIsBounded) {
  TempDir dir;
  FolderWalkLimits limits;
  limits.max_entries = 2;
  const Indexed t = Index(dir, TarFile("a", "1") + TarFile("b", "2") + TarFile("c", "3"), limits);
  ASSERT_EQ(t.members.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(t.members.status().message(), HasSubstr("max_folder_entries"));
}

TEST(TarIndexTest, MalformedPaxRecordsAreRefused) {
  std::optional<std::string> path;
  std::optional<uint64_t> size;
  EXPECT_TRUE(ApplyPaxRecords("", &path, &size).ok());
  EXPECT_FALSE(ApplyPaxRecords("99 path=x\n", &path, &size).ok());   // longer than given
  EXPECT_FALSE(ApplyPaxRecords("9 pathx\n", &path, &size).ok());     // no '='
  EXPECT_FALSE(ApplyPaxRecords("x path=y\n", &path, &size).ok());    // no length
  EXPECT_FALSE(ApplyPaxRecords("11 size=zz\n", &path, &size).ok());  // no number
  ASSERT_TRUE(ApplyPaxRecords("11 path=ab\n12 size=100\n", &path, &size).ok());
  EXPECT_EQ(path, "ab");
  EXPECT_EQ(size, 100u);
}

TEST(BraceExpansionTest, RangesListsAndProducts) {
  EXPECT_THAT(
      *ExpandBraces("train-{000000..000003}.tar"),
      ElementsAre("train-000000.tar", "train-000001.tar", "train-000002.tar", "train-000003.tar"));
  EXPECT_THAT(*ExpandBraces("{8..11}"), ElementsAre("8", "9", "10", "11"));
  EXPECT_THAT(*ExpandBraces("{3..1}"), ElementsAre("3", "2", "1"));
  EXPECT_THAT(*ExpandBraces("{08..10}"), ElementsAre("08", "09", "10"));
  EXPECT_THAT(*ExpandBraces("{a,b}-{1..2}.tar"),
              ElementsAre("a-1.tar", "a-2.tar", "b-1.tar", "b-2.tar"));
  EXPECT_THAT(*ExpandBraces("{a,b{c,d}}"), ElementsAre("a", "bc", "bd"));
  EXPECT_THAT(*ExpandBraces("x{y}z"), ElementsAre("x{y}z"));
  EXPECT_THAT(*ExpandBraces("{,x}y"), ElementsAre("y", "xy"));
  EXPECT_THAT(*ExpandBraces("plain.tar"), ElementsAre("plain.tar"));
}

TEST(BraceExpansionTest, TheSizeIsCappedBeforeTheNamesAreMade) {
  absl::StatusOr<std::vector<std::string>> r = ExpandBraces("{0..2000000}");
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("more than 1048576"));
  r = ExpandBraces("{0..999}{0..9999}.tar");
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("more than 1048576 names"));
  r = ExpandBraces("{a,b}{c,d}", 3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  r = ExpandBraces("train-{0..3.tar");
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("no matching '}'"));
}

}  // namespace
}  // namespace gpufeed::server
