#include "server/feed/fingerprint.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::server {
namespace {

using D = FingerprintDifference;

TEST(FingerprintDifferencesTest, NamesEachFieldWithBothSidesInTheFeedsOrder) {
  EXPECT_EQ(FingerprintDifferences("a=1;b=x%3By", "a=1;b=x%3By"), std::vector<D>{});
  EXPECT_EQ(FingerprintDifferences("gone=1;a=1;b=x%3By", "b=x%3By;new=3;a=2"),
            (std::vector<D>{{"new", std::nullopt, "3"}, {"a", "1", "2"},
                            {"gone", "1", std::nullopt}}));
}

TEST(FingerprintDifferencesTest, AnEarlierReleasesShardDirectoryFormIsTheSameFeed) {
  const std::string now =
      "kind=tokens;path=/d;shards=2 files, fnv1a64 ab, mtimes fnv1a64 cd;samples=9";
  // That release: the directory's time, the shard set without its files' times.
  EXPECT_EQ(FingerprintDifferences(
                "kind=tokens;path=/d;mtime_ns=5;shards=2 files, fnv1a64 ab;samples=9", now),
            std::vector<D>{});
  // Another shard set is still another feed, named with the current form.
  EXPECT_EQ(FingerprintDifferences(
                "kind=tokens;path=/d;mtime_ns=5;shards=3 files, fnv1a64 ef;samples=9", now),
            (std::vector<D>{{"shards", "3 files, fnv1a64 ef",
                             "2 files, fnv1a64 ab, mtimes fnv1a64 cd"}}));
  // A single file's saved time is its own, not a directory's: still compared.
  EXPECT_EQ(FingerprintDifferences("path=/f;bytes=8;mtime_ns=5", "path=/f;bytes=8;mtime_ns=6"),
            (std::vector<D>{{"mtime_ns", "5", "6"}}));
}

TEST(FingerprintDifferencesTest, EachKindOfDifferenceHasItsWords) {
  EXPECT_EQ(DescribeDifference({"seq_len", "32", "16"}), "seq_len was 32, is 16");
  EXPECT_EQ(DescribeDifference({"even", std::nullopt, "true"}),
            "even (not in the saved position)");
  EXPECT_EQ(DescribeDifference({"mtime_ns", "5", std::nullopt}),
            "mtime_ns (no longer part of the feed)");
  EXPECT_EQ(DescribeDifference({"sampler", std::nullopt, "feistel1"}),
            "sampler (the position was saved by a gpufeedd before feistel1, whose sample order "
            "differs: the same (epoch, step) names other samples now)");
}

// The refusal's grammar is what clients read back: prefix, items joined by "; ", the end.
TEST(FingerprintDifferencesTest, TheRefusalIsThePrefixTheItemsAndTheEnd) {
  const absl::Status s = CompareFingerprints("a=1;b=x%3By;gone=1", "a=2;b=x%3By;new=3");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "start.fingerprint: the position was saved from another feed: a was 1, is 2; new "
            "(not in the saved position); gone (no longer part of the feed). Resume with the "
            "settings and data it was saved with, or start without it");
  EXPECT_EQ(CompareFingerprints("f=y", "f=x").message(),
            absl::StrCat(kFingerprintRefusal, "f was y, is x", kFingerprintRefusalEnd));
  EXPECT_TRUE(CompareFingerprints("", "").ok());
}

}  // namespace
}  // namespace gpufeed::server
