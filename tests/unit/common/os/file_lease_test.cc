// The read lease as a shrink watch (common/os/file_lease.h), taken on descriptors directly:
// when it is granted, what ends it, and that a lease holds for the file the descriptor is,
// not for its path.
#include "common/os/file_lease.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "common/os/fd.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

using ::gpufeed::testing::TempDir;

std::string Contents(int fd) {
  std::string out(64, '\0');
  const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

class FileLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.WriteFile("data.bin", "the first file");
    fd_ = UniqueFd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    ASSERT_TRUE(fd_.valid()) << errno;
    if (!OnLeasableFileSystem(fd_.get())) {
      GTEST_SKIP() << "TMPDIR (" << dir_.path() << ") is not on ext4, xfs, btrfs or tmpfs: "
                   << "no lease is taken there";
    }
  }
  void TearDown() override {
    if (fd_.valid()) EndLease(fd_.get());
  }

  TempDir dir_;
  std::string path_;
  UniqueFd fd_;
};

TEST_F(FileLeaseTest, AReadLeaseIsGrantedAndHeldUntilEnded) {
  ASSERT_TRUE(WatchByLease(fd_.get()));
  EXPECT_TRUE(LeaseHolds(fd_.get()));
  EXPECT_EQ(::fcntl(fd_.get(), F_GETLEASE), F_RDLCK);
  EndLease(fd_.get());
  EXPECT_FALSE(LeaseHolds(fd_.get()));
  EXPECT_EQ(::fcntl(fd_.get(), F_GETLEASE), F_UNLCK);
}

TEST_F(FileLeaseTest, AnOpenForWritingBreaksItAtOnce) {
  ASSERT_TRUE(WatchByLease(fd_.get()));
  const auto start = std::chrono::steady_clock::now();
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid()) << errno;
  // The handler lets go at once; without it the open would wait lease-break-time (45 s).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(LeaseHolds(fd_.get()));
  EXPECT_EQ(::fcntl(fd_.get(), F_GETLEASE), F_UNLCK);
}

TEST_F(FileLeaseTest, ATruncateByPathBreaksIt) {
  ASSERT_TRUE(WatchByLease(fd_.get()));
  ASSERT_EQ(::truncate(path_.c_str(), 3), 0);
  EXPECT_FALSE(LeaseHolds(fd_.get()));
  EXPECT_EQ(Contents(fd_.get()), "the");
}

// Renaming another file over the path leaves the leased file itself unchanged (the descriptor
// still reads it), so the lease rightly holds: it watches the file, not the name.
TEST_F(FileLeaseTest, AFileReplacedUnderneathLeavesTheLeaseOnTheOldFile) {
  ASSERT_TRUE(WatchByLease(fd_.get()));
  const std::string replacement = dir_.WriteFile("new.bin", "a second, longer file");
  ASSERT_EQ(::rename(replacement.c_str(), path_.c_str()), 0);
  EXPECT_TRUE(LeaseHolds(fd_.get()));
  EXPECT_EQ(Contents(fd_.get()), "the first file");
  // A writer of the new file at that path is no writer of the leased one.
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC));
  ASSERT_TRUE(writer.valid()) << errno;
  EXPECT_TRUE(LeaseHolds(fd_.get()));
  // The new file is a file of its own, with a lease of its own.
  UniqueFd renewed(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(renewed.valid());
  EXPECT_FALSE(WatchByLease(renewed.get()));  // `writer` has it open for writing
  writer.Reset();
  EXPECT_TRUE(WatchByLease(renewed.get()));
  EXPECT_TRUE(LeaseHolds(renewed.get()));
  EndLease(renewed.get());
}

TEST_F(FileLeaseTest, AFileOpenForWritingGetsNone) {
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid());
  EXPECT_FALSE(WatchByLease(fd_.get()));
  EXPECT_FALSE(LeaseHolds(fd_.get()));
  EXPECT_EQ(::fcntl(fd_.get(), F_GETLEASE), F_UNLCK);
}

// One description, one lease: a dup of a leased descriptor is left to the first holder.
TEST_F(FileLeaseTest, ADescriptionThatHoldsOneAlreadyGetsNoSecond) {
  ASSERT_TRUE(WatchByLease(fd_.get()));
  EXPECT_FALSE(WatchByLease(fd_.get()));
  UniqueFd copy(::dup(fd_.get()));
  ASSERT_TRUE(copy.valid());
  EXPECT_FALSE(WatchByLease(copy.get()));
  EXPECT_FALSE(LeaseHolds(copy.get()));
  EXPECT_TRUE(LeaseHolds(fd_.get()));
}

// A break signal this thread blocks could not be taken: no lease rather than one whose mark
// says "holds" after the kernel broke it.
TEST_F(FileLeaseTest, NoneWhileTheThreadBlocksTheLeaseSignal) {
  sigset_t block, previous;
  sigemptyset(&block);
  sigaddset(&block, SIGRTMIN + 7);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &block, &previous), 0);
  const bool granted = WatchByLease(fd_.get());
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &previous, nullptr), 0);
  EXPECT_FALSE(granted);
  EXPECT_FALSE(LeaseHolds(fd_.get()));
  // Another signal blocked does not matter.
  sigemptyset(&block);
  sigaddset(&block, SIGUSR1);
  ASSERT_EQ(::pthread_sigmask(SIG_BLOCK, &block, &previous), 0);
  const bool granted_then = WatchByLease(fd_.get());
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &previous, nullptr), 0);
  EXPECT_TRUE(granted_then);
}

TEST(FileLeaseNoFileTest, DescriptorsOutsideTheTableAreNeverWatched) {
  for (int fd : {-1, 1 << 16, (1 << 16) + 5}) {
    EXPECT_FALSE(WatchByLease(fd)) << fd;
    EXPECT_FALSE(LeaseHolds(fd)) << fd;
    EndLease(fd);  // nothing to end: must not crash
  }
}

TEST(FileLeaseNoFileTest, OnlyLocalFileSystemsAreLeasable) {
  UniqueFd shm(::open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (shm.valid()) {
    EXPECT_TRUE(OnLeasableFileSystem(shm.get()));  // tmpfs
  }
  UniqueFd proc(::open("/proc/self/status", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(proc.valid());
  EXPECT_FALSE(OnLeasableFileSystem(proc.get()));
  EXPECT_FALSE(WatchByLease(proc.get()));
  EXPECT_FALSE(OnLeasableFileSystem(-1));
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  UniqueFd read_end(pipe_fds[0]), write_end(pipe_fds[1]);
  EXPECT_FALSE(OnLeasableFileSystem(read_end.get()));  // pipefs
}

}  // namespace
}  // namespace gpufeed
