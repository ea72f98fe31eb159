// A bare gpufeedd starts: the runtime directory is made (0755, whatever the umask)
// or, where the daemon may not make it, $XDG_RUNTIME_DIR/gpufeed; an unsafe directory on the
// way is refused naming it; clients look where the daemon listens.
#include "common/os/runtime_dir.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

using ::testing::HasSubstr;

int ModeOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

class RuntimeDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = dir_.path();
    ASSERT_EQ(::chmod(root_.c_str(), 0755), 0);
    std::filesystem::create_directories(root_ + "/run");
    std::filesystem::create_directories(root_ + "/xdg");
    ASSERT_EQ(::chmod((root_ + "/xdg").c_str(), 0700), 0);
  }
  testing::TempDir dir_;
  std::string root_;
};

TEST_F(RuntimeDirTest, AMissingDirectoryIsCreated0755WhateverTheUmask) {
  const mode_t old = ::umask(077);
  absl::StatusOr<RuntimeDir> made = PrepareRuntimeDir(root_ + "/run/gpufeed", nullptr, ::geteuid());
  ::umask(old);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->path, root_ + "/run/gpufeed");
  EXPECT_EQ(made->how, "runtime directory " + root_ + "/run/gpufeed created");
  EXPECT_EQ(ModeOf(root_ + "/run/gpufeed"), 0755);
  // Again: it exists, kept as it is (systemd's 0750 stays 0750).
  ASSERT_EQ(::chmod((root_ + "/run/gpufeed").c_str(), 0750), 0);
  made = PrepareRuntimeDir(root_ + "/run/gpufeed", nullptr, ::geteuid());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->how, "runtime directory " + root_ + "/run/gpufeed");
  EXPECT_EQ(ModeOf(root_ + "/run/gpufeed"), 0750);
}

TEST_F(RuntimeDirTest, WhereItCannotBeMadeXdgRuntimeDirIsUsed) {
  const std::string xdg = root_ + "/xdg";
  // A missing parent (as /run on a machine without one), then another user's directory.
  absl::StatusOr<RuntimeDir> made =
      PrepareRuntimeDir(root_ + "/none/gpufeed", xdg.c_str(), ::geteuid());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->path, xdg + "/gpufeed");
  EXPECT_EQ(made->how,
            "in $XDG_RUNTIME_DIR/gpufeed (created) because " + root_ + "/none does not exist");
  EXPECT_EQ(ModeOf(xdg + "/gpufeed"), 0755);
  if (::geteuid() != 0) GTEST_SKIP() << "chown needs root";
  std::filesystem::create_directories(root_ + "/run/theirs");
  ASSERT_EQ(::chown((root_ + "/run/theirs").c_str(), 4321, 4321), 0);
  made = PrepareRuntimeDir(root_ + "/run/theirs", (xdg + "/").c_str(), ::geteuid());
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->path, xdg + "/gpufeed");
  EXPECT_EQ(made->how,
            "in $XDG_RUNTIME_DIR/gpufeed because " + root_ + "/run/theirs belongs to uid 4321");
  // Without XDG_RUNTIME_DIR: refused, saying what would work.
  absl::StatusOr<RuntimeDir> none =
      PrepareRuntimeDir(root_ + "/none/gpufeed", nullptr, ::geteuid());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(none.status().message(),
            "runtime_dir: " + root_ +
                "/none does not exist, and $XDG_RUNTIME_DIR is not set: run gpufeedd as root (or "
                "as the owner of " +
                root_ +
                "/none/gpufeed), set XDG_RUNTIME_DIR; name the socket with "
                "--listen=unix:///PATH/gpufeed.sock");
}

TEST_F(RuntimeDirTest, AnUnsafeDirectoryOnTheWayIsRefusedNamingIt) {
  const std::string xdg = root_ + "/xdg";
  std::filesystem::create_directories(root_ + "/open");
  ASSERT_EQ(::chmod((root_ + "/open").c_str(), 0777), 0);
  absl::StatusOr<RuntimeDir> made = PrepareRuntimeDir(root_ + "/open/gpufeed", xdg.c_str(), 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(made.status().message(),
            "runtime_dir: " + root_ +
                "/open is writable by its others without the sticky bit (mode 0777): another "
                "user could replace gpufeedd's sockets beneath it; fix its owner or mode, or name "
                "the sockets with --listen=unix:///PATH/gpufeed.sock");
  EXPECT_FALSE(std::filesystem::exists(root_ + "/open/gpufeed"));
  // With the sticky bit (as /tmp): safe.
  ASSERT_EQ(::chmod((root_ + "/open").c_str(), 01777), 0);
  EXPECT_TRUE(PrepareRuntimeDir(root_ + "/open/gpufeed", nullptr, ::geteuid()).ok());
  // A symbolic link on the way.
  std::filesystem::create_directory_symlink(root_ + "/run", root_ + "/link");
  made = PrepareRuntimeDir(root_ + "/link/gpufeed", xdg.c_str(), ::geteuid());
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(made.status().message(),
              HasSubstr("runtime_dir: " + root_ + "/link is a symbolic link or not a directory"));
  if (::geteuid() != 0) GTEST_SKIP() << "chown needs root";
  // A parent of another user's: it could move the directory away.
  std::filesystem::create_directories(root_ + "/bob");
  ASSERT_EQ(::chown((root_ + "/bob").c_str(), 4321, 4321), 0);
  made = PrepareRuntimeDir(root_ + "/bob/gpufeed", xdg.c_str(), 0);
  EXPECT_EQ(made.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(made.status().message(),
              HasSubstr(root_ + "/bob is owned by uid 4321, neither root nor gpufeedd's uid 0"));
  EXPECT_EQ(PrepareRuntimeDir("run/gpufeed", nullptr, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RuntimeDirTest, ClientsLookInTheSystemDirectoryThenXdgRuntimeDir) {
  const std::string system = root_ + "/run/gpufeed";
  const std::string xdg = root_ + "/xdg";
  // Neither socket: the system path (which the client's error then names).
  EXPECT_EQ(DefaultSocketPath(xdg.c_str(), system), system + "/gpufeed.sock");
  std::filesystem::create_directories(xdg + "/gpufeed");
  std::ofstream(xdg + "/gpufeed/gpufeed.sock") << "";
  EXPECT_EQ(DefaultSocketPath(xdg.c_str(), system), xdg + "/gpufeed/gpufeed.sock");
  EXPECT_EQ(DefaultSocketPath(nullptr, system), system + "/gpufeed.sock");
  EXPECT_EQ(DefaultSocketPath("", system), system + "/gpufeed.sock");
  std::filesystem::create_directories(system);
  std::ofstream(system + "/gpufeed.sock") << "";
  EXPECT_EQ(DefaultSocketPath(xdg.c_str(), system), system + "/gpufeed.sock");
  EXPECT_EQ(DefaultSocketPath(nullptr), "/run/gpufeed/gpufeed.sock");
}

}  // namespace
}  // namespace gpufeed
