// The feed registry's access rules (docs/SECURITY.md section 2): datasets by handle, bound to
// the uid that passed them; attach by path for admins; dataset_roots; sharing by inode.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/feed/feed.h"
#include "tests/testing/image_files.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::EncodePng;
using ::gpufeed::testing::Picture;
using ::gpufeed::testing::TempDir;
using ::gpufeed::testing::WriteFileBytes;
using ::testing::HasSubstr;

Caller User(uint32_t uid) {
  Caller c;
  c.cred.uid = uid;
  c.cred.gid = uid;
  return c;
}

class FeedRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.WriteFile("tokens.bin", std::string(2 * 101, 'x'));  // 101 uint16 tokens
  }

  FeedSpec Spec(const std::string& path) const {
    FeedSpec spec;
    spec.dataset.kind = DatasetKind::kTokens;
    spec.dataset.path = path;
    spec.dataset.token_dtype = DType::kUInt16;
    spec.dataset.seq_len = 10;
    spec.batch_size = 2;
    spec.world_size = 1;
    return spec;
  }

  // Opens `path` as a client would and hands it to the registry for `uid`.
  std::string Handle(FeedRegistry& registry, const std::string& path, uint32_t uid) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
    EXPECT_TRUE(fd.valid());
    absl::StatusOr<std::string> h = registry.AddDatasetHandle(std::move(fd), User(uid).cred);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : "";
  }

  TempDir dir_;
  std::string path_;
};

TEST_F(FeedRegistryTest, WithoutAHandleOnlyAnAdminAttachesByPath) {
  FeedRegistry registry(PosixFileSystem());
  absl::StatusOr<std::shared_ptr<Feed>> refused = registry.GetOrCreate(Spec(path_), User(1000));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.status().message(),
            "dataset.handle: attach through the client library, which opens the dataset with "
            "your rights and passes it to gpufeedd; attach by path is for admins");
  Caller admin = User(1000);
  admin.admin = true;
  EXPECT_TRUE(registry.GetOrCreate(Spec(path_), admin).ok());
}

TEST_F(FeedRegistryTest, AHandleReadsThroughItsDescriptorForItsUidOnce) {
  FeedRegistry registry(PosixFileSystem());
  FeedSpec spec = Spec("/display/name.bin");  // no such path: the descriptor is what is read
  spec.dataset.handle = Handle(registry, path_, 1000);
  absl::StatusOr<std::shared_ptr<Feed>> stolen = registry.GetOrCreate(spec, User(1001));
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(stolen.status().message(), HasSubstr("dataset.handle: no such handle"));
  absl::StatusOr<std::shared_ptr<Feed>> feed = registry.GetOrCreate(spec, User(1000));
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->dataset().num_samples(), 10u);
  EXPECT_EQ((*feed)->spec().dataset.path, "/display/name.bin");
  EXPECT_THAT((*feed)->fingerprint(), HasSubstr("path=/display/name.bin;bytes=202;"));
  EXPECT_TRUE((*feed)->spec().dataset.handle.empty());
  EXPECT_EQ((*feed)->spec().dataset.fd, -1);
  absl::StatusOr<std::shared_ptr<Feed>> again = registry.GetOrCreate(spec, User(1000));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(FeedRegistryTest, TwoDescriptorsOfOneFileShareAFeedAndAnotherFileDoesNot) {
  FeedRegistry registry(PosixFileSystem());
  FeedSpec a = Spec("/shown/tokens.bin");
  a.dataset.handle = Handle(registry, path_, 1000);
  FeedSpec b = Spec("/shown/tokens.bin");
  b.dataset.handle = Handle(registry, path_, 1000);
  absl::StatusOr<std::shared_ptr<Feed>> fa = registry.GetOrCreate(a, User(1000));
  absl::StatusOr<std::shared_ptr<Feed>> fb = registry.GetOrCreate(b, User(1000));
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_EQ(fa->get(), fb->get());
  // Same display path and spec, another file (inode): another feed.
  const std::string other = dir_.WriteFile("other.bin", std::string(2 * 101, 'y'));
  FeedSpec c = Spec("/shown/tokens.bin");
  c.dataset.handle = Handle(registry, other, 1000);
  absl::StatusOr<std::shared_ptr<Feed>> fc = registry.GetOrCreate(c, User(1000));
  ASSERT_TRUE(fc.ok());
  EXPECT_NE(fc->get(), fa->get());
  EXPECT_NE((*fc)->key(), (*fa)->key());
}

TEST_F(FeedRegistryTest, ADescriptorMustLieBeneathADatasetRoot) {
  std::filesystem::create_directories(dir_.Join("data"));
  const std::string inside = dir_.WriteFile("data/in.bin", std::string(2 * 101, 'x'));
  FeedAccessOptions access;
  access.dataset_roots = {dir_.Join("data") + "/"};
  FeedRegistry registry(PosixFileSystem(), access);
  FeedSpec out = Spec(path_);
  out.dataset.handle = Handle(registry, path_, 1000);
  absl::StatusOr<std::shared_ptr<Feed>> refused = registry.GetOrCreate(out, User(1000));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("dataset.path: " + path_ + " lies outside the directories gpufeedd "
                        "serves (dataset_roots: " + dir_.Join("data") + "/)"));
  // A sibling whose name merely starts with the root's is outside too.
  std::filesystem::create_directories(dir_.Join("database"));
  const std::string sibling = dir_.WriteFile("database/x.bin", std::string(2 * 101, 'x'));
  FeedSpec near = Spec(sibling);
  near.dataset.handle = Handle(registry, sibling, 1000);
  EXPECT_EQ(registry.GetOrCreate(near, User(1000)).status().code(),
            absl::StatusCode::kPermissionDenied);
  FeedSpec in = Spec(inside);
  in.dataset.handle = Handle(registry, inside, 1000);
  EXPECT_TRUE(registry.GetOrCreate(in, User(1000)).ok());
  // An admin's path is checked the same way.
  Caller admin = User(0);
  admin.admin = true;
  EXPECT_EQ(registry.GetOrCreate(Spec(path_), admin).status().code(),
            absl::StatusCode::kPermissionDenied);
}

// An explicit list: one handle, their common directory's, which may lie above a
// dataset root; each listed file's place decides.
TEST_F(FeedRegistryTest, EachFileOfAListMustLieBeneathADatasetRoot) {
  std::filesystem::create_directories(dir_.Join("data"));
  const std::string a = dir_.WriteFile("data/a.bin", std::string(2 * 101, 'a'));
  const std::string b = dir_.WriteFile("data/b.bin", std::string(2 * 101, 'b'));
  FeedAccessOptions access;
  access.dataset_roots = {dir_.Join("data")};
  FeedRegistry registry(PosixFileSystem(), access);
  FeedSpec spec = Spec(dir_.path());
  spec.dataset.paths = {b, a};
  spec.dataset.handle = Handle(registry, dir_.path(), 0);
  absl::StatusOr<std::shared_ptr<Feed>> feed = registry.GetOrCreate(spec, User(0));
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->dataset().num_samples(), 20u);
  EXPECT_THAT((*feed)->fingerprint(), HasSubstr(";paths=2 files, fnv1a64 "));
  FeedSpec out = Spec(dir_.path());
  out.dataset.paths = {a, path_};
  out.dataset.handle = Handle(registry, dir_.path(), 0);
  absl::StatusOr<std::shared_ptr<Feed>> refused = registry.GetOrCreate(out, User(0));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(refused.status().message(), HasSubstr("dataset.paths[1]: " + path_ +
                                                    " lies outside the directories gpufeedd "
                                                    "serves (dataset_roots: " +
                                                    dir_.Join("data") + ")"));
  // An admin's list by path through a link to the directory: made real, files and all.
  ASSERT_EQ(::symlink(dir_.Join("data").c_str(), dir_.Join("link").c_str()), 0);
  Caller admin = User(0);
  admin.admin = true;
  FeedSpec linked = Spec(dir_.Join("link"));
  linked.dataset.paths = {dir_.Join("link/a.bin"), dir_.Join("link/b.bin")};
  feed = registry.GetOrCreate(linked, admin);
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->spec().dataset.path, dir_.Join("data"));
  EXPECT_EQ((*feed)->spec().dataset.paths, (std::vector<std::string>{a, b}));
}

TEST_F(FeedRegistryTest, OnlyRegularFilesAndDirectoriesBecomeHandles) {
  FeedRegistry registry(PosixFileSystem());
  const std::string fifo = dir_.Join("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  UniqueFd fd(::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  absl::StatusOr<std::string> h = registry.AddDatasetHandle(std::move(fd), User(1000).cred);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.status().message(),
            "open_dataset: the descriptor passed is a FIFO, not a regular file or a directory");
  // O_PATH needs no read permission on the file: not a way in.
  UniqueFd path_only(::open(path_.c_str(), O_PATH | O_CLOEXEC));
  ASSERT_TRUE(path_only.valid());
  absl::StatusOr<std::string> o_path =
      registry.AddDatasetHandle(std::move(path_only), User(1000).cred);
  EXPECT_EQ(o_path.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(o_path.status().message(), HasSubstr("not open for reading (O_PATH or O_WRONLY)"));
  // A directory passed for a records dataset is refused when it is opened (for tokens it is
  // a directory of shards).
  FeedSpec spec = Spec(dir_.path());
  spec.dataset.kind = DatasetKind::kRecords;
  spec.dataset.seq_len = 0;
  spec.dataset.handle = Handle(registry, dir_.path(), 1000);
  absl::StatusOr<std::shared_ptr<Feed>> dir = registry.GetOrCreate(spec, User(1000));
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dir.status().message(),
              HasSubstr("dataset.path: " + dir_.path() + " is a directory, not a regular file"));
}

class ImageFeedRegistryTest : public FeedRegistryTest {
 protected:
  FeedSpec Images(const std::string& root) const {
    FeedSpec spec;
    spec.dataset.kind = DatasetKind::kImageFolder;
    spec.dataset.path = root;
    spec.dataset.pipeline = {CenterCropStep{4}, LayoutStep{Layout::kNHWC}};
    spec.dataset.bad_sample = BadSamplePolicy::kSkip;
    spec.batch_size = 1;
    spec.world_size = 1;
    spec.shuffle = false;
    return spec;
  }
};

// Files beneath a passed directory are read only where their mode bits let the caller read
// them; the others are unreadable samples, replaced under the skip policy.
TEST_F(ImageFeedRegistryTest, FilesTheCallerCannotReadAreUnreadableSamples) {
  const std::string root = dir_.Join("images");
  WriteFileBytes(root + "/a/1.png", EncodePng(Picture(6, 6, 3, 1), 6, 6));
  WriteFileBytes(root + "/a/2.png", EncodePng(Picture(6, 6, 3, 2), 6, 6));
  ASSERT_EQ(::chown((root + "/a/1.png").c_str(), 0, 0), 0);
  ASSERT_EQ(::chmod((root + "/a/1.png").c_str(), 0600), 0);  // root's alone
  ASSERT_EQ(::chmod((root + "/a/2.png").c_str(), 0644), 0);
  FeedRegistry registry(PosixFileSystem());
  FeedSpec spec = Images(root);
  spec.dataset.handle = Handle(registry, root, 1000);
  absl::StatusOr<std::shared_ptr<Feed>> feed = registry.GetOrCreate(spec, User(1000));
  ASSERT_TRUE(feed.ok()) << feed.status();
  std::vector<std::byte> slot((*feed)->layout().stride_bytes);
  std::vector<int64_t> ids(1);
  absl::StatusOr<int64_t> filled = (*feed)->Fill({0, 0}, 0, slot.data(), ids);
  ASSERT_TRUE(filled.ok()) << filled.status();
  EXPECT_EQ(ids[0], 1);  // sample 0 (1.png) replaced by sample 1
  int64_t unreadable = 0;
  for (const auto& [reason, n] : (*feed)->dataset().bad_samples()) {
    if (reason == "unreadable") unreadable = n;
  }
  EXPECT_EQ(unreadable, 1);
}

// A folder's feed reads with its first caller's rights: another uid gets a feed of its own.
TEST_F(ImageFeedRegistryTest, AFolderFeedIsSharedOnlyByCallersOfTheSameRights) {
  const std::string root = dir_.Join("images");
  WriteFileBytes(root + "/a/1.png", EncodePng(Picture(6, 6, 3, 1), 6, 6));
  FeedRegistry registry(PosixFileSystem());
  FeedSpec a = Images(root), b = Images(root), c = Images(root);
  a.dataset.handle = Handle(registry, root, 1000);
  b.dataset.handle = Handle(registry, root, 1000);
  c.dataset.handle = Handle(registry, root, 1001);
  absl::StatusOr<std::shared_ptr<Feed>> fa = registry.GetOrCreate(a, User(1000));
  absl::StatusOr<std::shared_ptr<Feed>> fb = registry.GetOrCreate(b, User(1000));
  absl::StatusOr<std::shared_ptr<Feed>> fc = registry.GetOrCreate(c, User(1001));
  ASSERT_TRUE(fa.ok() && fb.ok() && fc.ok());
  EXPECT_EQ(fa->get(), fb->get());
  EXPECT_NE(fa->get(), fc->get());
}

TEST_F(ImageFeedRegistryTest, CancelOpensEndsAFolderWalk) {
  const std::string root = dir_.Join("images");
  WriteFileBytes(root + "/a/1.png", EncodePng(Picture(6, 6, 3, 1), 6, 6));
  FeedRegistry registry(PosixFileSystem());
  Caller admin = User(0);
  admin.admin = true;
  registry.CancelOpens();
  absl::StatusOr<std::shared_ptr<Feed>> feed = registry.GetOrCreate(Images(root), admin);
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(feed.status().message(), "gpufeedd is shutting down");
}

}  // namespace
}  // namespace gpufeed::server
