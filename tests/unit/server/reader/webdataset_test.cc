// WebDataset shards: samples are the members sharing a key, ids the shards in name
// order and the members in tar order; the same decode and augment paths as image_folder, so
// the same images give the same bytes; bad shards and samples refused naming shard and key.
#include "server/reader/webdataset.h"

#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/images/dataset.h"
#include "tests/testing/image_files.h"
#include "tests/testing/tar_builder.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::EncodePng;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::TarEnd;
using ::gpufeed::testing::TarFile;
using ::gpufeed::testing::TempDir;
using ::gpufeed::testing::WriteFileBytes;
using ::testing::HasSubstr;

std::string Str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// Six images: PNGs and JPEGs of several sizes, labels 0, 0, 1, 1, 2, 2.
struct Images {
  std::vector<std::string> bytes;
  std::vector<int64_t> labels;
  Images() {
    for (int i = 0; i < 6; ++i) {
      const int h = 20 + 3 * i, w = 31 - 2 * i;
      bytes.push_back(i % 2 == 0 ? Str(EncodePng(Picture(h, w, 3, i), h, w))
                                 : Str(EncodeJpeg(Picture(h, w, 3, i), h, w)));
      labels.push_back(i / 2);
    }
  }
  std::string ext(int i) const { return i % 2 == 0 ? "png" : "jpg"; }
};

// A WebDataset member set for image i: cls first (as writers sorting fields do), the image,
// and a field gpufeed ignores.
std::string Sample(const Images& im, int i, const std::string& cls = "") {
  const std::string key = absl::StrCat("s", 1000 + i);
  return TarFile(key + ".cls", cls.empty() ? absl::StrCat(" ", im.labels[i], "\n") : cls) +
         TarFile(absl::StrCat(key, ".", i == 3 ? "JPEG" : im.ext(i)), im.bytes[i]) +
         TarFile(key + ".json", "{}");
}

DatasetSpec Spec(const std::string& path, BadSamplePolicy policy = BadSamplePolicy::kSkip) {
  DatasetSpec spec;
  spec.kind = DatasetKind::kWebDataset;
  spec.path = path;
  spec.pipeline = {RandomResizedCropStep{16, {}}, FlipStep{0.5}};
  spec.bad_sample = policy;
  return spec;
}

absl::StatusOr<uint64_t> Read(const Dataset& ds, uint64_t id, SampleContext ctx,
                              std::vector<uint8_t>* image, int64_t* label) {
  image->assign(ds.tensors()[0].byte_size, 0);
  std::vector<std::span<std::byte>> rows = {
      std::as_writable_bytes(std::span<uint8_t>(*image)),
      std::span<std::byte>(reinterpret_cast<std::byte*>(label), 8)};
  return ds.ReadSampleAt(id, ctx, rows);
}

class WebDatasetTest : public ::testing::Test {
 protected:
  // Shards b (images 2..5: written second, sorted after a) and a (images 0, 1).
  void SetUp() override {
    dir_.WriteFile("train-1.tar",
                   Sample(im_, 2) + Sample(im_, 3) + Sample(im_, 4) + Sample(im_, 5) + TarEnd());
    dir_.WriteFile("train-0.tar", Sample(im_, 0) + Sample(im_, 1) + TarEnd());
    dir_.WriteFile("notes.txt", "not a shard");
  }
  TempDir dir_;
  Images im_;
};

TEST_F(WebDatasetTest, EveryFormOfThePathGivesShardsInNameOrder) {
  for (const std::string& path : {dir_.path(), dir_.Join("train-{0..1}.tar"),
                                  dir_.Join("train-*.tar"), dir_.Join("train-{1,0}.tar")}) {
    absl::StatusOr<WebDatasetIndex> index =
        IndexWebDataset(Spec(path), PosixFileSystem(), nullptr, {}, true);
    ASSERT_TRUE(index.ok()) << path << ": " << index.status();
    ASSERT_EQ(index->samples.size(), 6u) << path;
    ASSERT_EQ(index->shards.size(), 2u);
    EXPECT_EQ(index->shards[0].name, dir_.Join("train-0.tar"));
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(index->samples[i].label, im_.labels[i]) << path << " " << i;
      EXPECT_EQ(index->member(i), absl::StrCat("s", 1000 + i, ".", i == 3 ? "JPEG" : im_.ext(i)));
    }
    EXPECT_EQ(index->display(2), dir_.Join("train-1.tar") + ":s1002.png");
  }
  absl::StatusOr<WebDatasetIndex> one =
      IndexWebDataset(Spec(dir_.Join("train-1.tar")), PosixFileSystem(), nullptr, {}, true);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->samples.size(), 4u);
}

TEST_F(WebDatasetTest, AnExplicitListIsReadInItsOrder) {
  DatasetSpec spec = Spec(dir_.path());
  spec.paths = {dir_.Join("train-1.tar"), dir_.Join("train-0.tar")};
  absl::StatusOr<WebDatasetIndex> index =
      IndexWebDataset(spec, PosixFileSystem(), nullptr, {}, true);
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ(index->samples.size(), 6u);
  EXPECT_EQ(index->shards[0].name, dir_.Join("train-1.tar"));
  for (int i = 0; i < 6; ++i) {
    const int image = i < 4 ? i + 2 : i - 4;  // train-1's four, then train-0's two
    EXPECT_EQ(index->samples[i].label, im_.labels[image]) << i;
    EXPECT_EQ(index->member(i),
              absl::StrCat("s", 1000 + image, ".", image == 3 ? "JPEG" : im_.ext(image)));
  }
  // Two names of one file are refused, naming both entries.
  ASSERT_EQ(::link(dir_.Join("train-0.tar").c_str(), dir_.Join("again.tar").c_str()), 0);
  spec.paths = {dir_.Join("train-0.tar"), dir_.Join("train-1.tar"), dir_.Join("again.tar")};
  index = IndexWebDataset(spec, PosixFileSystem(), nullptr, {}, true);
  EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(index.status().message(),
              HasSubstr("dataset.paths[2]: " + dir_.Join("again.tar") +
                        " is the same file as dataset.paths[0] (" + dir_.Join("train-0.tar") +
                        "): each file may appear once"));
}

TEST_F(WebDatasetTest, TheSamePayloadsAsAnImageFolderOfTheSameImages) {
  TempDir folder;
  for (int i = 0; i < 6; ++i) {
    WriteFileBytes(absl::StrCat(folder.path(), "/c", im_.labels[i], "/", i, ".", im_.ext(i)),
                   std::vector<uint8_t>(im_.bytes[i].begin(), im_.bytes[i].end()));
  }
  DatasetSpec folder_spec = Spec(folder.path());
  folder_spec.kind = DatasetKind::kImageFolder;
  auto images = OpenDataset(folder_spec, PosixFileSystem());
  auto shards = OpenDataset(Spec(dir_.Join("train-{0..1}.tar")), PosixFileSystem());
  ASSERT_TRUE(images.ok()) << images.status();
  ASSERT_TRUE(shards.ok()) << shards.status();
  ASSERT_EQ((*shards)->num_samples(), 6u);
  EXPECT_EQ((*shards)->tensors()[0].shape, (*images)->tensors()[0].shape);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    for (uint64_t id = 0; id < 6; ++id) {
      std::vector<uint8_t> a, b;
      int64_t la = -1, lb = -2;
      ASSERT_EQ(*Read(**images, id, {9, epoch}, &a, &la), id);
      ASSERT_EQ(*Read(**shards, id, {9, epoch}, &b, &lb), id);
      EXPECT_EQ(a, b) << "epoch " << epoch << " id " << id;
      EXPECT_EQ(la, lb);
    }
  }
}

TEST_F(WebDatasetTest, BadKeysAreRefusedNamingShardAndKey) {
  struct Case {
    std::string tar;
    std::string message;
  };
  const std::vector<Case> cases = {
      {TarFile("k1.jpg", im_.bytes[1]), "key k1 (k1.jpg) has no label"},
      {TarFile("k2.cls", "1") + TarFile("k2.jpg", im_.bytes[1]) + TarFile("k2.png", im_.bytes[0]),
       "key k2 has two images, k2.jpg and k2.png"},
      {TarFile("k3.cls", "one") + TarFile("k3.jpg", im_.bytes[1]), "key k3 has a .cls of 'one'"},
      {TarFile("k4.cls", "1") + TarFile("k4.cls", "2"), "key k4 has two .cls members"},
  };
  for (const Case& c : cases) {
    dir_.WriteFile("train-1.tar", c.tar + TarEnd());
    absl::StatusOr<WebDatasetIndex> index =
        IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, true);
    ASSERT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(index.status().message(), HasSubstr(dir_.Join("train-1.tar") + ": " + c.message));
  }
}

TEST_F(WebDatasetTest, AKeyWithoutAnImageIsNoSampleUnderSkipAndRefusedUnderFail) {
  dir_.WriteFile("train-1.tar", TarFile("only.cls", "3") + TarFile("only.txt", "x") +
                                    Sample(im_, 2) + TarFile("README", "no key") + TarEnd());
  absl::StatusOr<WebDatasetIndex> index =
      IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, true);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->samples.size(), 3u);
  EXPECT_EQ(index->without_image.count, 1);
  EXPECT_EQ(index->without_image.first, dir_.Join("train-1.tar") + ":only");
  EXPECT_EQ(index->dotted_keys, 0);
  const std::vector<DatasetNotice> notices = WebDatasetNotices(*index);
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].message,
            "1 WebDataset key has no image (.jpg, .jpeg or .png) and is left out (first: " +
                dir_.Join("train-1.tar") +
                ":only); only .jpg, .jpeg and .png members are images to gpufeed (bad_sample "
                "\"fail\" refuses such keys)");
  index = IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, false);
  ASSERT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(index.status().message(), HasSubstr("train-1.tar: key only has no image"));
}

// `img.001.jpg` is key `img`, extension `001.jpg` (WebDataset splits a name at its
// first dot too): such keys have no image. They are counted, the first kept, and the user
// told why and what to do, not only the daemon's log.
TEST_F(WebDatasetTest, KeysWithDotsAreCountedWithTheFirstAndExplained) {
  const std::string png = im_.bytes[0];
  dir_.WriteFile("train-1.tar", TarFile("img.001.cls", "1") + TarFile("img.001.jpg", im_.bytes[1]) +
                                    TarFile("img.002.cls", "2") +
                                    TarFile("img.002.jpg", im_.bytes[1]) + Sample(im_, 2) +
                                    TarFile("photo.a.png", png) + TarFile("photo.a.cls", "0") +
                                    TarFile("meta0.json", "{}") + Sample(im_, 4) + TarEnd());
  absl::StatusOr<WebDatasetIndex> index =
      IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, true);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->samples.size(), 4u);  // s1000, s1001 (train-0), s1002, s1004
  // Keys img (img.001.*, img.002.*: one key, as WebDataset groups them), photo, meta0.
  EXPECT_EQ(index->without_image.count, 3);
  const std::string shard = dir_.Join("train-1.tar");
  EXPECT_EQ(index->without_image.first, shard + ":img");
  EXPECT_EQ(index->dotted_keys, 2);
  EXPECT_EQ(index->dotted_images, 3);
  EXPECT_EQ(index->first_dotted_member, "img.001.jpg");
  const std::vector<DatasetNotice> notices = WebDatasetNotices(*index);
  ASSERT_EQ(notices.size(), 1u);
  EXPECT_EQ(notices[0].reason, "no_image");
  EXPECT_EQ(notices[0].count, 3);
  EXPECT_EQ(notices[0].example, shard + ":img");
  EXPECT_EQ(
      notices[0].message,
      "3 WebDataset keys have no image (.jpg, .jpeg or .png) and are left out (first: " + shard +
          ":img); 2 of them hold 3 images whose names have more than one dot: in " + shard +
          ", img.001.jpg is key img with extension 001.jpg; WebDataset (and gpufeed) split "
          "a member's name at the first dot of its last component: name keys without dots "
          "(img_001.jpg)");
  // Through the dataset: its notices, and its bad samples counted by the feed from them.
  auto ds = OpenDataset(Spec(dir_.path()), PosixFileSystem());
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ((*ds)->notices().size(), 1u);
  EXPECT_EQ((*ds)->notices()[0].message, notices[0].message);
  // bad_sample fail refuses the key, saying the same.
  index = IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, false);
  ASSERT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(index.status().message(),
              HasSubstr(shard + ": key img has no image (.jpg, .jpeg or .png); bad_sample: fail "
                                "refuses it (img.001.jpg is key img with extension 001.jpg;"));
  // Every key dotted: no sample at all, and the refusal says why.
  dir_.WriteFile("train-0.tar",
                 TarFile("a.0.jpg", im_.bytes[1]) + TarFile("a.0.cls", "0") + TarEnd());
  dir_.WriteFile("train-1.tar", TarFile("b.0.png", png) + TarFile("b.0.cls", "0") + TarEnd());
  index = IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, true);
  ASSERT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(index.status().message(),
              HasSubstr("shards hold no sample (a key with a .jpg, .jpeg or .png and a .cls); "
                        "a.0.jpg is key a with extension 0.jpg;"));
}

TEST_F(WebDatasetTest, EveryKeyASampleMeansNoNotice) {
  absl::StatusOr<WebDatasetIndex> index =
      IndexWebDataset(Spec(dir_.path()), PosixFileSystem(), nullptr, {}, true);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->without_image.count, 0);
  EXPECT_TRUE(WebDatasetNotices(*index).empty());
}

TEST_F(WebDatasetTest, AnImageThatDoesNotDecodeFollowsThePolicyNamedByShardAndMember) {
  dir_.WriteFile("train-1.tar", TarFile("bad.cls", "5") + TarFile("bad.jpg", "not a jpeg") +
                                    Sample(im_, 2) + TarEnd());
  auto skip = OpenDataset(Spec(dir_.path()), PosixFileSystem());
  ASSERT_TRUE(skip.ok()) << skip.status();
  std::vector<uint8_t> image;
  int64_t label = -1;
  ASSERT_EQ(*Read(**skip, 2, {}, &image, &label), 3u);  // replaced by the next sample
  EXPECT_EQ(label, im_.labels[2]);
  auto fail = OpenDataset(Spec(dir_.path(), BadSamplePolicy::kFail), PosixFileSystem());
  ASSERT_TRUE(fail.ok()) << fail.status();
  absl::StatusOr<uint64_t> r = Read(**fail, 2, {}, &image, &label);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(r.status().message(), HasSubstr(dir_.Join("train-1.tar") + ":bad.jpg"));
}

TEST_F(WebDatasetTest, AShardThatShrinksIsDataLossNamingIt) {
  // A mapping reads a cut tail as zeros: the batch's check finds it. pread finds it itself.
  auto mapped = OpenDataset(Spec(dir_.path()), MappedFileSystem());
  auto pread = OpenDataset(Spec(dir_.path()), PosixFileSystem());
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_TRUE(pread.ok()) << pread.status();
  const std::vector<int64_t> first_shard = {0, 1}, second_shard = {4};
  ASSERT_TRUE((*mapped)->CheckReadNotShrunk(second_shard).ok());
  ASSERT_EQ(::truncate(dir_.Join("train-1.tar").c_str(), 1024), 0);
  EXPECT_TRUE((*mapped)->CheckReadNotShrunk(first_shard).ok());  // only the shards read
  absl::Status s = (*mapped)->CheckReadNotShrunk(second_shard);
  ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("train-1.tar"));
  for (const auto* ds : {&*mapped, &*pread}) {
    std::vector<uint8_t> image;
    int64_t label;
    absl::StatusOr<uint64_t> r = Read(**ds, 5, {}, &image, &label);
    ASSERT_FALSE(r.ok()) << *r;
    ASSERT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("train-1.tar:s1005.jpg"));
  }
}

TEST_F(WebDatasetTest, ABraceNameThatDoesNotExistIsNotFoundNamingIt) {
  absl::StatusOr<WebDatasetIndex> index =
      IndexWebDataset(Spec(dir_.Join("train-{0..2}.tar")), PosixFileSystem(), nullptr, {}, true);
  ASSERT_EQ(index.status().code(), absl::StatusCode::kNotFound) << index.status();
  EXPECT_THAT(index.status().message(), HasSubstr("train-2.tar"));
  index = IndexWebDataset(Spec(dir_.Join("val-*.tar")), PosixFileSystem(), nullptr, {}, true);
  ASSERT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(index.status().message(), HasSubstr("no file matches the pattern"));
}

TEST_F(WebDatasetTest, TheContentIdentityChangesWithTheShardSet) {
  auto two = OpenDataset(Spec(dir_.path()), PosixFileSystem());
  auto one = OpenDataset(Spec(dir_.Join("train-1.tar")), PosixFileSystem());
  ASSERT_TRUE(two.ok() && one.ok());
  EXPECT_THAT((*two)->ContentIdentity(), HasSubstr("2 files, fnv1a64 "));
  EXPECT_NE((*two)->ContentIdentity(), (*one)->ContentIdentity());
  dir_.WriteFile("train-2.tar", Sample(im_, 0) + TarEnd());
  auto three = OpenDataset(Spec(dir_.path()), PosixFileSystem());
  ASSERT_TRUE(three.ok());
  EXPECT_EQ((*three)->num_samples(), 7u);
  EXPECT_NE((*three)->ContentIdentity(), (*two)->ContentIdentity());
}

}  // namespace
}  // namespace gpufeed::server
