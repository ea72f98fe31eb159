// The client opens the dataset itself (docs/SECURITY.md section 2): what goes wrong locally
// is said in the client's own words, naming the path and the errno, before the daemon is asked.
#include "client/cpp/session_core.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/cpp/rpc.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gpufeed::client::internal {
namespace {

class PassDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/gpufeed_client_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::system(absl::StrCat("rm -rf ", dir_).c_str()); }

  absl::Status Pass(v1::DatasetKind kind, const std::string& path, v1::AttachRequest* r) {
    // No daemon there: everything tested here fails before one is asked.
    const std::string socket = dir_ + "/none.sock";
    SessionCore core(ChannelFor(socket), socket, absl::Seconds(1));
    r->mutable_dataset()->set_kind(kind);
    r->mutable_dataset()->set_path(path);
    return core.PassDataset(r);
  }

  std::string dir_;
};

TEST_F(PassDatasetTest, AMissingFileIsNamedWithItsErrno) {
  v1::AttachRequest r;
  const std::string path = dir_ + "/nope.bin";
  absl::Status s = Pass(v1::DATASET_KIND_TOKENS, path, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), absl::StrCat("dataset.path: this process (uid ", ::geteuid(),
                                      ") cannot open ", path,
                                      " (errno 2): No such file or directory"));
  EXPECT_TRUE(r.dataset().handle().empty());
}

TEST_F(PassDatasetTest, AFifoIsRefusedWithoutBlockingAndAFileIsNoFolder) {
  v1::AttachRequest r;
  const std::string fifo = dir_ + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  absl::Status s = Pass(v1::DATASET_KIND_TOKENS, fifo, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "dataset.path: " + fifo + " is a FIFO, not a regular file");
  // image_folder opens with O_DIRECTORY.
  const std::string file = dir_ + "/file";
  std::system(absl::StrCat("touch ", file).c_str());
  absl::Status folder = Pass(v1::DATASET_KIND_IMAGE_FOLDER, file, &r);
  EXPECT_THAT(folder.message(), ::testing::HasSubstr("cannot open " + file + " (errno 20)"));
  EXPECT_TRUE(r.dataset().handle().empty());
}

TEST_F(PassDatasetTest, ARelativePathIsLeftForTheDaemonToRefuse) {
  v1::AttachRequest r;
  EXPECT_TRUE(Pass(v1::DATASET_KIND_TOKENS, "relative.bin", &r).ok());
  EXPECT_TRUE(r.dataset().handle().empty());
}

// A daemon that cannot be reached after the local open: the status call says so.
TEST_F(PassDatasetTest, AnOpenedDatasetNeedsTheDaemonsMemorySocket) {
  v1::AttachRequest r;
  const std::string file = dir_ + "/data.bin";
  std::system(absl::StrCat("echo x > ", file).c_str());
  absl::Status s = Pass(v1::DATASET_KIND_TOKENS, file, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("status"));
}

}  // namespace
}  // namespace gpufeed::client::internal
