// Transparent re-attach: gpufeedd is killed (SIGKILL) or stopped (SIGTERM) while
// 3 ranks of one job consume 2 epochs, and started again on the same socket; every rank goes
// on where it was and its id stream and checksum equal a fault-free run's.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/os/fd.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/testing/eventually.h"
#include "tests/testing/image_files.h"

namespace gpufeed::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kWorld = 3;
constexpr int64_t kSeqLen = 16;
constexpr int64_t kBatch = 4;
constexpr size_t kTokens = 20000;  // 1249 samples
constexpr int64_t kSteps = (kTokens - 1) / kSeqLen / (kWorld * kBatch);  // 104 per epoch
constexpr int64_t kBatches = 2 * kSteps;  // per rank

// The sessions of `job` at the daemon on `socket` now (empty when it does not answer).
std::vector<client::SessionSummary> JobSessions(const std::string& socket, const std::string& job) {
  std::vector<client::SessionSummary> out;
  auto admin = client::AdminClient::Connect(socket, absl::Seconds(1));
  if (!admin.ok()) return out;
  auto sessions = (*admin)->ListSessions();
  if (!sessions.ok()) return out;
  for (const client::SessionSummary& s : *sessions) {
    if (s.job == job) out.push_back(s);
  }
  return out;
}

// The fewest batches any of the `world` ranks of `job` has been sent (absolute: epoch *
// steps_per_epoch + step); -1 until all of them are attached.
int64_t SlowestRank(const std::string& socket, const std::string& job, int world,
                    int64_t steps_per_epoch) {
  const std::vector<client::SessionSummary> sessions = JobSessions(socket, job);
  if (sessions.size() != static_cast<size_t>(world)) return -1;
  int64_t slowest = std::numeric_limits<int64_t>::max();
  for (const client::SessionSummary& s : sessions) {
    slowest = std::min(slowest, s.delivered.epoch * steps_per_epoch + s.delivered.step);
  }
  return slowest;
}

class ReattachTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    tokens_path_ = dir_.Join("tokens.bin");
    tokens_ = WriteTokens(tokens_path_, kTokens);
    StartDaemon();
  }

  void StartDaemon() {
    metrics_port_ = FreePort();
    daemon_ = std::make_unique<Daemon>(
        dir_, std::vector<std::string>{absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_)});
    ASSERT_TRUE(daemon_->ready()) << daemon_->process().Stderr();
  }

  std::unique_ptr<Subprocess> Rank(const std::string& job, int rank,
                                   std::vector<std::string> more) {
    std::vector<std::string> args = {
        "consume", "--dataset", tokens_path_, "--seq-len", absl::StrCat(kSeqLen),
        "--token-dtype", "uint16", "--job", job, "--rank", absl::StrCat(rank),
        "--world-size", absl::StrCat(kWorld), "--batch-size", absl::StrCat(kBatch), "--seed",
        "11", "--epochs", "2", "--ring-slots", "4", "--ids", IdsPath(job, rank), "--checksum",
        "-o", "json"};
    args.insert(args.end(), more.begin(), more.end());
    return std::make_unique<Subprocess>(CtlArgv(daemon_->socket(), args),
                                        dir_.Join(absl::StrCat(job, rank)));
  }

  std::string IdsPath(const std::string& job, int rank) const {
    return dir_.Join(absl::StrCat(job, rank, ".ids"));
  }

  std::vector<client::SessionSummary> Sessions(const std::string& job) {
    return JobSessions(daemon_->socket(), job);
  }
  int64_t SlowestDelivered(const std::string& job) {
    return SlowestRank(daemon_->socket(), job, kWorld, kSteps);
  }

  TempDir dir_;
  std::string tokens_path_;
  std::vector<uint16_t> tokens_;
  std::unique_ptr<Daemon> daemon_;
  int metrics_port_ = 0;
};

constexpr int kDrain = 0;  // not a signal: `gpufeedctl drain --timeout 300ms`

const char* FaultName(int fault) {
  return fault == SIGKILL ? "SIGKILL" : fault == SIGTERM ? "SIGTERM" : "drain";
}

// 3 ranks x 2 epochs; the daemon goes down (SIGKILL, SIGTERM, or a drain that times out) at 3
// moments (the slowest rank past 30, 90 and 150 of its 208 batches) and comes back on the same
// socket after 0.2 to 2 s. Every rank exits 0
// with the same ids, in the same order, and the same checksum as a fault-free run.
TEST_P(ReattachTest, RanksResumeExactlyAcrossDaemonRestarts) {
  const int signal = GetParam();
  // The fault-free run.
  std::vector<std::unique_ptr<Subprocess>> ref;
  for (int r = 0; r < kWorld; ++r) ref.push_back(Rank("ref", r, {}));
  for (int r = 0; r < kWorld; ++r) ASSERT_EQ(ref[r]->Wait(), 0) << ref[r]->Stderr();

  // The same job under faults; 10 ms a batch so that the restarts fall mid-epoch. A drain
  // ends the streams only when it times out: they run on through the 300 ms, the daemon's
  // 100 ms drain poll and its shutdown, 0.45 to 0.65 s in all (44 to 60 batches at 10 ms)
  // under ASan on 2 cores, while after the third moment the fastest rank has ~50 batches
  // left. At 10 ms a rank could take its last batch before the drain ends and so have nothing
  // to re-attach; at 30 ms that run-on is ~20 batches.
  const std::string step_ms = signal == kDrain ? "30" : "10";
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < kWorld; ++r) ranks.push_back(Rank("f", r, {"--step-ms", step_ms}));
  const int64_t kMoments[] = {30, 90, 150};
  const absl::Duration kDown[] = {absl::Milliseconds(200), absl::Milliseconds(1100),
                                  absl::Milliseconds(2000)};
  std::vector<double> resumed_after_ready_ms, outage_ms;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Eventually([&] { return SlowestDelivered("f") >= kMoments[i]; },
                           absl::Seconds(60)))
        << "moment " << i << ": the ranks did not get past batch " << kMoments[i];
    const absl::Time killed = absl::Now();
    if (signal == kDrain) {
      // The streams run on through the drain, then end with UNAVAILABLE when it times out.
      CtlResult drained = RunCtl(daemon_->socket(), {"drain", "--timeout", "300ms"},
                                 dir_.Join(absl::StrCat("drain", i)));
      ASSERT_EQ(drained.exit_code, 0) << drained.err;
    } else {
      daemon_->process().Kill(signal);
    }
    ASSERT_NE(daemon_->process().Wait(absl::Seconds(20)), -1) << "the daemon did not exit";
    // The fault must fall before any rank's last batch, or that rank has nothing to re-attach.
    for (int r = 0; r < kWorld; ++r) {
      ASSERT_TRUE(ranks[r]->Running())
          << "restart " << i << ": rank " << r << " ended before the daemon went down (exit "
          << ranks[r]->Wait() << ")\n"
          << ranks[r]->Stderr();
    }
    absl::SleepFor(kDown[i]);  // the fault's shape, not a wait for a condition
    StartDaemon();
    const absl::Time ready = absl::Now();
    // Each rank re-attaches its own rank (the new daemon refuses a second one) and streams.
    ASSERT_TRUE(Eventually(
        [&] {
          const std::vector<client::SessionSummary> s = Sessions("f");
          return s.size() == static_cast<size_t>(kWorld) &&
                 std::all_of(s.begin(), s.end(), [](const client::SessionSummary& x) {
                   return x.streaming && x.batches_delivered > 0;
                 });
        },
        absl::Seconds(30)))
        << "restart " << i << ": the ranks did not re-attach";
    resumed_after_ready_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - ready));
    outage_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - killed));
    std::printf("restart %d: ranks streaming %.0f ms after the new daemon answered, %.0f ms "
                "after the kill\n",
                i, resumed_after_ready_ms.back(), outage_ms.back());
  }
  // The last daemon saw each rank resume once, and logged it with the gap.
  EXPECT_EQ(Sample(HttpGet(metrics_port_, "/metrics"), "gpufeed_resumed_sessions_total"), kWorld);
  const std::string log = daemon_->process().Stderr();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_THAT(log, ::testing::ContainsRegex(absl::StrCat(
                         "resume: session [0-9]+ uid [0-9]+ job 'f' rank ", r,
                         " goes on at \\([01], [0-9]+\\) after [0-9.]+m?s without a stream")))
        << log;
  }
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(ranks[r]->Wait(), 0) << ranks[r]->Stderr();
    const std::string want = ReadFile(IdsPath("ref", r));
    EXPECT_EQ(ReadFile(IdsPath("f", r)), want) << "rank " << r << ": another id stream";
    const std::vector<IdsLine> lines = ReadIdsFile(IdsPath("f", r));
    ASSERT_EQ(lines.size(), static_cast<size_t>(kBatches));
    const int64_t checksum = JsonInt(ranks[r]->Stdout(), "checksum");
    EXPECT_EQ(checksum, JsonInt(ref[r]->Stdout(), "checksum"));
    EXPECT_EQ(static_cast<uint64_t>(checksum), TokensChecksum(tokens_, kSeqLen, lines));
  }
  std::printf(
      "%s restarts: ranks streaming again %.0f ms (p50) / %.0f ms (max) after the new daemon "
      "answered; kill to streaming %.0f / %.0f ms (down 0.2, 1.1, 2 s)\n",
      FaultName(signal), Percentile(resumed_after_ready_ms, 0.5),
      Percentile(resumed_after_ready_ms, 1.0), Percentile(outage_ms, 0.5),
      Percentile(outage_ms, 1.0));
}

INSTANTIATE_TEST_SUITE_P(Faults, ReattachTest, ::testing::Values(SIGKILL, SIGTERM, kDrain),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(FaultName(info.param));
                         });

// The image path under the same faults, on the CPU: 2 ranks of an ImageFolder job of noise
// JPEGs (many sizes, four subsamplings) through a random resized crop, where the daemon
// decodes only each crop box (--region_decode, the default). Three daemons in turn:
// --noregion_decode (every file decoded whole: the reference path), the default, and the
// default SIGKILLed twice mid-stream and started again. Every rank's ids and image checksum
// equal the reference's, and the daemons' decode counters show which path ran.
class ReattachImagesTest : public ::testing::Test {
 protected:
  static constexpr int kRanks = 2;
  static constexpr int kImages = 240;
  static constexpr int64_t kPerEpoch = kImages / (kRanks * kBatch);  // 30 steps
  static constexpr int64_t kImageBatches = 2 * kPerEpoch;            // per rank

  void SetUp() override {
    const int kSubsampling[] = {TJSAMP_420, TJSAMP_422, TJSAMP_444, TJSAMP_440};
    uint32_t state = 12345;
    for (int i = 0; i < kImages; ++i) {
      const int h = 40 + (i * 37) % 101, w = 40 + (i * 53) % 137;
      std::vector<uint8_t> pixels(static_cast<size_t>(h) * w * 3);
      for (uint8_t& p : pixels) {  // noise: a pixel taken from a wrong place shows
        state = state * 1664525u + 1013904223u;
        p = static_cast<uint8_t>(state >> 24);
      }
      WriteFileBytes(dir_.Join(absl::StrCat("images/c", i % 3, "/", i, ".jpg")),
                     EncodeJpeg(pixels, h, w, TJPF_RGB, kSubsampling[i % 4], 90));
    }
    std::ofstream(dir_.Join("pipeline.json"))
        << R"({"ops": [{"random_resized_crop": {"size": 24}}, {"flip": {"p": 0.5}},
                       {"cast": {"dtype": "DTYPE_UINT8"}},
                       {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}}]})";
  }

  void StartDaemon(std::vector<std::string> flags) {
    metrics_port_ = FreePort();
    flags.push_back(absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_));
    daemon_.reset();
    daemon_ = std::make_unique<Daemon>(dir_, flags);
    ASSERT_TRUE(daemon_->ready()) << daemon_->process().Stderr();
  }

  std::unique_ptr<Subprocess> Rank(const std::string& job, int rank,
                                   std::vector<std::string> more = {}) {
    std::vector<std::string> args = {"consume",
                                     "--kind",
                                     "image_folder",
                                     "--dataset",
                                     dir_.Join("images"),
                                     "--pipeline",
                                     dir_.Join("pipeline.json"),
                                     "--job",
                                     job,
                                     "--rank",
                                     absl::StrCat(rank),
                                     "--world-size",
                                     absl::StrCat(kRanks),
                                     "--batch-size",
                                     absl::StrCat(kBatch),
                                     "--seed",
                                     "5",
                                     "--epochs",
                                     "2",
                                     "--ring-slots",
                                     "3",
                                     "--ids",
                                     IdsPath(job, rank),
                                     "--checksum",
                                     "-o",
                                     "json"};
    args.insert(args.end(), more.begin(), more.end());
    return std::make_unique<Subprocess>(CtlArgv(daemon_->socket(), args),
                                        dir_.Join(absl::StrCat(job, rank)));
  }

  std::string IdsPath(const std::string& job, int rank) const {
    return dir_.Join(absl::StrCat(job, rank, ".ids"));
  }

  // The job's ranks, run to the end: each one's stdout.
  std::vector<std::string> RunJob(const std::string& job) {
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = 0; r < kRanks; ++r) ranks.push_back(Rank(job, r));
    std::vector<std::string> out;
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(ranks[r]->Wait(), 0) << ranks[r]->Stderr();
      out.push_back(ranks[r]->Stdout());
    }
    return out;
  }

  // gpufeed_decodes_total{decoder=...} of the daemon now.
  int64_t Decodes(const std::string& decoder) {
    return static_cast<int64_t>(
        Sample(HttpGet(metrics_port_, "/metrics"),
               absl::StrCat("gpufeed_decodes_total{decoder=\"", decoder, "\"}")));
  }

  int64_t SlowestDelivered(const std::string& job) {
    return SlowestRank(daemon_->socket(), job, kRanks, kPerEpoch);
  }

  TempDir dir_;
  std::unique_ptr<Daemon> daemon_;
  int metrics_port_ = 0;
};

TEST_F(ReattachImagesTest, RegionDecodedRanksResumeExactlyAndEqualWholeFileDecodes) {
  constexpr int64_t kDecodes = kRanks * kImageBatches * kBatch;  // 480: each sample once a rank
  // The reference: every file decoded whole.
  StartDaemon({"--noregion_decode"});
  const std::vector<std::string> whole = RunJob("whole");
  EXPECT_EQ(Decodes("cpu"), kDecodes);
  EXPECT_EQ(Decodes("cpu_region"), 0);

  // The default: most crops are decoded as a region; the batches are the same bytes.
  StartDaemon({});
  const std::vector<std::string> region = RunJob("region");
  const int64_t regions = Decodes("cpu_region");
  EXPECT_EQ(regions + Decodes("cpu"), kDecodes);
  EXPECT_GE(regions, kDecodes * 9 / 10)
      << "the region decode hardly ran: the comparison shows little";
  std::printf("%ld of %ld decodes cut to the crop box\n", static_cast<long>(regions),
              static_cast<long>(kDecodes));
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(ReadFile(IdsPath("region", r)), ReadFile(IdsPath("whole", r))) << "rank " << r;
    EXPECT_EQ(ReadIdsFile(IdsPath("whole", r)).size(), static_cast<size_t>(kImageBatches));
    EXPECT_EQ(JsonInt(region[r], "checksum"), JsonInt(whole[r], "checksum"))
        << "rank " << r << ": the region decode gave other pixels than the whole decode";
  }

  // The default under two SIGKILLs, 20 ms a batch so that they fall mid-epoch: at the slowest
  // rank's batches 12 and 30 of 60, so that even the fastest (the ranks re-attach on their own
  // backoff, up to ~200 ms apart) has batches left to re-attach for.
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < kRanks; ++r) ranks.push_back(Rank("f", r, {"--step-ms", "20"}));
  for (const int64_t moment : {12, 30}) {
    ASSERT_TRUE(Eventually([&] { return SlowestDelivered("f") >= moment; }, absl::Seconds(60)))
        << "the ranks did not get past batch " << moment;
    daemon_->process().Kill(SIGKILL);
    ASSERT_NE(daemon_->process().Wait(absl::Seconds(20)), -1) << "the daemon did not exit";
    for (int r = 0; r < kRanks; ++r) {
      ASSERT_TRUE(ranks[r]->Running())
          << "rank " << r << " ended before the kill at " << moment << "\n"
          << ranks[r]->Stderr();
    }
    StartDaemon({});
    ASSERT_TRUE(Eventually([&] { return SlowestDelivered("f") >= 0; }, absl::Seconds(30)))
        << "the ranks did not re-attach after the kill at " << moment;
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(ranks[r]->Wait(), 0) << ranks[r]->Stderr();
    EXPECT_EQ(ReadFile(IdsPath("f", r)), ReadFile(IdsPath("whole", r)))
        << "rank " << r << ": another id stream after the kills";
    EXPECT_EQ(JsonInt(ranks[r]->Stdout(), "checksum"), JsonInt(whole[r], "checksum"))
        << "rank " << r << ": other pixels after the kills";
  }
  // The last daemon served the rest of both ranks' streams, mostly as regions.
  EXPECT_GT(Decodes("cpu_region"), 0);
  EXPECT_EQ(Sample(HttpGet(metrics_port_, "/metrics"), "gpufeed_resumed_sessions_total"), kRanks);
}

// The daemon at `socket` answers, and its first session has been sent a batch.
// Past --reconnect-timeout, the consumer fails naming the socket and how long it waited.

TEST(ReattachBoundTest, ADaemonThatDoesNotComeBackFailsNamingTheSocketAndTheWait) {
  TempDir dir;
  WriteTokens(dir.Join("t.bin"), kTokens);
  auto daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  Subprocess consumer(
      CtlArgv(daemon->socket(), {"consume", "--dataset", dir.Join("t.bin"), "--seq-len", "16",
                                 "--batch-size", "4", "--epochs", "0", "--max-batches",
                                 "100000000", "--step-ms", "5", "--reconnect-timeout", "1s"}),
      dir.Join("consumer"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(daemon->socket(), ""); }, absl::Seconds(10)));
  daemon->process().Kill(SIGKILL);
  ASSERT_NE(daemon->process().Wait(absl::Seconds(10)), -1);
  const absl::Time killed = absl::Now();
  EXPECT_EQ(consumer.Wait(absl::Seconds(20)), 1);
  EXPECT_GE(absl::Now() - killed, absl::Seconds(1));
  // The socket file stays after a SIGKILL: the last attempt's error, in our words.
  EXPECT_THAT(consumer.Stderr(),
              HasSubstr(absl::StrCat("UNAVAILABLE: gpufeedd at ", daemon->socket(),
                                     " did not come back within 1 s (last: nothing listens on ",
                                     daemon->socket(), " (connection refused))")));
  EXPECT_THAT(consumer.Stderr(), Not(HasSubstr("failed to connect to all addresses")));
}

// --timeout-ms bounds the wait on a daemon that is there; while gpufeedd is away,
// --reconnect-timeout does: an outage of 1.5 s does not end a consumer with --timeout-ms 300.
TEST(ReattachBoundTest, AnOutageLongerThanTimeoutMsIsRiddenThrough) {
  TempDir dir;
  const std::vector<uint16_t> tokens = WriteTokens(dir.Join("t.bin"), kTokens);
  auto daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  Subprocess consumer(
      CtlArgv(daemon->socket(), {"consume", "--dataset", dir.Join("t.bin"), "--seq-len", "16",
                                 "--batch-size", "4", "--step-ms", "5", "--timeout-ms", "300",
                                 "--ids", dir.Join("c.ids"), "--checksum", "-o", "json"}),
      dir.Join("consumer"));
  ASSERT_TRUE(
      Eventually([&] { return ReadIdsFile(dir.Join("c.ids")).size() >= 20; }, absl::Seconds(20)));
  daemon->process().Kill(SIGKILL);
  ASSERT_NE(daemon->process().Wait(absl::Seconds(10)), -1);
  absl::SleepFor(absl::Milliseconds(1500));  // the outage's length, not a wait for a state
  daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  ASSERT_EQ(consumer.Wait(), 0) << consumer.Stderr();
  const std::vector<IdsLine> lines = ReadIdsFile(dir.Join("c.ids"));
  ASSERT_EQ(lines.size(), static_cast<size_t>((kTokens - 1) / 16 / 4));  // one epoch
  for (size_t i = 0; i < lines.size(); ++i) EXPECT_EQ(lines[i].step, static_cast<int64_t>(i));
  EXPECT_EQ(static_cast<uint64_t>(JsonInt(consumer.Stdout(), "checksum")),
            TokensChecksum(tokens, 16, lines));
}

// A daemon that stops answering without closing its socket (SIGSTOP): the keepalive pings
// find it (1 s, then 1 s for the answer), the re-attach tries for --reconnect-timeout (its
// calls cut short by that bound), then the consumer fails naming the socket and the wait, in
// about 2 x keepalive + reconnect_timeout, not at --timeout-ms (10 minutes here).
TEST(ReattachBoundTest, AStoppedDaemonIsFoundByKeepaliveAndFailsWithinTheBound) {
  TempDir dir;
  WriteTokens(dir.Join("t.bin"), kTokens);
  auto daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  Subprocess consumer(
      CtlArgv(daemon->socket(),
              {"consume", "--dataset", dir.Join("t.bin"), "--seq-len", "16", "--batch-size", "4",
               "--epochs", "0", "--max-batches", "100000000", "--step-ms", "5",
               "--reconnect-timeout", "3s", "--keepalive", "1s", "--timeout-ms", "600000"}),
      dir.Join("consumer"));
  ASSERT_TRUE(Eventually([&] { return JobHasDelivered(daemon->socket(), ""); }, absl::Seconds(10)));
  daemon->process().Kill(SIGSTOP);
  const absl::Time stopped = absl::Now();
  const int exit_code = consumer.Wait(absl::Seconds(30));
  const absl::Duration took = absl::Now() - stopped;
  daemon->process().Kill(SIGCONT);  // for its orderly end
  ASSERT_EQ(exit_code, 1) << consumer.Stderr();
  EXPECT_GE(took, absl::Seconds(3)) << "gave up before --reconnect-timeout";
  EXPECT_LE(took, absl::Seconds(12)) << "2 x 1 s of keepalive + 3 s, with slack";
  EXPECT_THAT(consumer.Stderr(),
              HasSubstr(absl::StrCat("UNAVAILABLE: gpufeedd at ", daemon->socket(),
                                     " did not come back within 3 s (last: gpufeedd did not "
                                     "answer in time (stopped, hung or overloaded?))")));
  std::printf("stopped daemon: the consumer failed %.1f s after SIGSTOP\n",
              absl::ToDoubleSeconds(took));
}

// A consumer killed between Attach and opening its stream: its ring is freed within 1 s (the
// daemon sees its lifeline close), not after --attach_timeout (60 s here). Before the ring is
// mapped and after.
class ReclaimTest : public ::testing::TestWithParam<bool> {};

TEST_P(ReclaimTest, AConsumerKilledBeforeItsStreamFreesItsRingWithinASecond) {
  const bool mapped = GetParam();
  TempDir dir;
  WriteTokens(dir.Join("t.bin"), kTokens);
  const int port = FreePort();
  Daemon daemon(dir, {"--attach_timeout=60s", absl::StrCat("--metrics_listen=127.0.0.1:", port)});
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  auto admin = client::AdminClient::Connect(daemon.socket(), absl::Seconds(5));
  ASSERT_TRUE(admin.ok()) << admin.status();
  absl::StatusOr<client::DaemonStatus> before = (*admin)->GetStatus();
  ASSERT_TRUE(before.ok()) << before.status();

  std::vector<std::string> argv = {ATTACH_ONLY_PATH, daemon.socket(), dir.Join("t.bin")};
  if (mapped) argv.push_back("map");
  Subprocess orphan(argv, dir.Join("orphan"));
  ASSERT_TRUE(Eventually([&] { return absl::StrContains(orphan.Stdout(), "attached "); },
                         absl::Seconds(20)))
      << orphan.Stderr();
  absl::StatusOr<std::vector<client::SessionSummary>> sessions = (*admin)->ListSessions();
  ASSERT_TRUE(sessions.ok()) << sessions.status();
  ASSERT_EQ(sessions->size(), 1u);
  EXPECT_EQ((*sessions)[0].job, "orphan");
  EXPECT_FALSE((*sessions)[0].streaming);
  absl::StatusOr<client::DaemonStatus> attached = (*admin)->GetStatus();
  ASSERT_TRUE(attached.ok());
  EXPECT_EQ(attached->staging_free_bytes + (*sessions)[0].ring_bytes, before->staging_free_bytes);

  orphan.Kill(SIGKILL);
  ASSERT_NE(orphan.Wait(absl::Seconds(10)), -1);
  const absl::Time killed = absl::Now();
  // The bound is the behaviour under test (the reaper looks every 100 ms).
  EXPECT_TRUE(Eventually(
      [&] {
        auto s = (*admin)->GetStatus();
        return s.ok() && s->sessions == 0 && s->staging_free_bytes == before->staging_free_bytes;
      },
      absl::Seconds(1)))
      << "the ring was not freed within 1 s of the consumer's death";
  std::printf("orphaned session freed %.0f ms after the consumer was killed\n",
              absl::ToDoubleMilliseconds(absl::Now() - killed));
  EXPECT_EQ(Sample(HttpGet(port, "/metrics"),
                   "gpufeed_sessions_reclaimed_total{reason=\"consumer_gone\"}"),
            1);
  EXPECT_TRUE(Eventually(
      [&] {
        return absl::StrContains(daemon.process().Stderr(),
                                 "consumer gone before its stream: session ");
      },
      absl::Seconds(5)))
      << daemon.process().Stderr();
}

INSTANTIATE_TEST_SUITE_P(Orphan, ReclaimTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "RingMapped" : "AttachedOnly");
                         });

// The C++ client's options for the token file at `dataset`: 8 rows of kSeqLen a batch, in
// file order.
client::AttachOptions InOrderOptions(const std::string& socket, const std::string& job,
                                     const std::string& dataset, int32_t ring_slots) {
  client::AttachOptions o;
  o.socket = socket;
  o.job = job;
  o.dataset = dataset;
  o.token_dtype = "uint16";
  o.seq_len = kSeqLen;
  o.batch_size = 8;
  o.shuffle = false;
  o.ring_slots = ring_slots;
  return o;
}

// Every row of `b` (of InOrderOptions) is the sample of its step in file order, and holds
// that sample's bytes of `tokens`.
bool RowsAreTheFile(const client::Batch& b, const std::vector<uint16_t>& tokens) {
  const auto* data = static_cast<const uint16_t*>(b.tensor("tokens")->data);
  for (int64_t r = 0; r < 8; ++r) {
    if (b.ids()[r] != b.step() * 8 + r) return false;  // no shuffle
    if (std::memcmp(data + r * (kSeqLen + 1), &tokens[b.ids()[r] * kSeqLen], (kSeqLen + 1) * 2) !=
        0) {
      return false;
    }
  }
  return true;
}

// In-process, the C++ client: a batch handed out before the restart stays readable (its old
// mapping) and its release goes nowhere (not to the new session, which would refuse it or,
// worse, free a slot of its own); the stream goes on at the next step.
TEST(ReattachClientTest, AHeldBatchOutlivesTheRestartAndItsReleaseGoesNowhere) {
  TempDir dir;
  const std::vector<uint16_t> tokens = WriteTokens(dir.Join("t.bin"), kTokens);
  auto daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  client::AttachOptions o = InOrderOptions(daemon->socket(), "cpp", dir.Join("t.bin"), 4);
  o.stop_epoch = 1;
  o.reconnect_timeout = absl::Seconds(30);
  constexpr int64_t kSteps1 = (kTokens - 1) / kSeqLen / 8;  // 156
  auto session = client::Session::Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<client::Batch> held = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(held.ok()) << held.status();
  int64_t step = 1;
  for (; step < 3; ++step) {
    absl::StatusOr<client::Batch> b = (*session)->Next(absl::Seconds(10));
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->step(), step);
  }
  daemon->process().Kill(SIGKILL);
  ASSERT_NE(daemon->process().Wait(absl::Seconds(10)), -1);
  daemon = std::make_unique<Daemon>(dir);
  ASSERT_TRUE(daemon->ready()) << daemon->process().Stderr();
  while (true) {
    absl::StatusOr<client::Batch> b = (*session)->Next(absl::Seconds(20));
    if (absl::IsOutOfRange(b.status())) break;
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(b->epoch(), 0);
    ASSERT_EQ(b->step(), step) << "a batch lost or repeated across the restart";
    ASSERT_TRUE(RowsAreTheFile(*b, tokens)) << "step " << step;
    if (step == 10) {
      EXPECT_EQ(held->step(), 0);
      EXPECT_TRUE(RowsAreTheFile(*held, tokens)) << "the held batch changed";
      held->Release();
    }
    ++step;
  }
  EXPECT_EQ(step, kSteps1);
  EXPECT_EQ((*session)->rejected_releases(), 0);
  EXPECT_EQ((*session)->position().epoch, 1);
}

// The daemon frees an ended host ring's pages (docs/SECURITY.md section 3), so a C++ Session
// destroyed while one of its batches is still held detaches only when that batch is
// released: the held batch keeps its bytes, and the session then goes.
TEST(ReattachClientTest, ABatchHeldPastItsSessionKeepsItsBytesAndTheDetachWaitsForIt) {
  TempDir dir;
  const std::vector<uint16_t> tokens = WriteTokens(dir.Join("t.bin"), kTokens);
  Daemon daemon(dir);
  ASSERT_TRUE(daemon.ready()) << daemon.process().Stderr();
  auto session =
      client::Session::Attach(InOrderOptions(daemon.socket(), "held", dir.Join("t.bin"), 2));
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<client::Batch> held = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(held.ok()) << held.status();
  auto sessions = [&] {
    auto admin = client::AdminClient::Connect(daemon.socket(), absl::Seconds(5));
    EXPECT_TRUE(admin.ok()) << admin.status();
    auto listed = (*admin)->ListSessions();
    EXPECT_TRUE(listed.ok()) << listed.status();
    return listed.ok() ? listed->size() : size_t{99};
  };
  session->reset();  // the Session goes; its batch stays
  EXPECT_EQ(sessions(), 1u);  // not detached: the batch is held
  EXPECT_EQ(held->step(), 0);
  EXPECT_TRUE(RowsAreTheFile(*held, tokens)) << "the held batch changed";
  held->Release();  // the last reference: now the session detaches
  EXPECT_TRUE(Eventually([&] { return sessions() == 0; }, absl::Seconds(10)));
}

// The usual ways of not reaching a daemon say so in our words, not gRPC's: a stale socket file
// (bound once, nobody listening: a killed daemon's) and a missing one.
TEST(ReattachBoundTest, AStaleSocketFileIsNamedInOurWords) {
  TempDir dir;
  const std::string stale = dir.Join("stale.sock");
  {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, stale.c_str(), stale.size() + 1);
    ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  }  // closed without listening: the file stays
  auto admin = client::AdminClient::Connect(stale, absl::Seconds(1));
  EXPECT_EQ(admin.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(admin.status().message(),
            absl::StrCat("no gpufeedd listening at ", stale,
                         ": a stale socket file (gpufeedd stopped or crashed?)"));
  client::AttachOptions o;
  o.socket = stale;
  o.dataset = dir.Join("none.bin");
  o.seq_len = 4;
  EXPECT_EQ(client::Session::Attach(o).status().message(), admin.status().message());
  o.socket = dir.Join("missing.sock");
  EXPECT_THAT(client::Session::Attach(o).status().message(),
              HasSubstr("no gpufeedd listening at " + o.socket + ": no socket there"));
}

}  // namespace
}  // namespace gpufeed::testing
