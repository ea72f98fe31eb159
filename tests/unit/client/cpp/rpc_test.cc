// The gRPC plumbing of the client (client/cpp/rpc.h): how each way of not reaching a daemon is
// worded, whom the client trusts with its descriptors, and one unary call with a deadline.
#include "client/cpp/rpc.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/os/fd.h"
#include "common/os/unix_socket.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::client::internal {
namespace {

using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;

// Runs `check` in a child process as uid and gid `uid` (when this process may change them)
// and returns what it wrote, or "" when the child could not become `uid`.
std::string AsUid(uid_t uid, const std::function<std::string()>& check) {
  int out[2];
  if (::pipe(out) != 0) return "pipe failed";
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(out[0]);
    if (::setgid(uid) != 0 || ::setuid(uid) != 0) _exit(1);
    const std::string text = check();
    (void)!::write(out[1], text.data(), text.size());
    _exit(0);
  }
  ::close(out[1]);
  std::string text;
  char buf[512];
  ssize_t n;
  while ((n = ::read(out[0], buf, sizeof(buf))) > 0) text.append(buf, static_cast<size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return text;
}

// A socket file nobody listens on any more: what a crashed daemon leaves.
void LeaveStaleSocket(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
}

TEST(FromGrpcTest, KeepsTheCodeAndPrependsTheContext) {
  EXPECT_TRUE(FromGrpc(grpc::Status::OK, "attach").ok());
  const absl::Status s =
      FromGrpc(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "ring full"), "attach");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "attach: ring full");
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::NOT_FOUND, ""), "detach").message(),
            "detach: ");
}

TEST(CheckSocketTest, OnlyASocketFileIsADaemonToTalkTo) {
  TempDir dir;
  const std::string missing = dir.Join("none.sock");
  const absl::Status none = CheckSocket(missing);
  EXPECT_EQ(none.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(none.message(), absl::StrCat("no gpufeedd listening at ", missing,
                                         ": no socket there (is gpufeedd running? it logs "
                                         "where it listens)"));
  const std::string file = dir.WriteFile("plain.sock", "not a socket");
  EXPECT_EQ(CheckSocket(file).code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(CheckSocket(file).message()), HasSubstr(": no socket there ("));
  const std::string stale = dir.Join("stale.sock");
  LeaveStaleSocket(stale);
  EXPECT_TRUE(CheckSocket(stale).ok());  // a socket: whether anyone listens is ProbeSocket's
}

TEST(ProbeSocketTest, AStaleSocketFileIsNamedSo) {
  TempDir dir;
  const std::string stale = dir.Join("stale.sock");
  LeaveStaleSocket(stale);
  const absl::Status s = ProbeSocket(stale);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), absl::StrCat("no gpufeedd listening at ", stale,
                                      ": a stale socket file (gpufeedd stopped or crashed?)"));
  const std::string missing = dir.Join("none.sock");
  EXPECT_EQ(ProbeSocket(missing), CheckSocket(missing));
}

TEST(ProbeSocketTest, ASocketSomebodyListensOnIsOk) {
  TempDir dir;
  const std::string path = dir.Join("live.sock");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_TRUE(ProbeSocket(path).ok());
}

TEST(ProbeSocketTest, ASocketThisProcessMayNotConnectToNamesItsModeOwnerAndGroup) {
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  const std::string path = dir.Join("closed.sock");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  constexpr uid_t kStranger = 54321;
  const uid_t self = ::geteuid();
  const uid_t who = self == 0 ? kStranger : self;
  if (self != 0) {
    ASSERT_EQ(::chmod(path.c_str(), 0), 0);  // even the owner may not, then
  }
  const std::string message = AsUid(who, [&] {
    const absl::Status s = ProbeSocket(path);
    return absl::StrCat(absl::StatusCodeToString(s.code()), " ", s.message());
  });
  if (message.empty()) {
    GTEST_SKIP() << "could not run a check as uid " << who;
  }
  EXPECT_EQ(message,
            absl::StrFormat("PERMISSION_DENIED this process (uid %u, gid %u) may not connect to "
                            "%s (mode %04o, owner uid %u, group %u): join the socket's group "
                            "(e.g. usermod -aG gpufeed $USER, then log in again)",
                            who, who, path, self == 0 ? 0600 : 0, st.st_uid, st.st_gid));
}

// TrustDaemonUid's rules: tests/unit/client/cpp/session_core_test.cc. Here the words of what
// it refuses when the directory's owner is unknown and when GPUFEED_DAEMON_UID is malformed.
TEST(TrustDaemonUidTest, AnUnreadableDirectoryAndAMalformedListAreNamed) {
  const absl::Status unreadable = TrustDaemonUid(10002, 1000, std::nullopt, nullptr, "x.sock");
  EXPECT_EQ(unreadable.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(unreadable.message()),
              HasSubstr("its own uid (1000) and the owner of . (not readable); if uid 10002"));
  for (const char* bad : {"x", "10000,", "-1", "+5", "99999999999", ",10000"}) {
    const absl::Status s = TrustDaemonUid(10000, 1000, 0, bad, "/run/gpufeed/gpufeed.mem.sock");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message(), absl::StrCat("GPUFEED_DAEMON_UID: want numeric uids separated by "
                                        "commas (e.g. 998), got '",
                                        bad, "'"));
  }
}

// CheckDaemonPeer asks the kernel who the peer is and trusts as TrustDaemonUid does.
class CheckDaemonPeerTest : public ::testing::Test {
 protected:
  void SetUp() override { ::unsetenv("GPUFEED_DAEMON_UID"); }
  void TearDown() override { ::unsetenv("GPUFEED_DAEMON_UID"); }
};

TEST_F(CheckDaemonPeerTest, ThisProcessIsTrusted) {
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd a(fds[0]), b(fds[1]);
  EXPECT_TRUE(CheckDaemonPeer(a.get(), "/run/gpufeed/gpufeed.mem.sock").ok());
  // A malformed GPUFEED_DAEMON_UID is refused even then: it is a mistake worth saying.
  ::setenv("GPUFEED_DAEMON_UID", "root", 1);
  const absl::Status s = CheckDaemonPeer(a.get(), "/run/gpufeed/gpufeed.mem.sock");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "GPUFEED_DAEMON_UID: want numeric uids separated by commas (e.g. 998), got 'root'");
}

TEST_F(CheckDaemonPeerTest, NotASocketNamesTheMemorySocket) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  UniqueFd r(fds[0]), w(fds[1]);
  const absl::Status s = CheckDaemonPeer(r.get(), "/run/gpufeed/gpufeed.mem.sock");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(), absl::StrCat("memory socket /run/gpufeed/gpufeed.mem.sock: "
                                      "getsockopt(SO_PEERCRED): ",
                                      std::strerror(ENOTSOCK)));
}

// A server of another uid, in a directory this process owns: refused, naming that uid, until
// GPUFEED_DAEMON_UID names it.
TEST_F(CheckDaemonPeerTest, AServerOfAnotherUidIsRefusedUnlessNamed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a peer of another uid";
  constexpr uid_t kStranger = 54321;
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  const std::string path = dir.Join("gpufeed.mem.sock");
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, 0666);
  ASSERT_TRUE(listener.ok()) << listener.status();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(kStranger) != 0 || ::setuid(kStranger) != 0) _exit(1);
    absl::StatusOr<UniqueFd> c = ConnectUnix(path);
    char byte;
    if (c.ok()) (void)!::read(c->get(), &byte, 1);  // until the test closes its end
    _exit(c.ok() ? 0 : 2);
  }
  UniqueFd conn(::accept4(listener->get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(conn.valid()) << errno;
  const absl::Status refused = CheckDaemonPeer(conn.get(), path);
  ::setenv("GPUFEED_DAEMON_UID", "7,54321", 1);
  const absl::Status named = CheckDaemonPeer(conn.get(), path);
  conn.Reset();
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(status, 0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refused.message(),
            absl::StrCat("memory socket ", path, " is served by uid 54321, which this client "
                         "does not trust with its dataset descriptors: it trusts root, its own "
                         "uid (0) and the owner of ", dir.path(), " (uid 0); if uid 54321 runs "
                         "your node's gpufeedd, set GPUFEED_DAEMON_UID=54321"));
  EXPECT_TRUE(named.ok()) << named;
}

TEST(InOurWordsTest, TransportErrorsBecomeOnePhrase) {
  const std::string socket = "/run/gpufeed/gpufeed.sock";
  const std::vector<std::pair<absl::Status, std::string>> cases = {
      {absl::DeadlineExceededError("Deadline Exceeded"),
       "gpufeedd did not answer in time (stopped, hung or overloaded?)"},
      {absl::UnavailableError("failed to connect to all addresses; Connection refused"),
       "nothing listens on /run/gpufeed/gpufeed.sock (connection refused)"},
      {absl::UnavailableError("connect: No such file or directory (2)"),
       "no socket at /run/gpufeed/gpufeed.sock"},
      {absl::UnavailableError("keepalive watchdog timeout"),
       "gpufeedd stopped answering (no reply to keepalive pings)"},
      {absl::UnavailableError("failed to connect to all addresses"),
       "the connection to gpufeedd was lost"},
      {absl::UnavailableError("Socket closed"), "the connection to gpufeedd was lost"},
      {absl::UnavailableError("recvmsg:Connection reset by peer"),
       "the connection to gpufeedd was lost"},
      {absl::UnavailableError("sendmsg: Broken pipe"), "the connection to gpufeedd was lost"},
      {absl::UnavailableError("GOAWAY received"), "the connection to gpufeedd was lost"},
      {absl::UnavailableError("Transport closed"), "the connection to gpufeedd was lost"},
      {absl::UnavailableError("Stream removed"), "the connection to gpufeedd was lost"},
  };
  for (const auto& [status, words] : cases) EXPECT_EQ(InOurWords(status, socket), words) << status;
}

TEST(InOurWordsTest, TheDaemonsOwnWordsAreKept) {
  const std::string socket = "/run/gpufeed/gpufeed.sock";
  EXPECT_EQ(InOurWords(absl::UnavailableError("gpufeedd is draining"), socket),
            "gpufeedd is draining");
  // Transport-like text under another code is the daemon's too.
  EXPECT_EQ(InOurWords(absl::InvalidArgumentError("Connection refused by policy"), socket),
            "Connection refused by policy");
  EXPECT_EQ(InOurWords(absl::OkStatus(), socket), "");
}

TEST(DebugLogTest, WritesOneLineOnlyWhenGpufeedDebugIsSet) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process reads the variable anew
  EXPECT_EXIT(
      {
        ::setenv("GPUFEED_DEBUG", "1", 1);
        InOurWords(absl::UnavailableError("Socket closed"), "s");
        DebugLog("raw text");
        std::exit(0);
      },
      ::testing::ExitedWithCode(0),
      "gpufeed debug: the connection to gpufeedd was lost: UNAVAILABLE: Socket closed\n"
      "gpufeed debug: raw text\n");
  for (const char* off : {"", "0"}) {
    EXPECT_EXIT(
        {
          ::setenv("GPUFEED_DEBUG", off, 1);
          DebugLog("raw text");
          std::fprintf(stderr, "end");
          std::exit(0);
        },
        ::testing::ExitedWithCode(0), "^end$");
  }
}

// A daemon's Admin service that answers GetStatus after `delay`.
class SlowAdmin final : public v1::Admin::Service {
 public:
  explicit SlowAdmin(absl::Duration delay) : delay_(delay) {}
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* response) override {
    absl::SleepFor(delay_);
    response->set_version("9.9.9");
    return grpc::Status::OK;
  }

 private:
  const absl::Duration delay_;
};

class CallTest : public ::testing::Test {
 protected:
  void Serve(absl::Duration delay) {
    service_ = std::make_unique<SlowAdmin>(delay);
    socket_ = dir_.Join("admin.sock");
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix://" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }
  absl::Status GetStatus(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
                         v1::GetStatusResponse* response) {
    auto stub = v1::Admin::NewStub(std::move(channel));
    return Call(stub.get(), &v1::Admin::Stub::GetStatus, v1::GetStatusRequest(), response, timeout,
                "status");
  }

  TempDir dir_;
  std::string socket_;
  std::unique_ptr<SlowAdmin> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(CallTest, EachKindOfChannelReachesTheDaemon) {
  Serve(absl::ZeroDuration());
  for (const auto& [fresh, keepalive] :
       std::vector<std::pair<bool, absl::Duration>>{{false, absl::ZeroDuration()},
                                                     {true, absl::ZeroDuration()},
                                                     {true, absl::Seconds(10)}}) {
    v1::GetStatusResponse response;
    const absl::Status s = GetStatus(ChannelFor(socket_, fresh, keepalive), absl::Seconds(10),
                                     &response);
    ASSERT_TRUE(s.ok()) << s << " fresh " << fresh;
    EXPECT_EQ(response.version(), "9.9.9");
  }
}

TEST_F(CallTest, ADaemonTooSlowIsDeadlineExceededWithTheCallsName) {
  Serve(absl::Milliseconds(600));
  v1::GetStatusResponse response;
  const absl::Status s = GetStatus(ChannelFor(socket_), absl::Milliseconds(100), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::StartsWith("status: "));
  EXPECT_EQ(InOurWords(s, socket_), "gpufeedd did not answer in time (stopped, hung or overloaded?)");
}

TEST_F(CallTest, NoDaemonIsUnavailableWithTheCallsName) {
  socket_ = dir_.Join("none.sock");
  v1::GetStatusResponse response;
  const absl::Status s = GetStatus(ChannelFor(socket_), absl::Seconds(2), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::StartsWith("status: "));
  EXPECT_EQ(response.version(), "");
}

}  // namespace
}  // namespace gpufeed::client::internal
