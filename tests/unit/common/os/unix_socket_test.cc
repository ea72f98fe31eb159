#include "common/os/unix_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "common/os/fd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

using ::testing::HasSubstr;

// A connected pair made the way the daemon does it: listen, connect, accept.
struct Connected {
  UniqueFd listener;
  UniqueFd client;
  UniqueFd server;
};

Connected Connect(const std::string& path) {
  Connected c;
  absl::StatusOr<UniqueFd> listener = ListenUnix(path);
  EXPECT_TRUE(listener.ok()) << listener.status();
  if (!listener.ok()) return c;
  c.listener = std::move(*listener);
  absl::StatusOr<UniqueFd> client = ConnectUnix(path);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return c;
  c.client = std::move(*client);
  c.server = UniqueFd(::accept4(c.listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  EXPECT_TRUE(c.server.valid()) << std::strerror(errno);
  return c;
}

TEST(UniqueFdTest, ClosesOnDestructionAndMoves) {
  int raw = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    UniqueFd a(raw);
    UniqueFd b(std::move(a));
    EXPECT_FALSE(a.valid());
    EXPECT_EQ(b.get(), raw);
    EXPECT_NE(::fcntl(raw, F_GETFD), -1);
  }
  errno = 0;
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1);
  EXPECT_EQ(errno, EBADF);
}

TEST(UniqueFdTest, ReleaseGivesUpOwnership) {
  int raw = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    UniqueFd a(raw);
    EXPECT_EQ(a.Release(), raw);
    EXPECT_FALSE(a.valid());
  }
  EXPECT_NE(::fcntl(raw, F_GETFD), -1);  // still open
  ::close(raw);
}

TEST(UnixSocketTest, ListenConnectAcceptAndExchangeFrames) {
  testing::TempDir dir;
  const std::string path = dir.Join("mem.sock");
  Connected c = Connect(path);
  ASSERT_TRUE(c.server.valid());

  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  ASSERT_TRUE(SendFrame(c.client.get(), "hello").ok());
  ASSERT_TRUE(SendFrame(c.client.get(), "").ok());
  absl::StatusOr<Frame> f1 = RecvFrame(c.server.get(), 1024);
  ASSERT_TRUE(f1.ok()) << f1.status();
  EXPECT_EQ(f1->bytes, "hello");
  EXPECT_FALSE(f1->fd.valid());
  absl::StatusOr<Frame> f2 = RecvFrame(c.server.get(), 1024);
  ASSERT_TRUE(f2.ok()) << f2.status();
  EXPECT_EQ(f2->bytes, "");
  EXPECT_TRUE(UnixSocketInUse(path));
}

TEST(UnixSocketTest, ListenAppliesMode) {
  testing::TempDir dir;
  const std::string path = dir.Join("m.sock");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(UnixSocketTest, LargeFrameArrivesWhole) {
  testing::TempDir dir;
  Connected c = Connect(dir.Join("s"));
  ASSERT_TRUE(c.server.valid());
  std::string big(300000, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31 + 7);
  // Larger than the socket buffer: send from another thread while we receive.
  absl::Status sent;
  std::thread sender([&] { sent = SendFrame(c.client.get(), big); });
  absl::StatusOr<Frame> f = RecvFrame(c.server.get(), big.size());
  // Done reading: should RecvFrame have failed early, this unblocks the sender (EPIPE).
  ::shutdown(c.server.get(), SHUT_RDWR);
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent;
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->bytes.size(), big.size());
  EXPECT_TRUE(f->bytes == big);
}

TEST(UnixSocketTest, PassesSealedMemfdWhoseContentMatches) {
  testing::TempDir dir;
  Connected c = Connect(dir.Join("mem.sock"));
  ASSERT_TRUE(c.server.valid());

  const uint64_t size = 2 * PageSize();
  absl::StatusOr<UniqueFd> memfd = CreateSealedMemfd("unix_socket_test", size);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  {
    absl::StatusOr<Mapping> writer = Mapping::Map(memfd->get(), 0, size, /*writable=*/true);
    ASSERT_TRUE(writer.ok()) << writer.status();
    EXPECT_EQ(writer->size(), size);
    for (uint64_t i = 0; i < size; ++i) writer->data()[i] = static_cast<std::byte>(i % 251);
  }

  ASSERT_TRUE(SendFrame(c.server.get(), "slab 0", memfd->get()).ok());
  absl::StatusOr<Frame> frame = RecvFrame(c.client.get(), 64);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->bytes, "slab 0");
  ASSERT_TRUE(frame->fd.valid());
  EXPECT_NE(frame->fd.get(), memfd->get());  // a new descriptor of the same file
  EXPECT_NE(::fcntl(frame->fd.get(), F_GETFD) & FD_CLOEXEC, 0);

  struct stat st {};
  ASSERT_EQ(::fstat(frame->fd.get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), size);

  // The receiver maps the second page and reads what the sender wrote there.
  absl::StatusOr<Mapping> reader =
      Mapping::Map(frame->fd.get(), PageSize(), PageSize(), /*writable=*/false);
  ASSERT_TRUE(reader.ok()) << reader.status();
  for (uint64_t i = 0; i < PageSize(); ++i) {
    ASSERT_EQ(reader->data()[i], static_cast<std::byte>((PageSize() + i) % 251)) << i;
  }
  // And writes through its own mapping are seen by the sender's.
  {
    absl::StatusOr<Mapping> rw = Mapping::Map(frame->fd.get(), 0, size, true);
    ASSERT_TRUE(rw.ok());
    rw->data()[5] = std::byte{0xAB};
  }
  absl::StatusOr<Mapping> back = Mapping::Map(memfd->get(), 0, PageSize(), false);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->data()[5], std::byte{0xAB});

  // The received memfd carries the seals: the consumer cannot shrink it either.
  EXPECT_NE(::ftruncate(frame->fd.get(), 0), 0);
  EXPECT_EQ(errno, EPERM);
}

TEST(UnixSocketTest, RecvFrameRejectsFrameLargerThanMax) {
  testing::TempDir dir;
  Connected c = Connect(dir.Join("s"));
  ASSERT_TRUE(c.server.valid());
  ASSERT_TRUE(SendFrame(c.client.get(), std::string(100, 'x')).ok());
  absl::StatusOr<Frame> f = RecvFrame(c.server.get(), 99);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), HasSubstr("100 bytes"));
  EXPECT_THAT(f.status().message(), HasSubstr("99"));
}

TEST(UnixSocketTest, RecvFrameAcceptsFrameOfExactlyMax) {
  testing::TempDir dir;
  Connected c = Connect(dir.Join("s"));
  ASSERT_TRUE(c.server.valid());
  ASSERT_TRUE(SendFrame(c.client.get(), std::string(99, 'y')).ok());
  absl::StatusOr<Frame> f = RecvFrame(c.server.get(), 99);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->bytes, std::string(99, 'y'));
}

TEST(UnixSocketTest, RecvFrameOnPeerCloseMidMessageIsUnavailable) {
  testing::TempDir dir;
  Connected c = Connect(dir.Join("s"));
  ASSERT_TRUE(c.server.valid());
  // A header announcing 10 bytes, then only 3, then the peer goes away.
  const char partial[] = {10, 0, 0, 0, 'a', 'b', 'c'};
  ASSERT_EQ(::send(c.client.get(), partial, sizeof(partial), MSG_NOSIGNAL),
            static_cast<ssize_t>(sizeof(partial)));
  c.client.Reset();
  absl::StatusOr<Frame> f = RecvFrame(c.server.get(), 64);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kUnavailable);
}

TEST(UnixSocketTest, ListenOnLiveSocketIsAlreadyExists) {
  testing::TempDir dir;
  const std::string path = dir.Join("live.sock");
  absl::StatusOr<UniqueFd> first = ListenUnix(path);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<UniqueFd> second = ListenUnix(path);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(second.status().message(), HasSubstr(path));
  // The first listener is untouched: clients still reach it.
  absl::StatusOr<UniqueFd> client = ConnectUnix(path);
  EXPECT_TRUE(client.ok()) << client.status();
}

TEST(UnixSocketTest, StaleSocketFileIsReplaced) {
  testing::TempDir dir;
  const std::string path = dir.Join("stale.sock");
  {
    // A socket file left behind by a process that died: bound, never listening now.
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(fd.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << "the stale file should exist";
  EXPECT_FALSE(UnixSocketInUse(path));

  absl::StatusOr<UniqueFd> listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  absl::StatusOr<UniqueFd> client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(UnixSocketInUse(path));
}

TEST(UnixSocketTest, ListenNeverDeletesAFileThatIsNotASocket) {
  // Regression: ListenUnix used to unlink whatever sat at the path once nobody accepted
  // connections there, so a typo in --listen could delete a file. Only a socket is replaced.
  testing::TempDir dir;
  const std::string path = dir.WriteFile("precious.db", "do not delete");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path);
  EXPECT_FALSE(listener.ok()) << "listening on a path that held a regular file";
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0) << "the file was deleted";
  EXPECT_TRUE(S_ISREG(st.st_mode)) << "the file was replaced by a socket";
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 13u);
}

TEST(UnixSocketTest, ConnectToMissingPathIsNotFound) {
  testing::TempDir dir;
  const std::string path = dir.Join("nobody.sock");
  absl::StatusOr<UniqueFd> fd = ConnectUnix(path);
  // ErrnoToStatus maps ENOENT to NOT_FOUND.
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(fd.status().message(), HasSubstr(path));
  EXPECT_FALSE(UnixSocketInUse(path));
}

TEST(UnixSocketTest, ConnectToStaleSocketIsUnavailable) {
  testing::TempDir dir;
  const std::string path = dir.Join("stale.sock");
  {
    absl::StatusOr<UniqueFd> listener = ListenUnix(path);
    ASSERT_TRUE(listener.ok());
  }  // closed: the file stays, nobody listens
  absl::StatusOr<UniqueFd> fd = ConnectUnix(path);
  // ErrnoToStatus maps ECONNREFUSED to UNAVAILABLE.
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kUnavailable);
}

TEST(UnixSocketTest, PathTooLongIsInvalidArgument) {
  const std::string path = "/tmp/" + std::string(200, 'p');
  EXPECT_EQ(ListenUnix(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConnectUnix(path).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConnectUnix("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemfdTest, SealedMemfdCannotBeResized) {
  const uint64_t size = PageSize();
  absl::StatusOr<UniqueFd> fd = CreateSealedMemfd("sealed", size);
  ASSERT_TRUE(fd.ok()) << fd.status();
  struct stat st {};
  ASSERT_EQ(::fstat(fd->get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), size);

  errno = 0;
  EXPECT_EQ(::ftruncate(fd->get(), static_cast<off_t>(size / 2)), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::ftruncate(fd->get(), static_cast<off_t>(size * 2)), -1);
  EXPECT_EQ(errno, EPERM);
  const int seals = ::fcntl(fd->get(), F_GET_SEALS);
  EXPECT_EQ(seals, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // F_SEAL_SEAL: nobody can remove or add seals later.
  EXPECT_EQ(::fcntl(fd->get(), F_ADD_SEALS, F_SEAL_WRITE), -1);
  ASSERT_EQ(::fstat(fd->get(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), size);
}

TEST(MappingTest, UnalignedOffsetIsInvalidArgument) {
  absl::StatusOr<UniqueFd> fd = CreateSealedMemfd("m", 2 * PageSize());
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<Mapping> m = Mapping::Map(fd->get(), 100, PageSize(), false);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("100"));
  EXPECT_THAT(m.status().message(), HasSubstr("page-aligned"));
}

TEST(MappingTest, ZeroSizeIsInvalidArgument) {
  absl::StatusOr<UniqueFd> fd = CreateSealedMemfd("m", PageSize());
  ASSERT_TRUE(fd.ok());
  EXPECT_EQ(Mapping::Map(fd->get(), 0, 0, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MappingTest, BadFdFails) {
  absl::StatusOr<Mapping> m = Mapping::Map(-1, 0, PageSize(), false);
  EXPECT_FALSE(m.ok());
}

TEST(MappingTest, MoveTransfersOwnership) {
  absl::StatusOr<UniqueFd> fd = CreateSealedMemfd("m", PageSize());
  ASSERT_TRUE(fd.ok());
  absl::StatusOr<Mapping> m = Mapping::Map(fd->get(), 0, PageSize(), true);
  ASSERT_TRUE(m.ok());
  std::byte* data = m->data();
  Mapping moved(std::move(*m));
  EXPECT_EQ(m->data(), nullptr);
  EXPECT_EQ(m->size(), 0u);
  EXPECT_EQ(moved.data(), data);
  moved.data()[0] = std::byte{1};  // still mapped
  Mapping assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.data(), data);
  EXPECT_EQ(assigned.data()[0], std::byte{1});
}

}  // namespace
}  // namespace gpufeed
