#include "server/reader/image_folder.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

void Touch(const std::string& path) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path) << "x";
}

// The order torchvision's ImageFolder gives this tree (classes sorted; per class, os.walk's
// directories sorted by path, files sorted by name; .jpg/.jpeg/.png in any case).
TEST(ImageFolderTest, LabelsAndIdsFollowImageFolderOrder) {
  testing::TempDir dir;
  const std::string root = dir.path();
  for (const char* f : {"dog/b.jpg", "dog/a.JPEG", "dog/sub/c.png", "dog/notes.txt", "cat/z.jpg",
                        "cat/y.Png", "Zebra/q.jpeg", "dog-wild/k.jpg"}) {
    Touch(root + "/" + f);
  }
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(root);
  ASSERT_TRUE(index.ok()) << index.status();
  // Byte order: upper case before lower case, "dog" before "dog-wild".
  EXPECT_THAT(index->classes, ElementsAre("Zebra", "cat", "dog", "dog-wild"));
  std::vector<std::string> rel;
  for (const std::string& p : index->paths) rel.push_back(p.substr(root.size() + 1));
  EXPECT_THAT(rel, ElementsAre("Zebra/q.jpeg", "cat/y.Png", "cat/z.jpg", "dog/a.JPEG", "dog/b.jpg",
                               "dog/sub/c.png", "dog-wild/k.jpg"));
  EXPECT_THAT(index->labels, ElementsAre(0, 1, 1, 2, 2, 2, 3));
}

TEST(ImageFolderTest, MissingRootIsNotFoundAndEmptyTreesAreInvalid) {
  testing::TempDir dir;
  absl::StatusOr<ImageFolderIndex> missing = IndexImageFolder(dir.path() + "/nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir.path() + "/nope"));
  absl::StatusOr<ImageFolderIndex> no_class = IndexImageFolder(dir.path());
  EXPECT_EQ(no_class.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_class.status().message(), HasSubstr("no class folder"));
  Touch(dir.path() + "/a/readme.txt");
  absl::StatusOr<ImageFolderIndex> no_image = IndexImageFolder(dir.path());
  EXPECT_EQ(no_image.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(no_image.status().message(), HasSubstr("class folder a under"));
  EXPECT_THAT(no_image.status().message(), HasSubstr("holds no .jpg, .jpeg or .png"));
}

}  // namespace
}  // namespace gpufeed::server
