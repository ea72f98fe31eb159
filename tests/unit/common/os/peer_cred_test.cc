// The kernel's word on a Unix socket's peer (common/os/peer_cred.h): uid, gid, pid and groups
// as the peer had them when it connected; the kernel's refusal as a status naming the errno.
#include "common/os/peer_cred.h"

#include <grp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/os/fd.h"
#include "common/os/unix_socket.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed {
namespace {

std::vector<uint32_t> Sorted(std::vector<uint32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<uint32_t> OwnGroups() {
  std::vector<gid_t> groups(static_cast<size_t>(::getgroups(0, nullptr)));
  groups.resize(static_cast<size_t>(::getgroups(static_cast<int>(groups.size()), groups.data())));
  return Sorted(std::vector<uint32_t>(groups.begin(), groups.end()));
}

TEST(GetPeerCredTest, ASocketpairsPeerIsThisProcess) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd a(fds[0]), b(fds[1]);
  for (int fd : {a.get(), b.get()}) {
    absl::StatusOr<PeerCred> peer = GetPeerCred(fd);
    ASSERT_TRUE(peer.ok()) << peer.status();
    EXPECT_EQ(peer->uid, ::getuid());
    EXPECT_EQ(peer->gid, ::getgid());
    EXPECT_EQ(peer->pid, ::getpid());
    EXPECT_EQ(Sorted(peer->groups), OwnGroups());
  }
}

// A forked child that connects: the peer is the child (its pid), with the groups it had then,
// here more than GetPeerCred's first guess of 16 (the kernel says how many on ERANGE).
TEST(GetPeerCredTest, AConnectingChildIsSeenWithItsPidAndAllItsGroups) {
  testing::TempDir dir;
  const std::string path = dir.Join("peer.sock");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::vector<gid_t> wanted;
  for (gid_t g = 40000; g < 40040; ++g) wanted.push_back(g);
  // Setting groups needs CAP_SETGID; without it the child keeps this process's and says so
  // with exit status kKeptGroups.
  constexpr int kKeptGroups = 4;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[1]);
    const bool kept = ::setgroups(wanted.size(), wanted.data()) != 0;
    absl::StatusOr<UniqueFd> connected = ConnectUnix(path);
    if (!connected.ok()) _exit(3);
    char c = 0;
    (void)::read(ready[0], &c, 1);  // until the parent has looked (it closes its end)
    _exit(kept ? kKeptGroups : 0);
  }
  ::close(ready[0]);
  UniqueFd conn(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(conn.valid()) << errno;
  absl::StatusOr<PeerCred> peer = GetPeerCred(conn.get());
  ::close(ready[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  const bool kept_groups = WEXITSTATUS(status) == kKeptGroups;
  EXPECT_TRUE(WEXITSTATUS(status) == 0 || kept_groups) << WEXITSTATUS(status);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(peer->pid, child);
  EXPECT_EQ(peer->uid, ::getuid());
  EXPECT_EQ(peer->gid, ::getgid());
  if (!kept_groups) {
    EXPECT_EQ(Sorted(peer->groups), std::vector<uint32_t>(wanted.begin(), wanted.end()));
  } else {
    EXPECT_EQ(Sorted(peer->groups), OwnGroups());
  }
}

TEST(GetPeerCredTest, NotASocketIsInternalNamingTheCall) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  UniqueFd r(fds[0]), w(fds[1]);
  absl::StatusOr<PeerCred> peer = GetPeerCred(r.get());
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(peer.status().message(),
            std::string("getsockopt(SO_PEERCRED): ") + std::strerror(ENOTSOCK));
  peer = GetPeerCred(-1);
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(peer.status().message(),
            std::string("getsockopt(SO_PEERCRED): ") + std::strerror(EBADF));
}

TEST(PeerCredTest, InGroupIsThePrimaryOrASupplementaryGroup) {
  PeerCred cred;
  cred.uid = 1000;
  cred.gid = 100;
  cred.groups = {27, 998};
  EXPECT_TRUE(cred.InGroup(100));
  EXPECT_TRUE(cred.InGroup(27));
  EXPECT_TRUE(cred.InGroup(998));
  EXPECT_FALSE(cred.InGroup(1000));  // the uid is no group
  EXPECT_FALSE(cred.InGroup(0));
  cred.groups.clear();
  EXPECT_TRUE(cred.InGroup(100));
  EXPECT_FALSE(cred.InGroup(27));
}

TEST(PeerCredTest, ToStringNamesUidAndPid) {
  PeerCred cred;
  cred.uid = 1000;
  cred.gid = 5;
  cred.pid = 4242;
  EXPECT_EQ(cred.ToString(), "uid 1000 (pid 4242)");
  EXPECT_EQ(PeerCred().ToString(), "uid 0 (pid 0)");
}

}  // namespace
}  // namespace gpufeed
