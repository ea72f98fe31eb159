// The metrics endpoint of two in-process daemons (tests/testing/test_daemon.h): each exports
// its own work only, however many daemons the process holds.
#include "server/service/metrics.h"

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/testing/image_files.h"
#include "tests/testing/test_daemon.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::HttpGet;
using ::gpufeed::testing::Sample;
using ::gpufeed::testing::TestDaemon;
using ::testing::HasSubstr;
using ::testing::Not;

// A 16x16 RGB image is 768 bytes and its label 8: a batch of 2 is 1552 bytes.
constexpr uint64_t kBatchBytes = 2 * (16 * 16 * 3 + 8);

std::unique_ptr<TestDaemon> StartWithMetrics() {
  testing::TestDaemonOptions options;
  options.configure = [](DaemonConfig& c) { c.metrics_listen = "127.0.0.1:0"; };
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(std::move(options));
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *std::move(d) : nullptr;
}

// Serves one epoch of `images` 16x16 PNGs (one class folder in `daemon`'s dir) in batches of
// 2 and returns the batches read; the session stays attached while `session` lives.
int ServeOneEpoch(const TestDaemon& daemon, int images, std::unique_ptr<client::Session>* session) {
  const std::string root = daemon.dir().Join("images");
  for (int i = 0; i < images; ++i) {
    testing::WriteFileBytes(absl::StrCat(root, "/a/", i, ".png"),
                            testing::EncodePng(testing::Picture(16, 16, 3, i), 16, 16));
  }
  client::AttachOptions o;
  o.job = "metrics";
  o.kind = "image_folder";
  o.dataset = root;
  o.batch_size = 2;
  o.shuffle = false;
  o.stop_epoch = 1;
  o.pipeline_json =
      R"({"ops": [{"center_crop": {"size": 16}}, {"cast": {"dtype": "DTYPE_UINT8"}}]})";
  absl::StatusOr<std::unique_ptr<client::Session>> s = daemon.Attach(o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return -1;
  *session = *std::move(s);
  int batches = 0;
  while (true) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
    if (absl::IsOutOfRange(batch.status())) break;  // EndOfData at stop_epoch
    EXPECT_TRUE(batch.ok()) << batch.status();
    if (!batch.ok()) return -1;
    ++batches;
  }
  return batches;
}

std::string Scrape(const TestDaemon& daemon) {
  return HttpGet(daemon.daemon()->metrics_port(), "/metrics");
}

// Expects the counters a run of `batches` batches of 2 PNGs leaves in `text`, all zero for 0.
void ExpectServed(const std::string& text, int batches) {
  EXPECT_EQ(Sample(text, "gpufeed_decodes_total{decoder=\"cpu\"}"), 2 * batches) << text;
  EXPECT_EQ(Sample(text, "gpufeed_decodes_total{decoder=\"cpu_region\"}"), 0);
  EXPECT_EQ(Sample(text, "gpufeed_decodes_total{decoder=\"nvjpeg\"}"), 0);
  EXPECT_EQ(Sample(text, "gpufeed_delivered_bytes_total{delivery=\"host\"}"),
            static_cast<double>(batches * kBatchBytes));
  EXPECT_EQ(Sample(text, "gpufeed_delivered_bytes_total{delivery=\"device\"}"), 0);
  EXPECT_EQ(Sample(text, "gpufeed_stage_duration_seconds_count{stage=\"fill\"}"), batches);
  for (const char* stage : {"read", "decode", "augment"}) {
    EXPECT_EQ(
        Sample(text, absl::StrCat("gpufeed_stage_duration_seconds_count{stage=\"", stage, "\"}")),
        2 * batches)
        << stage;
  }
  EXPECT_EQ(Sample(text, "gpufeed_stage_duration_seconds_count{stage=\"device\"}"), 0);
}

TEST(MetricsTest, TwoDaemonsInOneProcessEachExportOnlyTheirOwnWork) {
  std::unique_ptr<TestDaemon> a = StartWithMetrics();
  std::unique_ptr<TestDaemon> b = StartWithMetrics();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(a->daemon()->metrics_port(), b->daemon()->metrics_port());

  std::unique_ptr<client::Session> on_a;
  ASSERT_EQ(ServeOneEpoch(*a, 6, &on_a), 3);
  ExpectServed(Scrape(*a), 3);
  const std::string idle = Scrape(*b);
  ExpectServed(idle, 0);
  EXPECT_THAT(idle, Not(HasSubstr("gpufeed_batches_produced_total{")));

  // B's own work shows on B only; A's counters stay where they were.
  std::unique_ptr<client::Session> on_b;
  ASSERT_EQ(ServeOneEpoch(*b, 2, &on_b), 1);
  ExpectServed(Scrape(*b), 1);
  ExpectServed(Scrape(*a), 3);
}

}  // namespace
}  // namespace gpufeed::server
