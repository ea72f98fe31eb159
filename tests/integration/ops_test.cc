// Operating gpufeedd, against the real binaries: Prometheus metrics (values after a
// known run, promtool's lint), gRPC health on the TCP port, the config file and flag
// overrides, systemd's notify protocol, drain, gpufeedctl stats/version and its command line,
// JSON logs.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/testing/eventually.h"

namespace gpufeed::testing {
namespace {

using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

HealthCheckResponse::ServingStatus Health(const std::string& target, const std::string& service,
                                          grpc::StatusCode* code = nullptr) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  auto stub = ::grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status s = stub->Check(&ctx, request, &response);
  if (code != nullptr) *code = s.error_code();
  return s.ok() ? response.status() : HealthCheckResponse::UNKNOWN;
}

// The status code of a unary call of the Feed or Admin service on `target`.
template <typename Service, typename Request, typename Response, typename Stub>
grpc::StatusCode Call(const std::string& target,
                      grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&,
                                                   Response*)) {
  auto stub = Service::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  Request request;
  Response response;
  return ((*stub).*method)(&ctx, request, &response).error_code();
}

class OpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = dir_.Join("tokens.bin");
    WriteTokens(tokens_, 1 << 16);  // (65536 - 1) / 32 = 2047 samples of seq_len 32
  }
  std::vector<std::string> Consume(std::vector<std::string> extra) {
    std::vector<std::string> args = {"consume", "--dataset", tokens_, "--seq-len", "32",
                                     "--batch-size", "8"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  TempDir dir_;
  std::string tokens_;
};

TEST_F(OpsTest, MetricsCountWhatWasDeliveredAndPassPromtool) {
  const int port = FreePort();
  // With the job's name and uid as labels (off by default: tests/security/test_15_metrics.py).
  Daemon daemon(dir_, {absl::StrCat("--metrics_listen=127.0.0.1:", port), "--metrics_job_labels"});
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  // One epoch: 2047 samples / 8 = 255 batches of 8 x 33 uint16 = 528 bytes each.
  CtlResult run = RunCtl(daemon.socket(), Consume({"--job", "train", "--rank", "0"}),
                         dir_.Join("run"));
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::string text = HttpGet(port, "/metrics");
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(Sample(text, "gpufeed_delivered_bytes_total{delivery=\"host\"}"), 255 * 528);
  EXPECT_EQ(Sample(text, "gpufeed_delivered_bytes_total{delivery=\"device\"}"), 0);
  const double cuda = Sample(text, "gpufeed_build_info{version=\"0.1.0\",cuda=\"yes\"}");
  const double no_cuda = Sample(text, "gpufeed_build_info{version=\"0.1.0\",cuda=\"no\"}");
  EXPECT_TRUE((cuda == 1 && no_cuda == -1) || (cuda == -1 && no_cuda == 1)) << text;
  EXPECT_THAT(text, HasSubstr("# TYPE gpufeed_stage_duration_seconds histogram"));
  EXPECT_EQ(Sample(text, "gpufeed_stage_duration_seconds_count{stage=\"fill\"}"), 255);
  EXPECT_THAT(text, HasSubstr("gpufeed_staging_bytes{state=\"free\"}"));

  // While a consumer is attached: its per-job/rank series.
  Subprocess slow(CtlArgv(daemon.socket(), Consume({"--job", "slow", "--rank", "3", "--world-size",
                                                    "4", "--epochs", "0", "--max-batches",
                                                    "100000", "--step-ms", "20"})),
                  dir_.Join("slow"));
  // Until its wall time is long enough for the ratios below to mean something.
  const std::string labels = absl::StrCat("{job=\"slow\",rank=\"3\",uid=\"", ::getuid(), "\"}");
  ASSERT_TRUE(Eventually(
      [&] {
        return Sample(HttpGet(port, "/metrics"), "gpufeed_consumer_wall_seconds_total" + labels) >
               0.5;
      },
      absl::Seconds(20)))
      << slow.Stderr();
  const std::string live = HttpGet(port, "/metrics");
  EXPECT_EQ(Sample(live, "gpufeed_sessions{delivery=\"host\"}"), 1);
  // Jobs are per uid: the owner's uid is a label too.
  const double wall = Sample(live, "gpufeed_consumer_wall_seconds_total" + labels);
  const double blocked = Sample(live, "gpufeed_producer_blocked_seconds_total" + labels);
  const double wait = Sample(live, "gpufeed_consumer_wait_seconds_total" + labels);
  EXPECT_GT(wall, 0.5);
  // A consumer that takes 20 ms a step: the daemon waits for it, not the other way round.
  EXPECT_GT(blocked, 0.5 * wall);
  EXPECT_GE(wait, 0);
  EXPECT_LT(wait, 0.2 * wall);
  slow.Kill(SIGKILL);
  slow.Wait();

  // promtool's lint of a scrape, where Debian's prometheus package provides it.
  if (::system("command -v promtool >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "promtool not installed: `promtool check metrics` not run";
  }
  const std::string scrape = dir_.Join("scrape.txt");
  std::ofstream(scrape) << live;
  Subprocess lint({"/bin/sh", "-c", "promtool check metrics < " + scrape}, dir_.Join("promtool"));
  EXPECT_EQ(lint.Wait(), 0) << lint.Stdout() << lint.Stderr();
}

TEST_F(OpsTest, HealthOnTheTcpPortFollowsDrain) {
  const int port = FreePort();
  Daemon daemon(dir_, {absl::StrCat("--health_listen=127.0.0.1:", port)});
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  const std::string tcp = absl::StrCat("127.0.0.1:", port);
  const std::string unix_target = "unix://" + daemon.socket();
  EXPECT_EQ(Health(tcp, ""), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(tcp, "gpufeed.v1.Feed"), HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(unix_target, "gpufeed.v1.Feed"), HealthCheckResponse::SERVING);
  grpc::StatusCode code;
  Health(tcp, "other.Service", &code);
  EXPECT_EQ(code, grpc::StatusCode::NOT_FOUND);
  // The TCP port serves health alone: Feed and Admin are not there (no authentication on TCP),
  // and both are on the Unix socket (an empty Attach is refused there, not unknown).
  using v1::Admin;
  using v1::Feed;
  EXPECT_EQ((Call<Feed, v1::AttachRequest, v1::AttachResponse>(tcp, &Feed::Stub::Attach)),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ((Call<Feed, v1::DetachRequest, v1::DetachResponse>(tcp, &Feed::Stub::Detach)),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(
      (Call<Admin, v1::GetStatusRequest, v1::GetStatusResponse>(tcp, &Admin::Stub::GetStatus)),
      grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ((Call<Admin, v1::ListSessionsRequest, v1::ListSessionsResponse>(
                tcp, &Admin::Stub::ListSessions)),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ((Call<Feed, v1::AttachRequest, v1::AttachResponse>(unix_target, &Feed::Stub::Attach)),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ((Call<Admin, v1::GetStatusRequest, v1::GetStatusResponse>(unix_target,
                                                                      &Admin::Stub::GetStatus)),
            grpc::StatusCode::OK);
  // One consumer keeps the daemon up through the drain.
  Subprocess consumer(CtlArgv(daemon.socket(), Consume({"--job", "d", "--epochs", "0",
                                                        "--max-batches", "100000", "--step-ms",
                                                        "5"})),
                      dir_.Join("consumer"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(daemon.socket(), "d"); }, absl::Seconds(20)))
      << consumer.Stderr();
  auto admin = client::AdminClient::Connect(daemon.socket());
  ASSERT_TRUE(admin.ok());
  absl::StatusOr<int32_t> drained = (*admin)->Drain(absl::Seconds(30));
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(*drained, 1);
  EXPECT_EQ(Health(tcp, ""), HealthCheckResponse::SERVING);  // alive
  EXPECT_EQ(Health(tcp, "gpufeed.v1.Feed"), HealthCheckResponse::NOT_SERVING);  // not ready
  EXPECT_EQ(Health(unix_target, "gpufeed.v1.Feed"), HealthCheckResponse::NOT_SERVING);
  auto status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->draining);
  // New sessions are refused, naming the drain.
  CtlResult refused = RunCtl(daemon.socket(), Consume({"--job", "late", "--max-batches", "1"}),
                             dir_.Join("late"));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.err, HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(refused.err, HasSubstr("draining"));
  // The last session ends: the daemon exits, cleanly.
  consumer.Kill(SIGTERM);
  consumer.Wait();
  EXPECT_EQ(daemon.process().Wait(absl::Seconds(10)), 0) << daemon.process().Stderr();
  EXPECT_THAT(daemon.process().Stderr(), HasSubstr("drain: the last session has ended"));
}

TEST_F(OpsTest, DrainCommandWaitsForTheLastSessionOrTheTimeout) {
  Daemon daemon(dir_);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  // A finite consumer: 40 batches, 10 ms each.
  Subprocess consumer(CtlArgv(daemon.socket(), Consume({"--job", "f", "--epochs", "0",
                                                        "--max-batches", "40", "--step-ms", "10",
                                                        "-o", "json"})),
                      dir_.Join("consumer"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(daemon.socket(), "f"); }, absl::Seconds(20)))
      << consumer.Stderr();
  CtlResult drain = RunCtl(daemon.socket(), {"drain", "--timeout", "30s"}, dir_.Join("drain"));
  EXPECT_EQ(drain.exit_code, 0) << drain.err;
  EXPECT_THAT(drain.err, HasSubstr("1 sessions attached, new ones refused"));
  EXPECT_THAT(drain.err, HasSubstr("gpufeedd has exited"));
  ASSERT_EQ(consumer.Wait(), 0) << consumer.Stderr();  // it finished its 40 batches
  EXPECT_EQ(JsonInt(consumer.Stdout(), "batches"), 40);
  EXPECT_EQ(daemon.process().Wait(absl::Seconds(5)), 0);

  // A consumer that never ends: the daemon exits at the timeout and the consumer is told.
  TempDir dir2;
  WriteTokens(dir2.Join("t.bin"), 1 << 16);
  Daemon second(dir2);
  ASSERT_TRUE(second.ready());
  Subprocess forever(CtlArgv(second.socket(), {"consume", "--dataset", dir2.Join("t.bin"),
                                               "--seq-len", "32", "--batch-size", "8", "--epochs",
                                               "0", "--max-batches", "100000000", "--step-ms",
                                               "5", "--reconnect-timeout", "0"}),
                     dir2.Join("forever"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(second.socket(), ""); }, absl::Seconds(20)))
      << forever.Stderr();
  const absl::Time start = absl::Now();
  CtlResult timed = RunCtl(second.socket(), {"drain", "--timeout", "1s"}, dir2.Join("drain"));
  EXPECT_EQ(timed.exit_code, 0) << timed.err;
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_NE(forever.Wait(absl::Seconds(10)), 0);
  EXPECT_THAT(forever.Stderr(), HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(second.process().Stderr(), HasSubstr("deadline passed with 1 sessions attached"));

  CtlResult bad = RunCtl(second.socket(), {"drain", "--timeout", "soon"}, dir2.Join("bad"));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.err, HasSubstr("--timeout: want a duration such as 60s"));
}

TEST_F(OpsTest, ConfigFileIsReadValidatedAndOverriddenByFlags) {
  const std::string socket = dir_.Join("cfg.sock");
  const std::string config = dir_.Join("gpufeedd.textproto");
  std::ofstream(config) << "# comment\nlisten: \"unix://" << socket
                        << "\"\nthreads: 3\nstaging_bytes: 33554432\nlog_format: \"json\"\n";
  Subprocess daemon({GpufeeddPath(), "--config=" + config}, dir_.Join("cfg"));
  bool ready = false;
  for (int i = 0; i < 200 && !ready; ++i) {
    auto admin = client::AdminClient::Connect(socket, absl::Seconds(1));
    ready = admin.ok() && (*admin)->GetStatus().ok();
    if (!ready) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(ready) << daemon.Stderr();
  auto admin = client::AdminClient::Connect(socket);
  auto status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->staging_total_bytes, 33554432u);
  daemon.Kill(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0);
  // JSON logs: every line one object; the start-up line says 3 threads.
  bool saw = false;
  for (absl::string_view line : absl::StrSplit(daemon.Stderr(), '\n', absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(line, "{\"time\":\"") && absl::EndsWith(line, "\"}")) << line;
    saw = saw || absl::StrContains(line, "3 threads");
  }
  EXPECT_TRUE(saw) << daemon.Stderr();

  // A flag on the command line wins over the file.
  Subprocess text({GpufeeddPath(), "--config=" + config, "--log_format=text", "--threads=2"},
                  dir_.Join("cfg2"));
  ready = false;
  for (int i = 0; i < 200 && !ready; ++i) {
    auto a = client::AdminClient::Connect(socket, absl::Seconds(1));
    ready = a.ok() && (*a)->GetStatus().ok();
    if (!ready) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(ready) << text.Stderr();
  text.Kill(SIGTERM);
  EXPECT_EQ(text.Wait(), 0);
  EXPECT_THAT(text.Stderr(), HasSubstr("2 threads"));
  EXPECT_THAT(text.Stderr(), ::testing::Not(HasSubstr("{\"time\"")));

  // Bad files are fatal, naming the file, line and field.
  const std::string typo = dir_.Join("typo.textproto");
  std::ofstream(typo) << "listen: \"unix:///tmp/x.sock\"\nthread: 3\n";
  Subprocess bad({GpufeeddPath(), "--config=" + typo}, dir_.Join("typo"));
  EXPECT_EQ(bad.Wait(), 1);
  EXPECT_THAT(bad.Stderr(), HasSubstr(typo + ": line 2"));
  EXPECT_THAT(bad.Stderr(), HasSubstr("thread"));
  const std::string value = dir_.Join("value.json");
  std::ofstream(value) << "{\"listen\": \"unix://" << dir_.Join("v.sock")
                       << "\", \"readMode\": \"bogus\"}";
  Subprocess bad_value({GpufeeddPath(), "--config=" + value}, dir_.Join("value"));
  EXPECT_EQ(bad_value.Wait(), 1);
  EXPECT_THAT(bad_value.Stderr(), HasSubstr("read_mode: want mmap or pread, got 'bogus'"));
  Subprocess missing({GpufeeddPath(), "--config=" + dir_.Join("nope")}, dir_.Join("missing"));
  EXPECT_EQ(missing.Wait(), 1);
  EXPECT_THAT(missing.Stderr(), HasSubstr("config: cannot read " + dir_.Join("nope")));
}

TEST_F(OpsTest, SystemdNotifyReadyThenStopping) {
  // The test is systemd: a datagram socket whose path goes in NOTIFY_SOCKET.
  const std::string path = dir_.Join("notify.sock");
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setenv("NOTIFY_SOCKET", path.c_str(), 1);
  auto daemon = std::make_unique<Daemon>(dir_);
  ::unsetenv("NOTIFY_SOCKET");
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  auto receive = [&] {
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  };
  const std::string ready = receive();
  EXPECT_THAT(ready, HasSubstr("READY=1"));
  EXPECT_THAT(ready, HasSubstr("STATUS=serving on unix://" + daemon->socket()));
  daemon->process().Kill(SIGTERM);
  const std::string stopping = receive();
  EXPECT_THAT(stopping, HasSubstr("STOPPING=1"));
  EXPECT_EQ(daemon->process().Wait(), 0);
  ::close(fd);
}

TEST_F(OpsTest, StatsAndVersion) {
  Daemon daemon(dir_);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  Subprocess consumer(CtlArgv(daemon.socket(), Consume({"--job", "s", "--rank", "1",
                                                        "--world-size", "2", "--epochs", "0",
                                                        "--max-batches", "100000", "--step-ms",
                                                        "10"})),
                      dir_.Join("consumer"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(daemon.socket(), "s"); }, absl::Seconds(20)))
      << consumer.Stderr();
  CtlResult stats = RunCtl(daemon.socket(), {"-o", "json", "stats", "--interval", "500ms"},
                           dir_.Join("stats"));
  ASSERT_EQ(stats.exit_code, 0) << stats.err;
  // One session of job s, rank 1, at about 100 batches/s (10 ms a step): between 20 and 110.
  const size_t at = stats.out.find(R"("job":"s","rank":1,"delivery":"host",)");
  ASSERT_NE(at, std::string::npos) << stats.out;
  const std::string session = stats.out.substr(at, stats.out.find('}', at) - at);
  auto number = [&](const std::string& key) {
    const size_t k = session.find("\"" + key + "\":");
    double v = -1;
    if (k != std::string::npos) {
      const size_t start = k + key.size() + 3;
      (void)absl::SimpleAtod(session.substr(start, session.find_first_of(",}", start) - start), &v);
    }
    return v;
  };
  EXPECT_GT(number("batches_per_s"), 20) << session;
  EXPECT_LT(number("batches_per_s"), 110) << session;
  EXPECT_GT(number("producer_blocked_pct"), 50) << session;  // a slow consumer: the producer waits
  EXPECT_GE(number("consumer_wait_pct"), 0) << session;
  EXPECT_LT(number("consumer_wait_pct"), 20) << session;
  CtlResult table = RunCtl(daemon.socket(), {"stats", "--count", "1", "--interval", "200ms"},
                           dir_.Join("table"));
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, HasSubstr("PRODUCER_BLOCKED"));
  EXPECT_THAT(table.out, HasSubstr("CONSUMER_WAIT"));
  consumer.Kill(SIGKILL);

  CtlResult version = RunCtl(daemon.socket(), {"-o", "json", "version"}, dir_.Join("version"));
  EXPECT_EQ(version.exit_code, 0);
  EXPECT_EQ(version.out, "{\"gpufeedctl\":\"0.1.0\",\"gpufeedd\":\"0.1.0\"}\n");
  CtlResult wrong = RunCtl(daemon.socket(), {"stats", "--timeout", "1s"}, dir_.Join("wrong"));
  EXPECT_EQ(wrong.exit_code, 2);
  EXPECT_THAT(wrong.err, HasSubstr("stats does not take --timeout"));
}

// Sessions have an owner, the uid that attached (its peer credentials on the socket):
// `gpufeedctl sessions` shows it (docs/SECURITY.md section 1).
TEST_F(OpsTest, SessionsShowTheUidThatAttached) {
  Daemon daemon(dir_);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  Subprocess consumer(CtlArgv(daemon.socket(), Consume({"--job", "owned", "--epochs", "0",
                                                        "--max-batches", "100000", "--step-ms",
                                                        "10"})),
                      dir_.Join("consumer"));
  const std::string want = absl::StrCat("\"owner_uid\":", ::getuid(), ",\"job\":\"owned\"");
  CtlResult json;
  for (int i = 0; i < 100; ++i) {  // until the consumer has attached
    json = RunCtl(daemon.socket(), {"-o", "json", "sessions"}, dir_.Join("sessions"));
    if (json.out.find(want) != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(json.exit_code, 0) << json.err;
  EXPECT_THAT(json.out, HasSubstr(want));
  CtlResult table = RunCtl(daemon.socket(), {"sessions"}, dir_.Join("table"));
  ASSERT_EQ(table.exit_code, 0) << table.err;
  EXPECT_THAT(table.out, ::testing::StartsWith("ID  UID"));
  EXPECT_THAT(table.out,
              ::testing::ContainsRegex(absl::StrCat("\n[0-9]+ +", ::getuid(), " +owned ")));
  consumer.Kill(SIGKILL);
  consumer.Wait();
}

// gpufeedctl's command line (CLI11): help, both flag forms, base-10 integers, and the exit
// statuses: 2 for a usage error, 1 for a bad value or a failed command.
// A metrics port another process holds ends the start-up with a line naming it and exit 1,
// not a crash (the metrics server's teardown once ran on a server that never started).
TEST_F(OpsTest, AMetricsPortInUseIsAClearErrorAndExitOne) {
  const int port = FreePort();
  const std::string listen = absl::StrCat("--metrics_listen=127.0.0.1:", port);
  Daemon first(dir_, {listen});
  ASSERT_TRUE(first.ready()) << first.process().Stderr();
  TempDir other;
  Subprocess second({GpufeeddPath(), "--listen=unix://" + other.Join("gf.sock"), listen},
                    other.Join("second"));
  EXPECT_EQ(second.Wait(absl::Seconds(20)), 1) << second.Stderr();
  EXPECT_THAT(second.Stderr(),
              HasSubstr(absl::StrCat("gpufeedd cannot start: UNAVAILABLE: metrics_listen: cannot "
                                     "serve on 127.0.0.1:",
                                     port)));
}

// gpufeedd logs its address as gRPC spells it ("serving on unix:///.../gf.sock"): pasted into
// --socket, GPUFEED_SOCKET or the client library it names the same socket.
TEST_F(OpsTest, TheSocketAddressAsTheDaemonLogsItIsAccepted) {
  Daemon daemon(dir_);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  const std::string address = "unix://" + daemon.socket();
  EXPECT_THAT(daemon.process().Stderr(), HasSubstr("serving on " + address));
  EXPECT_EQ(client::SocketPath(address), daemon.socket());
  EXPECT_EQ(client::SocketPath("unix:" + daemon.socket()), daemon.socket());
  EXPECT_EQ(client::SocketPath("/a/b.sock"), "/a/b.sock");
  CtlResult status = RunCtl(address, {"status"}, dir_.Join("status"));
  EXPECT_EQ(status.exit_code, 0) << status.err;
  CtlResult run = RunCtl(address, Consume({"--max-batches", "3", "--ids", dir_.Join("u.ids")}),
                         dir_.Join("run"));
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_EQ(ReadIdsFile(dir_.Join("u.ids")).size(), 3u);
  EXPECT_TRUE(client::AdminClient::Connect(address).ok());
}

TEST_F(OpsTest, CtlCommandLine) {
  Daemon daemon(dir_);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  CtlResult help = RunCtl(daemon.socket(), {"--help"}, dir_.Join("help"));
  EXPECT_EQ(help.exit_code, 0) << help.err;
  const std::vector<std::string> consume_flags = absl::StrSplit(
      "--job --rank --world-size --kind --dataset --arrays --token-dtype --seq-len --vocab-size "
      "--batch-size --seed --no-shuffle --no-drop-last --epochs --max-batches --start-epoch "
      "--start-step --start-fingerprint --ring-slots --step-ms --timeout-ms --ids --checksum "
      "--device --ipc --pipeline --bad-sample --decode --augment --dump",
      ' ');
  for (const char* word :
       {"--socket", "--output", "status", "feeds", "sessions", "stats", "--interval", "--count",
        "drain", "--timeout", "version", "consume", "GPUFEED_SOCKET"}) {
    EXPECT_THAT(help.out, HasSubstr(word));
  }
  CtlResult consume_help = RunCtl(daemon.socket(), {"consume", "--help"}, dir_.Join("chelp"));
  EXPECT_EQ(consume_help.exit_code, 0) << consume_help.err;
  for (const std::string& flag : consume_flags) {
    EXPECT_THAT(help.out, HasSubstr(flag + " "));
    EXPECT_THAT(consume_help.out, HasSubstr(flag + " "));
  }

  // --flag=value as --flag value; integers in base 10: --seed 010 is seed 10, not octal 8.
  CtlResult inline_form =
      RunCtl(daemon.socket(),
             {"consume", "--dataset=" + tokens_, "--seq-len=32", "--batch-size=8",
              "--max-batches=3", "--seed=010", "--ids=" + dir_.Join("inline.ids"), "--output=json"},
             dir_.Join("inline"));
  ASSERT_EQ(inline_form.exit_code, 0) << inline_form.err;
  EXPECT_EQ(JsonInt(inline_form.out, "batches"), 3) << inline_form.out;
  CtlResult spaced =
      RunCtl(daemon.socket(),
             Consume({"--max-batches", "3", "--seed", "10", "--ids", dir_.Join("spaced.ids")}),
             dir_.Join("spaced"));
  ASSERT_EQ(spaced.exit_code, 0) << spaced.err;
  EXPECT_EQ(ReadFile(dir_.Join("inline.ids")), ReadFile(dir_.Join("spaced.ids")));

  struct Refusal {
    std::vector<std::string> args;
    int exit_code;
    std::string message;
  };
  const std::vector<Refusal> refusals = {
      {{"bogus"}, 2, "unknown command 'bogus'"},
      {{}, 2, "gpufeedctl: "},
      {{"status", "--bogus"}, 2, "--bogus"},
      {{"status", "extra"}, 2, "extra"},
      {{"consume", "--dataset"}, 2, "--dataset"},
      {{"-o", "xml", "status"}, 2, "xml"},
      {{"--batch-size", "8", "consume"}, 2, "--batch-size is a flag of consume"},
      {{"drain", "--count", "1"}, 2, "drain does not take --count"},
      {Consume({"--rank", "x"}), 1, "error: INVALID_ARGUMENT: --rank: 'x' is not an integer"},
      {Consume({"--seed", "0x10"}), 1, "--seed: '0x10' is not an integer"},
      {{"consume", "--batch-size", "8"}, 1, "error: INVALID_ARGUMENT: --dataset: required"},
      {Consume({"--start-epoch", "9223372036854775807", "--epochs", "1"}), 1,
       "error: INVALID_ARGUMENT: --epochs: --start-epoch + --epochs overflows int64"},
  };
  for (const Refusal& r : refusals) {
    CtlResult result = RunCtl(daemon.socket(), r.args, dir_.Join("refused"));
    EXPECT_EQ(result.exit_code, r.exit_code) << absl::StrJoin(r.args, " ") << ": " << result.err;
    EXPECT_THAT(result.err, HasSubstr(r.message)) << absl::StrJoin(r.args, " ");
  }
}

}  // namespace
}  // namespace gpufeed::testing
