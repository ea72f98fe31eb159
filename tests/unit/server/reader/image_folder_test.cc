#include "server/reader/image_folder.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "common/os/fd.h"
#include "common/os/file.h"
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

// `ln -s . X` in a class folder once kept the walk spinning: links to directories are not
// followed (nor are linked class folders classes), links to files are samples.
TEST(ImageFolderTest, LinksToDirectoriesAreNotFollowed) {
  testing::TempDir dir;
  const std::string root = dir.path();
  Touch(root + "/dog/a.jpg");
  Touch(root + "/outside/o.jpg");
  std::filesystem::create_directories(root + "/tree");
  Touch(root + "/tree/dog2/b.jpg");
  std::filesystem::create_directory_symlink(".", root + "/dog/X");
  std::filesystem::create_directory_symlink("..", root + "/dog/up");
  std::filesystem::create_directory_symlink(root + "/outside", root + "/linked_class");
  std::filesystem::create_symlink(root + "/outside/o.jpg", root + "/dog/link.jpg");
  std::filesystem::create_directory_symlink(root + "/dog", root + "/tree/dog2/loop");
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(root);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_THAT(index->classes, ElementsAre("dog", "outside", "tree"));
  std::vector<std::string> rel;
  for (size_t i = 0; i < index->paths.size(); ++i) rel.push_back(index->Relative(i));
  EXPECT_THAT(rel, ElementsAre("dog/a.jpg", "dog/link.jpg", "outside/o.jpg", "tree/dog2/b.jpg"));
  // What torchvision would follow and gpufeed does not is counted, the first kept:
  // the linked class, then per class X and up (dog), loop (tree).
  EXPECT_EQ(index->unfollowed_links.count, 4);
  EXPECT_EQ(index->unfollowed_links.first, root + "/linked_class");
  EXPECT_EQ(index->links.count, 0);  // an admin's walk takes dog/link.jpg
}

// What a user would miss is counted with the first of it: files of the image types
// torchvision's ImageFolder loads and gpufeed does not decode, and a caller's links to images.
// Not counted: what ImageFolder ignores too (other extensions, files in ROOT); a hidden image
// is a sample for both.
TEST(ImageFolderTest, OtherImageTypesAndACallersLinksAreCountedWithTheFirst) {
  testing::TempDir dir;
  const std::string root = dir.path();
  for (const char* f : {"c/a.jpg", "c/b.webp", "c/sub/z.BMP", "c/notes.txt", "c/.hidden.png",
                        "readme.txt", "d/x.png", "d/y.tiff"}) {
    Touch(root + "/" + f);
  }
  std::filesystem::create_symlink("../d/x.png", root + "/c/l.jpg");
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);  // mkdtemp's 0700: the user could not list it
  UniqueFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const PeerCred user{1000, 1000, 1, {}};
  absl::StatusOr<ImageFolderIndex> as_user = IndexImageFolder(fd.get(), root, {}, &user);
  ASSERT_TRUE(as_user.ok()) << as_user.status();
  std::vector<std::string> rel;
  for (size_t i = 0; i < as_user->paths.size(); ++i) rel.push_back(as_user->Relative(i));
  EXPECT_THAT(rel, ElementsAre("c/.hidden.png", "c/a.jpg", "d/x.png"));
  EXPECT_EQ(as_user->other_images.count, 3);  // c/b.webp, c/sub/z.BMP, d/y.tiff
  EXPECT_EQ(as_user->other_images.first, root + "/c/b.webp");
  EXPECT_EQ(as_user->links.count, 1);
  EXPECT_EQ(as_user->links.first, root + "/c/l.jpg");
  EXPECT_EQ(as_user->unfollowed_links.count, 0);
  EXPECT_EQ(as_user->unlisted_folders.count, 0);
  absl::StatusOr<ImageFolderIndex> as_admin = IndexImageFolder(root);
  ASSERT_TRUE(as_admin.ok()) << as_admin.status();
  EXPECT_EQ(as_admin->paths.size(), 4u);  // c/l.jpg too
  EXPECT_EQ(as_admin->links.count, 0);
  EXPECT_EQ(as_admin->other_images.count, 3);
  // A class of other image types only is refused, saying so.
  Touch(root + "/e/only.webp");
  absl::StatusOr<ImageFolderIndex> refused = IndexImageFolder(root);
  EXPECT_EQ(refused.status().message(),
            "dataset.path: class folder e under " + root +
                " holds no .jpg, .jpeg or .png file (its 1 .bmp/.ppm/.pgm/.tif/.tiff/.webp files, "
                "e.g. only.webp, are images gpufeed does not decode: convert them to .png)");
}

TEST(ImageFolderTest, TheWalkStopsPastTheEntryCapAndTheDeadline) {
  testing::TempDir dir;
  const std::string root = dir.path();
  for (int i = 0; i < 10; ++i) Touch(root + "/c/" + std::to_string(i) + ".jpg");
  FolderWalkLimits limits;
  limits.max_entries = 11;  // "c" and its 10 files
  EXPECT_TRUE(IndexImageFolder(root, limits).ok());
  limits.max_entries = 10;
  absl::StatusOr<ImageFolderIndex> capped = IndexImageFolder(root, limits);
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(capped.status().message(),
            "dataset.path: " + root + " holds more than 10 entries (gpufeedd's max_folder_entries)");
  limits.max_entries = 1000;
  limits.timeout = absl::ZeroDuration();
  absl::StatusOr<ImageFolderIndex> late = IndexImageFolder(root, limits);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(late.status().message(), "dataset.path: walking " + root +
                                         " took longer than 0 (gpufeedd's folder_walk_timeout)");
  std::atomic<bool> cancel{true};
  limits.timeout = absl::Seconds(60);
  limits.cancel = &cancel;
  EXPECT_EQ(IndexImageFolder(root, limits).status().code(), absl::StatusCode::kCancelled);
}

// A caller's walk sees what that caller could: a sub-folder it may not list and search is
// skipped (as os.walk skips it), a root it may not search is refused.
TEST(ImageFolderTest, TheIndexIsChargedToTheCallersShareOfMaxIndexBytesAndReturned) {
  // Attach-time indexes were once unbounded memory; an image folder's paths count in
  // max_index_bytes like a webdataset's names.
  testing::TempDir dir;
  const std::string root = dir.path();
  for (int i = 0; i < 200; ++i) Touch(root + "/c" + std::to_string(i % 4) + "/" +
                                      std::string(40, 'x') + std::to_string(i) + ".jpg");
  FolderWalkLimits limits;
  limits.index_bytes = ByteBudget::Create("max_index_bytes", 1 << 20, "max_index_bytes_per_uid",
                                          4096, "use fewer files");
  limits.charge_uid = 1234;
  absl::StatusOr<ImageFolderIndex> refused = IndexImageFolder(root, limits);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("uid 1234 holds 0 of its share of max_index_bytes "
                        "(max_index_bytes_per_uid 4096): use fewer files"));
  EXPECT_EQ(limits.index_bytes->used(), 0u);  // a refused walk returns what it took
  limits.charge_uid = std::nullopt;            // an admin: the total only
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(root, limits);
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_GT(limits.index_bytes->used(), 200u * 48);
  EXPECT_EQ(limits.index_bytes->used(), index->charge->bytes());
  index = absl::CancelledError("dropped");
  EXPECT_EQ(limits.index_bytes->used(), 0u);
}

TEST(ImageFolderTest, AReadersWalkSkipsFoldersItsModeBitsCloseOff) {
  testing::TempDir dir;
  const std::string root = dir.path();
  Touch(root + "/c/a.jpg");
  Touch(root + "/c/private/b.jpg");
  Touch(root + "/c/nosearch/d.jpg");
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);
  ASSERT_EQ(::chmod((root + "/c").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((root + "/c/private").c_str(), 0700), 0);  // root's (the tests run as root)
  ASSERT_EQ(::chmod((root + "/c/nosearch").c_str(), 0744), 0);
  UniqueFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const PeerCred user{1000, 1000, 1, {}};
  absl::StatusOr<ImageFolderIndex> as_user = IndexImageFolder(fd.get(), root, {}, &user);
  ASSERT_TRUE(as_user.ok()) << as_user.status();
  EXPECT_THAT(as_user->paths, ElementsAre(root + "/c/a.jpg"));
  EXPECT_EQ(as_user->unlisted_folders.count, 2);  // counted, the first by name
  EXPECT_EQ(as_user->unlisted_folders.first, root + "/c/nosearch");
  absl::StatusOr<ImageFolderIndex> as_daemon = IndexImageFolder(fd.get(), root, {}, nullptr);
  ASSERT_TRUE(as_daemon.ok());
  EXPECT_EQ(as_daemon->paths.size(), 3u);
  EXPECT_EQ(as_daemon->unlisted_folders.count, 0);
  ASSERT_EQ(::chmod(root.c_str(), 0744), 0);
  absl::StatusOr<ImageFolderIndex> closed = IndexImageFolder(fd.get(), root, {}, &user);
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(closed.status().message(), "dataset.path: the mode bits of " + root +
                                           " do not let uid 1000 list and search it");
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);
}

// A link inside the folder to a file behind a directory the caller cannot search: an admin's
// walk (no reader) follows it, a caller's walk skips it, and an open beneath the folder with a
// reader refuses it, so the caller never reads what it could not open itself.
TEST(ImageFolderTest, AReadersWalkTakesNoLinksThroughDirectoriesItCannotSearch) {
  testing::TempDir dir;
  const std::string root = dir.path();
  Touch(root + "/c/a.jpg");
  Touch(root + "/bob/x.jpg");
  ASSERT_EQ(::chmod(root.c_str(), 0755), 0);
  ASSERT_EQ(::chmod((root + "/c").c_str(), 0755), 0);
  ASSERT_EQ(::chmod((root + "/bob").c_str(), 0700), 0);  // root's: the tests run as root
  ASSERT_EQ(::chmod((root + "/bob/x.jpg").c_str(), 0644), 0);
  std::filesystem::create_symlink("../bob/x.jpg", root + "/c/b.jpg");
  UniqueFd fd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const PeerCred user{1000, 1000, 1, {}};
  absl::StatusOr<ImageFolderIndex> as_daemon = IndexImageFolder(fd.get(), root, {}, nullptr);
  ASSERT_TRUE(as_daemon.ok()) << as_daemon.status();
  EXPECT_THAT(as_daemon->paths, ElementsAre(root + "/bob/x.jpg", root + "/c/a.jpg",
                                            root + "/c/b.jpg"));
  absl::StatusOr<ImageFolderIndex> as_user = IndexImageFolder(fd.get(), root, {}, &user);
  ASSERT_FALSE(as_user.ok());  // the user cannot list bob: refused as a class folder
  ASSERT_EQ(::chmod((root + "/bob").c_str(), 0755), 0);
  as_user = IndexImageFolder(fd.get(), root, {}, &user);
  ASSERT_TRUE(as_user.ok()) << as_user.status();
  EXPECT_THAT(as_user->paths, ElementsAre(root + "/bob/x.jpg", root + "/c/a.jpg"));
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> linked =
      PosixFileSystem()->OpenForReadBeneath(fd.get(), "c/b.jpg", root + "/c/b.jpg", &user);
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(linked.status().message(),
            "opening " + root + "/c/b.jpg: a symbolic link, which a caller's dataset may not use");
  EXPECT_TRUE(
      PosixFileSystem()->OpenForReadBeneath(fd.get(), "c/b.jpg", root + "/c/b.jpg", nullptr).ok());
}

TEST(ImageFolderTest, ARootThatIsNotADirectoryIsRefusedWithoutBlocking) {
  testing::TempDir dir;
  const std::string fifo = dir.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::StatusOr<ImageFolderIndex> index = IndexImageFolder(fifo);
  EXPECT_EQ(index.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index.status().message(), "dataset.path: " + fifo + " is a FIFO, not a directory");
}

}  // namespace
}  // namespace gpufeed::server
