// The gRPC socket's own listener over a real socket in a temp dir: the credentials it records
// are the kernel's (our uid, gid and pid), gRPC names a handed-over connection "fd:N", and the
// services look every call up by that name: unknown connections are refused, policy decides
// the rest (docs/SECURITY.md section 1).
#include "server/service/peer_listener.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/os/file.h"
#include "common/os/unix_socket.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "gtest/gtest.h"
#include "server/service/access_policy.h"
#include "server/service/feed_service.h"
#include "server/session/session_manager.h"
#include "server/staging/staging_pool.h"
#include "tests/testing/eventually.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;

AccessPolicy PolicyOf(uint32_t daemon_uid) {
  AccessPolicy p;
  p.daemon_uid = daemon_uid;
  return p;
}

using ::testing::HasSubstr;

// The fds a listener handed over, kept open (owned) until the test ends.
class HandedOver {
 public:
  std::function<void(int)> Callback() {
    return [this](int fd) {
      absl::MutexLock lock(&mu_);
      fds_.emplace_back(fd);
      ++handed_;
    };
  }
  std::vector<int> fds() {
    absl::MutexLock lock(&mu_);
    std::vector<int> out;
    for (const UniqueFd& fd : fds_) out.push_back(fd.get());
    return out;
  }
  // Closes the first fd still held.
  void CloseFirst() {
    absl::MutexLock lock(&mu_);
    if (!fds_.empty()) fds_.erase(fds_.begin());
  }
  // How many were handed over in all.
  int handed() {
    absl::MutexLock lock(&mu_);
    return handed_;
  }

 private:
  absl::Mutex mu_;
  std::vector<UniqueFd> fds_ ABSL_GUARDED_BY(mu_);
  int handed_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST(PeerListenerTest, RecordsTheKernelsCredentialsOfEachConnection) {
  testing::TempDir dir;
  const std::string path = dir.Join("g.sock");
  absl::StatusOr<std::unique_ptr<PeerListener>> listener = PeerListener::Bind(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  HandedOver handed;
  (*listener)->Start(handed.Callback());

  absl::StatusOr<UniqueFd> client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(Eventually([&] { return handed.fds().size() == 1; }));
  const int fd = handed.fds()[0];
  EXPECT_EQ(PeerListener::PeerName(fd), absl::StrCat("fd:", fd));
  std::optional<PeerCred> cred = (*listener)->Lookup(PeerListener::PeerName(fd));
  ASSERT_TRUE(cred.has_value());
  EXPECT_EQ(cred->uid, static_cast<uint32_t>(::getuid()));
  EXPECT_EQ(cred->gid, static_cast<uint32_t>(::getgid()));
  EXPECT_EQ(cred->pid, static_cast<int32_t>(::getpid()));
  // gRPC's endpoint needs a non-blocking fd; no child may inherit it.
  EXPECT_NE(::fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
  EXPECT_NE(::fcntl(fd, F_GETFD) & FD_CLOEXEC, 0);
  // Names of connections never accepted here, or not gRPC's fd names, are unknown.
  for (const std::string& peer : {absl::StrCat("fd:", fd + 1000), std::string("fd:"),
                                 std::string("fd:-1"), std::string("fd:3x"),
                                 absl::StrCat("unix:", path), std::string("")}) {
    EXPECT_FALSE((*listener)->Lookup(peer).has_value()) << peer;
  }

  // Stopped: nothing more is handed over (the connection waits in the backlog).
  (*listener)->Stop();
  (*listener)->Stop();  // idempotent
  absl::StatusOr<UniqueFd> late = ConnectUnix(path);
  ASSERT_TRUE(late.ok()) << late.status();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(handed.fds().size(), 1u);
  listener->reset();
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "the socket file outlived its listener";
}

// docs/SECURITY.md section 4: past max_connections_per_uid a connection is never handed
// over; it reads a GOAWAY naming the cap, then the end. Once a handed-over connection is
// closed (as gRPC closes one), its place is free again.
TEST(PeerListenerTest, ConnectionsPastTheCapAreRefusedWithAGoawayNamingIt) {
  testing::TempDir dir;
  const std::string path = dir.Join("g.sock");
  absl::StatusOr<std::unique_ptr<PeerListener>> listener = PeerListener::Bind(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  HandedOver handed;
  PeerListenerOptions options;
  options.max_connections_per_uid = 2;
  options.max_connections = 8;
  (*listener)->Start(handed.Callback(), options);
  std::vector<UniqueFd> clients;
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<UniqueFd> c = ConnectUnix(path);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  ASSERT_TRUE(Eventually([&] { return handed.fds().size() == 2; }));
  absl::StatusOr<UniqueFd> third = ConnectUnix(path);
  ASSERT_TRUE(third.ok()) << third.status();
  std::string got;
  char buf[1024];
  ssize_t n;
  while ((n = ::read(third->get(), buf, sizeof(buf))) > 0) got.append(buf, n);
  EXPECT_EQ(n, 0) << "the refused connection was not closed";
  // An empty SETTINGS frame, then a GOAWAY (type 7) with ENHANCE_YOUR_CALM (0xb).
  ASSERT_GE(got.size(), 9u + 9 + 8);
  EXPECT_EQ(got[3], 0x4);
  EXPECT_EQ(got[9 + 3], 0x7);
  EXPECT_EQ(got[9 + 9 + 7], 0xb);
  EXPECT_EQ(got.substr(9 + 9 + 8),
            absl::StrCat("max_connections_per_uid: uid ", ::getuid(),
                         " holds 2 connections, the most one uid may (max_connections_per_uid)"));
  EXPECT_EQ(handed.fds().size(), 2u);
  EXPECT_EQ((*listener)->connections(), 2);

  // gRPC closes a connection it was handed (here: the test): the next one takes its place.
  handed.CloseFirst();
  absl::StatusOr<UniqueFd> fourth = ConnectUnix(path);
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  ASSERT_TRUE(Eventually([&] { return handed.fds().size() == 2 && handed.handed() == 3; }));
  EXPECT_EQ((*listener)->connections(), 2);
}

TEST(PeerListenerTest, ASocketInUseIsAlreadyExists) {
  testing::TempDir dir;
  const std::string path = dir.Join("g.sock");
  absl::StatusOr<std::unique_ptr<PeerListener>> first = PeerListener::Bind(path);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<PeerListener>> second = PeerListener::Bind(path);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(second.status().message(),
            absl::StrCat("socket ", path, " is in use by another process"));
}

// The Feed and Admin services behind a PeerListener, as the daemon runs them; the peer's
// uid can be replaced (`uid_`, when set) to act as another user.
class ServedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tokens;
    for (int i = 0; i < 2002; ++i) tokens += static_cast<char>(i * 7);
    tokens_path_ = dir_.WriteFile("tokens.bin", tokens);
    absl::StatusOr<std::unique_ptr<StagingPool>> pool = StagingPool::Create(4 << 20, 4 << 20);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    SessionManagerOptions options;
    options.threads = 1;
    sessions_ = std::make_unique<SessionManager>(options, pool_.get(), PosixFileSystem());
  }

  // Serves through the listener (`own_listener`) or through gRPC's own listening port.
  void Serve(AccessPolicy policy, bool own_listener = true) {
    socket_ = dir_.Join("g.sock");
    absl::StatusOr<std::unique_ptr<PeerListener>> listener =
        PeerListener::Bind(own_listener ? socket_ : dir_.Join("unused.sock"));
    ASSERT_TRUE(listener.ok()) << listener.status();
    listener_ = std::move(*listener);
    callers_ = std::make_unique<CallerResolver>(
        [this](absl::string_view peer) {
          std::optional<PeerCred> cred = listener_->Lookup(peer);
          absl::MutexLock lock(&mu_);
          peers_asked_.emplace_back(peer);
          if (cred.has_value() && uid_ >= 0) cred->uid = static_cast<uint32_t>(uid_);
          return cred;
        },
        std::move(policy));
    feed_ = std::make_unique<FeedService>(sessions_.get(), callers_.get(), "/nonexistent", 1);
    DaemonInfo info;
    info.version = "test";
    info.started = absl::Now();
    info.pool = pool_.get();
    info.drain = [this](absl::Duration) {
      ++drains_;
      return 0;
    };
    admin_ = std::make_unique<AdminService>(sessions_.get(), callers_.get(), std::move(info));
    grpc::ServerBuilder builder;
    if (!own_listener) builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(feed_.get());
    builder.RegisterService(admin_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    grpc::Server* server = server_.get();
    listener_->Start([this, server](int fd) {
      {
        absl::MutexLock lock(&mu_);
        handed_.push_back(fd);
      }
      grpc::AddInsecureChannelFromFd(server, fd);
    });
    auto channel = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
    feed_stub_ = v1::Feed::NewStub(channel);
    admin_stub_ = v1::Admin::NewStub(channel);
  }

  void TearDown() override {
    if (listener_ != nullptr) listener_->Stop();
    if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    sessions_->Shutdown(absl::UnavailableError("test over"));
    server_.reset();
    feed_.reset();
    admin_.reset();
    listener_.reset();
  }

  void ActAs(int uid) {
    absl::MutexLock lock(&mu_);
    uid_ = uid;
  }

  v1::AttachRequest Request(const std::string& job = "raw") {
    v1::AttachRequest r;
    r.set_job(job);
    r.set_world_size(1);
    r.mutable_dataset()->set_kind(v1::DATASET_KIND_TOKENS);
    r.mutable_dataset()->set_path(tokens_path_);
    r.mutable_dataset()->set_token_dtype(v1::DTYPE_UINT16);
    r.mutable_dataset()->set_seq_len(10);
    r.set_batch_size(4);
    r.set_ring_slots(2);
    // The dataset as the client library passes it: a descriptor given on the memory socket,
    // bound to the uid acting now (only an admin may attach by path).
    PeerCred cred;
    {
      absl::MutexLock lock(&mu_);
      cred.uid = static_cast<uint32_t>(uid_ >= 0 ? uid_ : static_cast<int>(::geteuid()));
      cred.gid = cred.uid;
    }
    UniqueFd fd(::open(tokens_path_.c_str(), O_RDONLY | O_CLOEXEC));
    absl::StatusOr<std::string> handle = sessions_->AddDatasetHandle(std::move(fd), cred);
    EXPECT_TRUE(handle.ok()) << handle.status();
    if (handle.ok()) r.mutable_dataset()->set_handle(*handle);
    return r;
  }

  grpc::Status ListSessions(v1::ListSessionsResponse* out) {
    grpc::ClientContext ctx;
    return admin_stub_->ListSessions(&ctx, v1::ListSessionsRequest(), out);
  }

  testing::TempDir dir_;
  std::string tokens_path_;
  std::string socket_;
  std::unique_ptr<StagingPool> pool_;
  std::unique_ptr<SessionManager> sessions_;
  std::unique_ptr<PeerListener> listener_;
  std::unique_ptr<CallerResolver> callers_;
  std::unique_ptr<FeedService> feed_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Feed::Stub> feed_stub_;
  std::unique_ptr<v1::Admin::Stub> admin_stub_;
  std::atomic<int> drains_{0};
  absl::Mutex mu_;
  int uid_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<std::string> peers_asked_ ABSL_GUARDED_BY(mu_);
  std::vector<int> handed_ ABSL_GUARDED_BY(mu_);
};

TEST_F(ServedTest, GrpcNamesAHandedOverConnectionFdNAndTheCallIsOurs) {
  Serve(PolicyOf(static_cast<uint32_t>(::geteuid())));
  v1::ListSessionsResponse listed;
  grpc::Status s = ListSessions(&listed);
  ASSERT_TRUE(s.ok()) << s.error_message();
  absl::MutexLock lock(&mu_);
  ASSERT_EQ(handed_.size(), 1u);
  ASSERT_FALSE(peers_asked_.empty());
  EXPECT_EQ(peers_asked_.back(), absl::StrCat("fd:", handed_[0]));
  std::optional<PeerCred> cred = listener_->Lookup(peers_asked_.back());
  ASSERT_TRUE(cred.has_value());
  EXPECT_EQ(cred->uid, static_cast<uint32_t>(::getuid()));
}

TEST_F(ServedTest, ACallThroughGrpcsOwnListenerIsRefused) {
  Serve(PolicyOf(static_cast<uint32_t>(::geteuid())), /*own_listener=*/false);
  v1::ListSessionsResponse listed;
  grpc::Status s = ListSessions(&listed);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("does not know who is at the other end"));
  grpc::ClientContext ctx;
  v1::AttachResponse attached;
  s = feed_stub_->Attach(&ctx, Request(), &attached);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(sessions_->num_sessions(), 0);
  absl::MutexLock lock(&mu_);
  EXPECT_TRUE(handed_.empty());
  ASSERT_FALSE(peers_asked_.empty());
  EXPECT_THAT(peers_asked_.back(), ::testing::StartsWith("unix:"));
}

TEST_F(ServedTest, DrainIsForAdminsAndConsumingForTheAllowed) {
  AccessPolicy policy;
  policy.daemon_uid = 4300;
  policy.allow_uids = {4200};
  Serve(policy);
  ActAs(4242);
  {
    grpc::ClientContext ctx;
    v1::DrainResponse response;
    grpc::Status s = admin_stub_->Drain(&ctx, v1::DrainRequest(), &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(s.error_message(),
              "drain: only an admin may drain gpufeedd (root, uid 4300, admin_uids/admin_gids)");
    EXPECT_EQ(drains_, 0);
  }
  {
    grpc::ClientContext ctx;
    v1::AttachResponse attached;
    grpc::Status s = feed_stub_->Attach(&ctx, Request(), &attached);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_THAT(s.error_message(), HasSubstr("uid 4242 may not use gpufeedd"));
    EXPECT_EQ(sessions_->num_sessions(), 0);
  }
  {
    grpc::ClientContext ctx;  // aggregate status: everyone
    v1::GetStatusResponse status;
    EXPECT_TRUE(admin_stub_->GetStatus(&ctx, v1::GetStatusRequest(), &status).ok());
  }
  ActAs(4200);  // allowed to consume, still no admin
  {
    grpc::ClientContext ctx;
    v1::AttachResponse attached;
    grpc::Status s = feed_stub_->Attach(&ctx, Request(), &attached);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  ActAs(4300);  // the daemon's uid
  {
    grpc::ClientContext ctx;
    v1::DrainResponse response;
    grpc::Status s = admin_stub_->Drain(&ctx, v1::DrainRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(drains_, 1);
  }
}

TEST_F(ServedTest, SessionsBelongToTheUidThatAttached) {
  Serve(PolicyOf(4300));
  ActAs(4242);
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    grpc::Status s = feed_stub_->Attach(&ctx, Request(), &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  v1::ListSessionsResponse listed;
  ASSERT_TRUE(ListSessions(&listed).ok());
  ASSERT_EQ(listed.sessions_size(), 1);
  EXPECT_EQ(listed.sessions(0).owner_uid(), 4242u);
  v1::GetPositionRequest position;
  position.set_session_id(attached.session_id());
  position.set_token(attached.token());
  {
    grpc::ClientContext ctx;
    v1::GetPositionResponse response;
    EXPECT_TRUE(feed_stub_->GetPosition(&ctx, position, &response).ok());
  }

  ActAs(4243);  // another user: sees nothing, finds nothing
  listed.Clear();
  ASSERT_TRUE(ListSessions(&listed).ok());
  EXPECT_EQ(listed.sessions_size(), 0);
  {
    grpc::ClientContext ctx;
    v1::GetPositionResponse response;
    grpc::Status s = feed_stub_->GetPosition(&ctx, position, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(s.error_message(),
              absl::StrCat("no session ", attached.session_id(), " (detached or expired)"));
  }
  {
    grpc::ClientContext ctx;
    auto stream = feed_stub_->Stream(&ctx);
    v1::StreamRequest open;
    open.mutable_open()->set_session_id(attached.session_id());
    open.mutable_open()->set_token(attached.token());
    stream->Write(open);
    v1::StreamResponse reply;
    EXPECT_FALSE(stream->Read(&reply));
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  v1::DetachRequest detach;
  detach.set_session_id(attached.session_id());
  detach.set_token(attached.token());
  {
    grpc::ClientContext ctx;
    v1::DetachResponse response;
    EXPECT_EQ(feed_stub_->Detach(&ctx, detach, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(sessions_->num_sessions(), 1);
  }
  ActAs(4300);  // an admin sees it and may detach it
  listed.Clear();
  ASSERT_TRUE(ListSessions(&listed).ok());
  EXPECT_EQ(listed.sessions_size(), 1);
  {
    grpc::ClientContext ctx;
    v1::DetachResponse response;
    EXPECT_TRUE(feed_stub_->Detach(&ctx, detach, &response).ok());
    EXPECT_EQ(sessions_->num_sessions(), 0);
  }
}

}  // namespace
}  // namespace gpufeed::server
