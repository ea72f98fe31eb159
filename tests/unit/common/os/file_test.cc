// Opening datasets: through a client's descriptor, beneath a directory descriptor, and the
// type check that keeps a FIFO from blocking anyone (docs/SECURITY.md section 2).
#include "common/os/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;

std::string ReadAll(const RandomAccessFile& f) {
  std::string out(f.size(), '\0');
  absl::Status s = f.ReadAt(0, std::as_writable_bytes(std::span<char>(out)));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

class FileTest : public ::testing::TestWithParam<bool> {
 protected:
  FileSystem* fs() const { return GetParam() ? MappedFileSystem() : PosixFileSystem(); }
  TempDir dir_;
};

TEST_P(FileTest, OpensThroughADescriptorItDupsAndNamesTheDisplayPath) {
  const std::string path = dir_.WriteFile("data.bin", "0123456789");
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> f = fs()->OpenFromFd(fd.get(), "/shown/name");
  ASSERT_TRUE(f.ok()) << f.status();
  fd.Reset();  // the file keeps its own dup
  EXPECT_EQ((*f)->path(), "/shown/name");
  EXPECT_EQ(ReadAll(**f), "0123456789");
}

TEST_P(FileTest, AFifoIsRefusedAtOnceByPathAndByDescriptor) {
  const std::string fifo = dir_.Join("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  // Opened by path: O_NONBLOCK, then the type check; no writer ever comes, nothing blocks.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> by_path = fs()->OpenForRead(fifo);
  EXPECT_EQ(by_path.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(by_path.status().message(),
            "dataset.path: " + fifo + " is a FIFO, not a regular file");
  UniqueFd fd(::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> by_fd = fs()->OpenFromFd(fd.get(), fifo);
  EXPECT_EQ(by_fd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(by_fd.status().message(), HasSubstr("is a FIFO, not a regular file"));
  // A directory too.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> dir = fs()->OpenForRead(dir_.path());
  EXPECT_EQ(dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dir.status().message(), HasSubstr("is a directory, not a regular file"));
}

TEST_P(FileTest, BeneathADirectoryNothingOutsideIsReachable) {
  std::filesystem::create_directories(dir_.Join("root/cls"));
  dir_.WriteFile("root/cls/in.jpg", "inside");
  const std::string secret = dir_.WriteFile("secret", "outside");
  std::filesystem::create_symlink(secret, dir_.Join("root/cls/abs.jpg"));          // absolute
  std::filesystem::create_symlink("../../secret", dir_.Join("root/cls/rel.jpg"));  // relative
  std::filesystem::create_symlink("in.jpg", dir_.Join("root/cls/ok.jpg"));         // stays inside
  std::filesystem::create_symlink("loop2.jpg", dir_.Join("root/cls/loop1.jpg"));
  std::filesystem::create_symlink("loop1.jpg", dir_.Join("root/cls/loop2.jpg"));
  ASSERT_EQ(::mkfifo(dir_.Join("root/cls/fifo.jpg").c_str(), 0644), 0);
  UniqueFd root(::open(dir_.Join("root").c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(root.valid());
  auto open = [&](const std::string& rel) {
    return fs()->OpenForReadBeneath(root.get(), rel, "/shown/" + rel, nullptr);
  };
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> in = open("cls/in.jpg");
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(ReadAll(**in), "inside");
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> ok = open("cls/ok.jpg");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ReadAll(**ok), "inside");
  for (const std::string& escape : std::vector<std::string>{"../secret", "cls/abs.jpg", "cls/rel.jpg", secret}) {
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> out = open(escape);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kPermissionDenied) << escape;
    EXPECT_EQ(out.status().message(),
              "opening /shown/" + escape + ": it lies outside the dataset folder");
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> loop = open("cls/loop1.jpg");
  EXPECT_FALSE(loop.ok());
  EXPECT_THAT(loop.status().message(), HasSubstr("/shown/cls/loop1.jpg"));
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> fifo = open("cls/fifo.jpg");
  EXPECT_EQ(fifo.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(fifo.status().message(), HasSubstr("is a FIFO, not a regular file"));
}

TEST_P(FileTest, BeneathADirectoryTheReadersModeBitsDecide) {
  const std::string path = dir_.WriteFile("private.jpg", "bytes");
  ASSERT_EQ(::chown(path.c_str(), 5000, 6000), 0) << "the tests run as root";
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);  // the folder itself lets all search it
  UniqueFd root(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  PeerCred owner{5000, 100, 1, {}};
  PeerCred member{7000, 100, 1, {6000}};
  PeerCred other{7000, 100, 1, {}};
  auto open = [&](const PeerCred& who) {
    return fs()->OpenForReadBeneath(root.get(), "private.jpg", "/shown/private.jpg", &who);
  };
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  EXPECT_TRUE(open(owner).ok());
  EXPECT_TRUE(open(member).ok());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> refused = open(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.status().message(),
            "opening /shown/private.jpg: its mode bits do not let uid 7000 read it");
  ASSERT_EQ(::chmod(path.c_str(), 0604), 0);  // others may, the group may not
  EXPECT_TRUE(open(other).ok());
  EXPECT_FALSE(open(member).ok());
  EXPECT_TRUE(fs()->OpenForReadBeneath(root.get(), "private.jpg", "x", nullptr).ok());
}

TEST_P(FileTest, BeneathADirectoryEveryDirectoryOnTheWayMustLetTheReaderSearchIt) {
  // Formerly a 0744 directory's files were served to a uid the kernel refuses, and a
  // directory descriptor kept from before a chmod 0700 served files written after it.
  ASSERT_EQ(::mkdir(dir_.Join("cls").c_str(), 0755), 0);
  const std::string path = dir_.WriteFile("cls/a.jpg", "bytes");
  ASSERT_EQ(::chmod(path.c_str(), 0644), 0);
  ASSERT_EQ(::chown(dir_.Join("cls").c_str(), 5000, 6000), 0) << "the tests run as root";
  ASSERT_EQ(::chown(dir_.path().c_str(), 5000, 6000), 0);
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  UniqueFd root(::open(dir_.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  const PeerCred owner{5000, 100, 1, {}}, member{7000, 100, 1, {6000}}, other{7000, 100, 1, {}};
  auto open = [&](const PeerCred& who) {
    return fs()->OpenForReadBeneath(root.get(), "cls/a.jpg", "/shown/cls/a.jpg", &who);
  };
  EXPECT_TRUE(open(other).ok());
  ASSERT_EQ(::chmod(dir_.Join("cls").c_str(), 0754), 0);  // readable by others, not searchable
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> refused = open(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.status().message(),
            "opening /shown/cls/a.jpg: the mode bits of its directory cls do not let uid 7000 "
            "search it");
  EXPECT_TRUE(open(member).ok());
  EXPECT_TRUE(open(owner).ok());
  // The descriptor was opened while the folder was 0755; a chmod 0700 counts from now on.
  ASSERT_EQ(::chmod(dir_.Join("cls").c_str(), 0755), 0);
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0700), 0);
  refused = open(member);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.status().message(),
            "opening /shown/cls/a.jpg: the mode bits of its directory (the dataset folder) do "
            "not let uid 7000 search it");
  EXPECT_TRUE(open(owner).ok());
  EXPECT_TRUE(fs()->OpenForReadBeneath(root.get(), "cls/a.jpg", "x", nullptr).ok());
  // A missing file behind a directory the reader cannot search answers alike: no oracle.
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> missing =
      fs()->OpenForReadBeneath(root.get(), "cls/missing.jpg", "/shown/cls/missing.jpg", &other);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kPermissionDenied);
}

INSTANTIATE_TEST_SUITE_P(PreadAndMmap, FileTest, ::testing::Bool());

TEST(ModeLetsSearchTest, TheExecuteBitsOfOwnerThenGroupThenOthers) {
  const PeerCred owner{10, 20, 0, {}}, member{11, 99, 0, {20}}, other{12, 99, 0, {}};
  EXPECT_TRUE(ModeLetsSearch(10, 20, 0100, owner));
  EXPECT_FALSE(ModeLetsSearch(10, 20, 0411, owner));
  EXPECT_TRUE(ModeLetsSearch(10, 20, 0010, member));
  EXPECT_FALSE(ModeLetsSearch(10, 20, 0745, member));
  EXPECT_TRUE(ModeLetsSearch(10, 20, 0001, other));
  EXPECT_FALSE(ModeLetsSearch(10, 20, 0774, other));
  EXPECT_TRUE(ModeLetsSearch(10, 20, 0000, PeerCred{0, 0, 0, {}}));
}

TEST(ModeLetsReadTest, OwnerThenGroupThenOthersAndRootReadsAll) {
  const PeerCred owner{10, 20, 0, {}}, member{11, 99, 0, {20}}, other{12, 99, 0, {}};
  EXPECT_TRUE(ModeLetsRead(10, 20, 0400, owner));
  EXPECT_FALSE(ModeLetsRead(10, 20, 0044, owner));  // the owner's bits alone count for it
  EXPECT_TRUE(ModeLetsRead(10, 20, 0040, member));
  EXPECT_FALSE(ModeLetsRead(10, 20, 0404, member));
  EXPECT_TRUE(ModeLetsRead(10, 20, 0004, other));
  EXPECT_FALSE(ModeLetsRead(10, 20, 0440, other));
  EXPECT_TRUE(ModeLetsRead(10, 20, 0000, PeerCred{0, 0, 0, {}}));
}

TEST(ResolvedPathOfTest, NamesTheFileTheDescriptorIs) {
  TempDir dir;
  const std::string path = dir.WriteFile("f", "x");
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  absl::StatusOr<std::string> resolved = ResolvedPathOf(fd.get());
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(*resolved, std::filesystem::canonical(path).string());
}

// The read lease of a mapped file (common/os/file_lease.h): the shrink check is free while it
// holds, and every way to change the file ends it, so the check then finds what changed.
class LeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.WriteFile("data.bin", std::string(3 * 4096, 'x'));
    absl::StatusOr<std::unique_ptr<RandomAccessFile>> f = MappedFileSystem()->OpenForRead(path_);
    ASSERT_TRUE(f.ok()) << f.status();
    file_ = std::move(*f);
    if (!file_->watched_by_lease()) {
      GTEST_SKIP() << "no read lease here (a file system leases are not trusted on, or no "
                      "CAP_LEASE): the fstat check is the only one";
    }
  }
  TempDir dir_;
  std::string path_;
  std::unique_ptr<RandomAccessFile> file_;
};

TEST_F(LeaseTest, ATruncateByPathEndsTheLeaseAndTheShrinkIsFound) {
  EXPECT_TRUE(file_->CheckNotShrunk().ok());
  ASSERT_EQ(::truncate(path_.c_str(), 100), 0);  // returns once the lease is released
  EXPECT_FALSE(file_->watched_by_lease());
  const absl::Status s = file_->CheckNotShrunk();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("file shrank from 12288 to 100 bytes"));
}

TEST_F(LeaseTest, AWriterIsNotHeldUpAndItsTruncateIsFound) {
  const auto start = std::chrono::steady_clock::now();
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid()) << errno;
  // The kernel would wait lease-break-time (45 s by default) for a holder that never lets go.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(file_->watched_by_lease());
  EXPECT_TRUE(file_->CheckNotShrunk().ok());  // opened, not yet changed
  ASSERT_EQ(::ftruncate(writer.get(), 4096), 0);
  EXPECT_EQ(file_->CheckNotShrunk().code(), absl::StatusCode::kDataLoss);
}

TEST_F(LeaseTest, AFileAlreadyOpenForWritingGetsNoLeaseAndTheFstatStays) {
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> second = MappedFileSystem()->OpenForRead(path_);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_FALSE((*second)->watched_by_lease());
  ASSERT_EQ(::ftruncate(writer.get(), 10), 0);
  EXPECT_EQ((*second)->CheckNotShrunk().code(), absl::StatusCode::kDataLoss);
}

TEST_F(LeaseTest, TwoFilesOfOneClientDescriptorEachHoldTheirOwnLease) {
  // The daemon reads a client's file through a description of its own (file.cc
  // FromClientFd), so two files made from one client descriptor each hold a lease, and the
  // first one's end leaves the second's intact.
  UniqueFd client(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(client.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> first =
      MappedFileSystem()->OpenFromFd(client.get(), "first");
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> second =
      MappedFileSystem()->OpenFromFd(client.get(), "second");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE((*first)->watched_by_lease());
  EXPECT_TRUE((*second)->watched_by_lease());
  first->reset();
  EXPECT_TRUE((*second)->watched_by_lease());
  ASSERT_EQ(::truncate(path_.c_str(), 10), 0);
  EXPECT_FALSE((*second)->watched_by_lease());
  EXPECT_EQ((*second)->CheckNotShrunk().code(), absl::StatusCode::kDataLoss);
}

std::atomic<int> g_client_signals{0};
void CountClientSignal(int) { g_client_signals.fetch_add(1); }

TEST_F(LeaseTest, AClientsSignalAndOwnerSettingsCannotReachTheDaemon) {
  // The lease was once taken on the client's own open file description, so the client's
  // fcntl(F_SETSIG) chose the signal the kernel sent the daemon when a writer came (SIGKILL,
  // SIGSTOP, ...), or one it ignores, leaving the writer waiting out lease-break-time (45 s).
  // Here the client picks SIGUSR2, counted by this process: the lease must still break
  // through the daemon's own signal, at once, and SIGUSR2 must never come.
  struct sigaction action {
  }, previous{};
  action.sa_handler = CountClientSignal;
  sigemptyset(&action.sa_mask);
  ASSERT_EQ(::sigaction(SIGUSR2, &action, &previous), 0);
  UniqueFd client(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(client.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> served =
      MappedFileSystem()->OpenFromFd(client.get(), "served");
  ASSERT_TRUE(served.ok()) << served.status();
  ASSERT_TRUE((*served)->watched_by_lease());
  ASSERT_EQ(::fcntl(client.get(), F_SETSIG, SIGUSR2), 0);
  f_owner_ex owner{F_OWNER_PID, ::getpid()};
  ASSERT_EQ(::fcntl(client.get(), F_SETOWN_EX, &owner), 0);
  const auto start = std::chrono::steady_clock::now();
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid()) << errno;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE((*served)->watched_by_lease());
  EXPECT_EQ(g_client_signals.load(), 0);
  ::sigaction(SIGUSR2, &previous, nullptr);
}

TEST_F(LeaseTest, ClosingTheFileReleasesItsLeaseForAClientThatKeepsTheDescriptor) {
  UniqueFd client(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(client.valid());
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> shared =
      MappedFileSystem()->OpenFromFd(client.get(), "shared");
  ASSERT_TRUE(shared.ok()) << shared.status();
  ASSERT_TRUE((*shared)->watched_by_lease());
  shared->reset();
  file_.reset();
  const auto start = std::chrono::steady_clock::now();
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CLOEXEC));
  ASSERT_TRUE(writer.valid());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace gpufeed
