// gpufeedd's configuration pipeline: defaults, then the --config file, then the flags given on
// the command line (parsed by absl, as main does), validated with the field (and file) named.
#include "server/config.h"

#include <stdlib.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "gmock/gmock.h"
#include "gpufeed/v1/config.pb.h"
#include "gtest/gtest.h"
#include "tests/testing/load_config.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

class ConfigTest : public ::testing::Test {
 protected:
  // gpufeedd `args`, as main parses them; the flags are back at their defaults afterwards.
  absl::StatusOr<DaemonConfig> Load(std::vector<std::string> args) {
    return ::gpufeed::testing::LoadConfigFromArgs(std::move(args));
  }
  // A config file with `body`; its path.
  std::string File(const std::string& name, const std::string& body) {
    return dir_.WriteFile(name, body);
  }

  testing::TempDir dir_;
};

int Cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

TEST_F(ConfigTest, DefaultsAreValidatedAndDerivedFieldsFilled) {
  absl::StatusOr<DaemonConfig> c = Load({});
  ASSERT_TRUE(c.ok()) << c.status();
  // Both sockets in the runtime directory, which Daemon::Start makes (runtime_dir_test).
  EXPECT_EQ(c->listen, "");
  EXPECT_EQ(c->mem_socket, "");
  EXPECT_EQ(c->runtime_dir, "/run/gpufeed");
  EXPECT_EQ(c->staging_bytes, uint64_t{1} << 30);
  EXPECT_EQ(c->staging_slab_bytes, uint64_t{1} << 30);
  EXPECT_EQ(c->threads, Cores());
  EXPECT_EQ(c->attach_threads, 2);
  EXPECT_EQ(c->max_sessions, 256);
  EXPECT_EQ(c->ring_slots, 0);
  EXPECT_EQ(c->attach_timeout, absl::Seconds(10));
  EXPECT_EQ(c->shutdown_grace, absl::Seconds(2));
  EXPECT_EQ(c->stall_timeout, absl::Seconds(60));
  EXPECT_EQ(c->read_mode, ReadMode::kMmap);
  EXPECT_EQ(c->log_level, spdlog::level::info);
  EXPECT_EQ(c->log_format, LogFormat::kText);
  EXPECT_EQ(c->device_bytes, uint64_t{4} << 30);
  EXPECT_EQ(c->metrics_listen, "");
  EXPECT_EQ(c->health_listen, "");
  // docs/SECURITY.md: anyone who can connect may consume; no admins besides root and the
  // daemon's uid; 64 sessions and half the staging per uid; idle leases end after 300 s.
  EXPECT_TRUE(c->allow_uids.empty());
  EXPECT_TRUE(c->allow_gids.empty());
  EXPECT_TRUE(c->admin_uids.empty());
  EXPECT_TRUE(c->admin_gids.empty());
  EXPECT_TRUE(c->root_is_admin);
  EXPECT_TRUE(c->daemon_uid_is_admin);
  EXPECT_FALSE(c->metrics_job_labels);
  EXPECT_EQ(c->max_sessions_per_uid, 64);
  EXPECT_EQ(c->max_staging_bytes_per_uid, 0u);
  EXPECT_EQ(StagingBytesPerUid(*c), uint64_t{512} << 20);
  EXPECT_EQ(c->idle_lease_timeout, absl::Seconds(300));
}

TEST_F(ConfigTest, AccessAndQuotasFromTheFileAndFlags) {
  // Field numbers as docs/SECURITY.md gives them, through the binary form.
  v1::DaemonConfig numbered;
  const google::protobuf::Descriptor* d = numbered.GetDescriptor();
  EXPECT_EQ(d->FindFieldByName("allow_uids")->number(), 20);
  EXPECT_EQ(d->FindFieldByName("allow_gids")->number(), 21);
  EXPECT_EQ(d->FindFieldByName("admin_uids")->number(), 22);
  EXPECT_EQ(d->FindFieldByName("admin_gids")->number(), 23);
  EXPECT_EQ(d->FindFieldByName("max_sessions_per_uid")->number(), 24);
  EXPECT_EQ(d->FindFieldByName("max_staging_bytes_per_uid")->number(), 25);
  EXPECT_EQ(d->FindFieldByName("idle_lease_timeout_ms")->number(), 26);

  const std::string file = File("access.textproto",
                                "allow_uids: [1000, 1001]\n"
                                "allow_gids: 3000\n"
                                "admin_uids: 1500\n"
                                "admin_gids: [4000, 4001]\n"
                                "max_sessions_per_uid: 8\n"
                                "max_staging_bytes_per_uid: 1048576\n"
                                "idle_lease_timeout_ms: 2500\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->allow_uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(c->allow_gids, (std::vector<uint32_t>{3000}));
  EXPECT_EQ(c->admin_uids, (std::vector<uint32_t>{1500}));
  EXPECT_EQ(c->admin_gids, (std::vector<uint32_t>{4000, 4001}));
  EXPECT_EQ(c->max_sessions_per_uid, 8);
  EXPECT_EQ(c->max_staging_bytes_per_uid, uint64_t{1} << 20);
  EXPECT_EQ(StagingBytesPerUid(*c), uint64_t{1} << 20);
  EXPECT_EQ(c->idle_lease_timeout, absl::Milliseconds(2500));

  // Flags replace the file's lists (an empty flag: the empty list).
  c = Load({"--config=" + file, "--allow_uids=7,8,9", "--admin_gids=", "--admin_uids", "0",
            "--max_sessions_per_uid=2", "--max_staging_bytes_per_uid=0",
            "--idle_lease_timeout=0"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->allow_uids, (std::vector<uint32_t>{7, 8, 9}));
  EXPECT_EQ(c->allow_gids, (std::vector<uint32_t>{3000}));  // still the file's
  EXPECT_EQ(c->admin_uids, (std::vector<uint32_t>{0}));
  EXPECT_TRUE(c->admin_gids.empty());
  EXPECT_EQ(c->max_sessions_per_uid, 2);
  EXPECT_EQ(StagingBytesPerUid(*c), c->staging_bytes / 2);
  EXPECT_EQ(c->idle_lease_timeout, absl::ZeroDuration());

  const std::string json = File("access.json",
                                "{\"allowUids\": [5], \"admin_gids\": [6], "
                                "\"idleLeaseTimeoutMs\": 1000}");
  c = Load({"--config=" + json});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->allow_uids, (std::vector<uint32_t>{5}));
  EXPECT_EQ(c->admin_gids, (std::vector<uint32_t>{6}));
  EXPECT_EQ(c->idle_lease_timeout, absl::Seconds(1));
}

TEST_F(ConfigTest, ImplicitAdminsAndMetricsJobLabelsFromTheFileAndFlags) {
  const google::protobuf::Descriptor* d = v1::DaemonConfig().GetDescriptor();
  EXPECT_EQ(d->FindFieldByName("root_is_admin")->number(), 46);
  EXPECT_EQ(d->FindFieldByName("daemon_uid_is_admin")->number(), 47);
  EXPECT_EQ(d->FindFieldByName("metrics_job_labels")->number(), 48);
  const std::string file = File("admins.textproto",
                                "root_is_admin: false\n"
                                "daemon_uid_is_admin: false\n"
                                "metrics_job_labels: true\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->root_is_admin);
  EXPECT_FALSE(c->daemon_uid_is_admin);
  EXPECT_TRUE(c->metrics_job_labels);
  c = Load({"--config=" + file, "--root_is_admin", "--nometrics_job_labels"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->root_is_admin);
  EXPECT_FALSE(c->daemon_uid_is_admin);  // still the file's
  EXPECT_FALSE(c->metrics_job_labels);
}

TEST_F(ConfigTest, IdListsInFlagsAreNumbers) {
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--allow_uids=1000,bob", "allow_uids: want numeric ids separated by commas (e.g. "
                                     "1000,1001), got 'bob'"},
           {"--allow_gids=-1", "allow_gids: want numeric ids separated by commas (e.g. "
                               "1000,1001), got '-1'"},
           {"--admin_uids=1,,2", "admin_uids: want numeric ids separated by commas (e.g. "
                                 "1000,1001), got ''"},
           {"--admin_gids=4294967296", "admin_gids: want numeric ids separated by commas (e.g. "
                                       "1000,1001), got '4294967296'"},
       }) {
    absl::StatusOr<DaemonConfig> c = Load({flag});
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_EQ(c.status().message(), message);
  }
}

TEST_F(ConfigTest, NvjpegDefaultsComeFromTheEnvironment) {
  ::setenv("GPUFEED_NVJPEG_LIBRARY", "/opt/nvjpeg/libnvjpeg.so.12", 1);
  ::setenv("GPUFEED_NVJPEG_INTERPOLATION", "0", 1);
  const DaemonConfig env = DefaultConfig();
  // With a config file that does not set them too.
  const std::string file = File("f.textproto", "threads: 3\n");
  absl::StatusOr<DaemonConfig> loaded = Load({"--config=" + file});
  ::unsetenv("GPUFEED_NVJPEG_LIBRARY");
  ::unsetenv("GPUFEED_NVJPEG_INTERPOLATION");
  EXPECT_EQ(env.nvjpeg_library, "/opt/nvjpeg/libnvjpeg.so.12");
  EXPECT_FALSE(env.nvjpeg_interpolation);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->nvjpeg_library, "/opt/nvjpeg/libnvjpeg.so.12");
  EXPECT_FALSE(loaded->nvjpeg_interpolation);
  const DaemonConfig plain = DefaultConfig();
  EXPECT_EQ(plain.nvjpeg_library, "");
  EXPECT_TRUE(plain.nvjpeg_interpolation);
}

TEST_F(ConfigTest, FlagsGivenOverrideTheFileWhichOverridesTheDefaults) {
  const std::string file = File("gpufeedd.textproto",
                                "# a comment\n"
                                "listen: \"unix:///tmp/f.sock\"\n"
                                "threads: 3\n"
                                "attach_threads: 4\n"
                                "staging_slab_bytes: 2097152\n"
                                "log_format: \"json\"\n"
                                "read_mode: \"pread\"\n"
                                "nvjpeg_interpolation: true\n"
                                "region_decode: false\n"
                                "cheapest_cpu_rows: false\n"
                                "metrics_listen: \"0.0.0.0:9090\"\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "unix:///tmp/f.sock");
  EXPECT_EQ(c->mem_socket, "/tmp/f.mem.sock");
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->attach_threads, 4);
  EXPECT_EQ(c->staging_slab_bytes, uint64_t{2} << 20);
  EXPECT_EQ(c->log_format, LogFormat::kJson);
  EXPECT_EQ(c->read_mode, ReadMode::kPread);
  EXPECT_EQ(c->max_sessions, 256);  // the file does not set it: the default
  EXPECT_FALSE(c->region_decode);
  EXPECT_FALSE(c->cheapest_cpu_rows);

  // Flags win, in every spelling absl accepts, even where the flag's value is its default.
  c = Load({"--config=" + file, "--threads", "0", "-attach_threads=1", "--log_format=text",
            "--nonvjpeg_interpolation", "--metrics_listen=", "--staging_slab_bytes=4194304",
            "--listen=unix:///tmp/g.sock", "--region_decode", "--cheapest_cpu_rows"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->threads, Cores());
  EXPECT_EQ(c->attach_threads, 1);
  EXPECT_EQ(c->log_format, LogFormat::kText);
  EXPECT_FALSE(c->nvjpeg_interpolation);
  EXPECT_TRUE(c->region_decode);
  EXPECT_TRUE(c->cheapest_cpu_rows);
  EXPECT_EQ(c->metrics_listen, "");
  EXPECT_EQ(c->staging_slab_bytes, uint64_t{4} << 20);
  EXPECT_EQ(c->listen, "unix:///tmp/g.sock");
  EXPECT_EQ(c->mem_socket, "/tmp/g.mem.sock");
  EXPECT_EQ(c->read_mode, ReadMode::kPread);  // still the file's
}

TEST_F(ConfigTest, FlagsWithoutAFile) {
  absl::StatusOr<DaemonConfig> c =
      Load({"--read_mode=pread", "--log_level=debug", "--ring_slots=8", "--attach_timeout=1500ms",
            "--stall_timeout=0", "--shutdown_grace=30s", "--device_bytes=1048576",
            "--mem_socket=/tmp/m.sock", "--health_listen=127.0.0.1:0"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->read_mode, ReadMode::kPread);
  EXPECT_EQ(c->log_level, spdlog::level::debug);
  EXPECT_EQ(c->ring_slots, 8);
  EXPECT_EQ(c->attach_timeout, absl::Milliseconds(1500));
  EXPECT_EQ(c->stall_timeout, absl::ZeroDuration());
  EXPECT_EQ(c->shutdown_grace, absl::Seconds(30));
  EXPECT_EQ(c->device_bytes, uint64_t{1} << 20);
  EXPECT_EQ(c->mem_socket, "/tmp/m.sock");
  EXPECT_EQ(c->health_listen, "127.0.0.1:0");
}

TEST_F(ConfigTest, JsonFile) {
  const std::string file = File("gpufeedd.json",
                                "  {\"threads\": 5, \"readMode\": \"pread\", \"attachTimeoutMs\": "
                                "2500, \"logLevel\": \"warn\", \"stagingSlabBytes\": 8388608, "
                                "\"attach_threads\": 3}");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->threads, 5);
  EXPECT_EQ(c->read_mode, ReadMode::kPread);
  EXPECT_EQ(c->attach_timeout, absl::Milliseconds(2500));
  EXPECT_EQ(c->log_level, spdlog::level::warn);
  EXPECT_EQ(c->staging_slab_bytes, uint64_t{8} << 20);
  EXPECT_EQ(c->attach_threads, 3);
}

TEST_F(ConfigTest, MissingFileIsNotFound) {
  const std::string path = dir_.Join("nope.textproto");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + path});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "config: cannot read " + path);
}

TEST_F(ConfigTest, UnparsableFilesNameTheFileAndLine) {
  const std::string typo = File("typo.textproto", "threads: 3\nthread: 4\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + typo});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("config " + typo + ": line 2"));
  EXPECT_THAT(c.status().message(), HasSubstr("thread"));
  const std::string json = File("bad.json", "{\"threads\": \"many\"}");
  c = Load({"--config=" + json});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("config " + json + ": "));
}

// One bad value per field: the flag's refusal names the field; the same value from a file
// names the file and the file's field.
struct BadValue {
  std::string flag;        // "--threads=-1"
  std::string file_line;   // "threads: -1"
  std::string message;     // "threads: 0 to 1024, got -1"
  std::string file_field;  // the file's name for the field, where it differs: "..._ms"
};
void PrintTo(const BadValue& bad, std::ostream* os) { *os << bad.flag; }
BadValue Bad(std::string flag, std::string file_line, std::string message,
             std::string file_field = "") {
  return {std::move(flag), std::move(file_line), std::move(message), std::move(file_field)};
}

class BadValueTest : public ConfigTest, public ::testing::WithParamInterface<BadValue> {};

TEST_P(BadValueTest, IsRefusedNamingTheField) {
  const BadValue& bad = GetParam();
  absl::StatusOr<DaemonConfig> c = Load({bad.flag});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c.status().message(), bad.message);

  const std::string file = File("bad.textproto", bad.file_line + "\n");
  c = Load({"--config=" + file});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  std::string expected = bad.message;
  if (!bad.file_field.empty()) {
    expected.replace(0, expected.find(':'), bad.file_field);
  }
  EXPECT_EQ(c.status().message(), "config " + file + ": " + expected);
}

INSTANTIATE_TEST_SUITE_P(
    EveryField, BadValueTest,
    ::testing::Values(
        Bad("--listen=tcp://0.0.0.0:1", "listen: \"tcp://0.0.0.0:1\"",
            "listen: 'tcp://0.0.0.0:1' is not a unix socket address (want "
            "unix:///path/to.sock)"),
        Bad("--listen=unix:relative.sock", "listen: \"unix:relative.sock\"",
            "listen: 'unix:relative.sock' must name an absolute socket path"),
        Bad("--mem_socket=mem.sock", "mem_socket: \"mem.sock\"",
            "mem_socket: must be an absolute path, got 'mem.sock'"),
        Bad("--mem_socket=/run/gpufeed/gpufeed.sock", "mem_socket: \"/run/gpufeed/gpufeed.sock\"",
            "mem_socket: must differ from the listen socket"),
        Bad("--runtime_dir=run/gpufeed", "runtime_dir: \"run/gpufeed\"",
            "runtime_dir: must be an absolute path, got 'run/gpufeed'"),
        Bad("--staging_bytes=1000", "staging_bytes: 1000",
            "staging_bytes: 1 MiB to 256 TiB, got 1000"),
        Bad("--staging_slab_bytes=4096", "staging_slab_bytes: 4096",
            "staging_slab_bytes: at least 1 MiB, got 4096"),
        Bad("--threads=-1", "threads: -1", "threads: 0 to 1024, got -1"),
        Bad("--threads=1025", "threads: 1025", "threads: 0 to 1024, got 1025"),
        Bad("--attach_threads=0", "attach_threads: 0", "attach_threads: 1 to 64, got 0"),
        Bad("--max_sessions=0", "max_sessions: 0", "max_sessions: >= 1, got 0"),
        Bad("--ring_slots=65", "ring_slots: 65", "ring_slots: 0 (auto) to 64, got 65"),
        Bad("--device_bytes=0", "device_bytes: 0", "device_bytes: must be > 0"),
        Bad("--attach_timeout=0", "attach_timeout_ms: 0", "attach_timeout: must be > 0",
            "attach_timeout_ms"),
        Bad("--stall_timeout=-1s", "stall_timeout_ms: -1000",
            "stall_timeout: must be >= 0 (0 = off)", "stall_timeout_ms"),
        Bad("--shutdown_grace=-1s", "shutdown_grace_ms: -1", "shutdown_grace: must be >= 0",
            "shutdown_grace_ms"),
        Bad("--metrics_listen=9090", "metrics_listen: \"9090\"",
            "metrics_listen: want HOST:PORT (e.g. 0.0.0.0:9090), got '9090'"),
        Bad("--health_listen=host:http", "health_listen: \"host:http\"",
            "health_listen: want HOST:PORT (e.g. 0.0.0.0:9090), got 'host:http'"),
        Bad("--read_mode=x", "read_mode: \"x\"", "read_mode: want mmap or pread, got 'x'"),
        Bad("--log_format=xml", "log_format: \"xml\"", "log_format: want text or json, got 'xml'"),
        Bad("--log_level=loud", "log_level: \"loud\"",
            "log_level: want trace, debug, info, warn, error or off, got 'loud'"),
        Bad("--max_sessions_per_uid=0", "max_sessions_per_uid: 0",
            "max_sessions_per_uid: >= 1, got 0"),
        Bad("--idle_lease_timeout=-1s", "idle_lease_timeout_ms: -1",
            "idle_lease_timeout: must be >= 0 (0 = off)", "idle_lease_timeout_ms")));

TEST_F(ConfigTest, AFlagReplacingABadFileValueNamesNoFile) {
  const std::string file = File("f.textproto", "threads: 3\nmax_sessions: 0\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file, "--max_sessions=-2"});
  EXPECT_EQ(c.status().message(), "max_sessions: >= 1, got -2");
  c = Load({"--config=" + file, "--max_sessions=2"});
  EXPECT_TRUE(c.ok()) << c.status();
}

TEST(EnumNamesTest, RoundTripAndRefuse) {
  EXPECT_STREQ(ReadModeName(ReadMode::kMmap), "mmap");
  EXPECT_STREQ(ReadModeName(ReadMode::kPread), "pread");
  EXPECT_EQ(*ParseReadMode("pread"), ReadMode::kPread);
  EXPECT_EQ(*ParseLogFormat("json"), LogFormat::kJson);
  EXPECT_EQ(*ParseLogLevel("off"), spdlog::level::off);
  EXPECT_EQ(*ParseLogLevel("warn"), spdlog::level::warn);
  EXPECT_EQ(*ParseLogLevel("error"), spdlog::level::err);
  EXPECT_EQ(ParseReadMode("MMAP").status().message(), "read_mode: want mmap or pread, got 'MMAP'");
  EXPECT_EQ(ParseLogFormat("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GivenFlagsTest, NamesTheFlagsOnTheCommandLineOnly) {
  const char* argv[] = {
      "gpufeedd",     "--threads=2", "-max_sessions", "8",     "--nonvjpeg_interpolation",
      "--nosuchflag", "positional",  "--read_mode",   "pread", "--",
      "--listen=x"};
  EXPECT_THAT(GivenFlags(static_cast<int>(std::size(argv)), argv),
              UnorderedElementsAre("threads", "max_sessions", "nvjpeg_interpolation", "read_mode"));
}

// Bounded cost (docs/SECURITY.md §4, config fields 31-33).
TEST_F(ConfigTest, BoundedCostCapsHaveTheirDefaultsAndComeFromTheFileOrFlags) {
  absl::StatusOr<DaemonConfig> c = Load({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_samples_per_feed, uint64_t{1} << 40);
  EXPECT_EQ(c->max_image_bytes, uint64_t{64} << 20);
  EXPECT_EQ(c->max_ids_bytes, uint64_t{256} << 20);
  const std::string file = File("caps.textproto",
                                "max_samples_per_feed: 1000\n"
                                "max_image_bytes: 4096\n"
                                "max_ids_bytes: 65536\n");
  c = Load({"--config=" + file, "--max_ids_bytes=131072"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_samples_per_feed, 1000u);
  EXPECT_EQ(c->max_image_bytes, 4096u);
  EXPECT_EQ(c->max_ids_bytes, 131072u);  // the flag wins
}

INSTANTIATE_TEST_SUITE_P(
    BoundedCost, BadValueTest,
    ::testing::Values(
        Bad("--max_samples_per_feed=0", "max_samples_per_feed: 0",
            "max_samples_per_feed: 1 to 2^62, got 0"),
        Bad("--max_samples_per_feed=4611686018427387905",
            "max_samples_per_feed: 4611686018427387905",
            "max_samples_per_feed: 1 to 2^62, got 4611686018427387905"),
        Bad("--max_image_bytes=0", "max_image_bytes: 0", "max_image_bytes: must be > 0"),
        Bad("--max_ids_bytes=0", "max_ids_bytes: 0", "max_ids_bytes: must be > 0")));

}  // namespace
}  // namespace gpufeed::server

namespace gpufeed::server {
// docs/SECURITY.md section 4, a slow request is its session's problem (fields 41, 42): the
// batch time budget and the per-image pixel cap, from flags or the file, and their checks.
TEST_F(ConfigTest, BatchTimeBudgetAndPixelCap) {
  absl::StatusOr<DaemonConfig> defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->max_batch_time, absl::Seconds(120));
  EXPECT_EQ(defaults->max_image_pixels, 64'000'000u);
  absl::StatusOr<DaemonConfig> flags = Load({"--max_batch_time=0", "--max_image_pixels=1000"});
  ASSERT_TRUE(flags.ok()) << flags.status();
  EXPECT_EQ(flags->max_batch_time, absl::ZeroDuration());
  EXPECT_EQ(flags->max_image_pixels, 1000u);
  const std::string file =
      File("c.textproto", "max_batch_time_ms: 30000\nmax_image_pixels: 16777216\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_batch_time, absl::Seconds(30));
  EXPECT_EQ(c->max_image_pixels, 16777216u);
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {"max_batch_time_ms: -1", "max_batch_time_ms: must be >= 0 (0 = none)"},
           {"max_image_pixels: 0", "max_image_pixels: 1 to 2^31, got 0"},
           {"max_image_pixels: 4294967296", "max_image_pixels: 1 to 2^31, got 4294967296"}}) {
    const std::string bad = File("bad.textproto", body);
    absl::StatusOr<DaemonConfig> refused = Load({"--config=" + bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(refused.status().message(), "config " + bad + ": " + want);
  }
  absl::StatusOr<DaemonConfig> refused = Load({"--max_batch_time=-1s"});
  EXPECT_EQ(refused.status().message(), "max_batch_time: must be >= 0 (0 = none)");
}

namespace {

// docs/SECURITY.md's data-access fields (27-30): file only, with their defaults.
TEST_F(ConfigTest, DataAccessFieldsComeFromTheFileWithTheirDefaults) {
  absl::StatusOr<DaemonConfig> defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_TRUE(defaults->dataset_roots.empty());
  EXPECT_EQ(defaults->mem_request_timeout, absl::Seconds(2));
  EXPECT_EQ(defaults->max_folder_entries, 10'000'000);
  EXPECT_EQ(defaults->folder_walk_timeout, absl::Seconds(120));
  const std::string file =
      File("c.textproto",
           "dataset_roots: \"/data\"\ndataset_roots: \"/scratch/\"\nmem_request_timeout_ms: 500\n"
           "max_folder_entries: 1000\nfolder_walk_timeout_ms: 30000\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->dataset_roots, ::testing::ElementsAre("/data", "/scratch/"));
  EXPECT_EQ(c->mem_request_timeout, absl::Milliseconds(500));
  EXPECT_EQ(c->max_folder_entries, 1000);
  EXPECT_EQ(c->folder_walk_timeout, absl::Seconds(30));
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {"dataset_roots: \"data\"", "dataset_roots: must be absolute paths, got 'data'"},
           {"mem_request_timeout_ms: 0", "mem_request_timeout_ms: must be > 0"},
           {"max_folder_entries: 0", "max_folder_entries: >= 1, got 0"},
           {"folder_walk_timeout_ms: -1", "folder_walk_timeout_ms: must be > 0"}}) {
    const std::string bad = File("bad.textproto", body);
    absl::StatusOr<DaemonConfig> refused = Load({"--config=" + bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(refused.status().message(), "config " + bad + ": " + want);
  }
}

// share_groups_across_uids (field 54): empty by default, from the file (repeated) or the flag
// (comma-separated), a name no Attach could give refused naming the field.
TEST_F(ConfigTest, GroupsAcrossUidsFromTheFileAndTheFlag) {
  EXPECT_EQ(v1::DaemonConfig().GetDescriptor()->FindFieldByName("share_groups_across_uids")
                ->number(), 54);
  absl::StatusOr<DaemonConfig> defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_TRUE(defaults->share_groups_across_uids.empty());
  const std::string file = File("g.textproto",
                                "share_groups_across_uids: \"imagenet\"\n"
                                "share_groups_across_uids: \"coco/val\"\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->share_groups_across_uids, ::testing::ElementsAre("imagenet", "coco/val"));
  c = Load({"--config=" + file, "--share_groups_across_uids=a,b"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->share_groups_across_uids, ::testing::ElementsAre("a", "b"));
  absl::StatusOr<DaemonConfig> refused = Load({"--share_groups_across_uids=ok,no way"});
  EXPECT_EQ(refused.status(),
            absl::InvalidArgumentError("share_groups_across_uids: a group name is 1 to 128 bytes "
                                       "of [A-Za-z0-9._:@+=/-], got 'no way'"));
}

// The object store (fields 55-59): off by default, from the file and the flags, a cache
// without a store, a relative cache_dir and a connection count out of range refused naming
// the field.
TEST_F(ConfigTest, ObjectStoreFromTheFileAndTheFlags) {
  const auto* d = v1::DaemonConfig().GetDescriptor();
  EXPECT_EQ(d->FindFieldByName("s3_endpoint")->number(), 55);
  EXPECT_EQ(d->FindFieldByName("cache_bytes")->number(), 59);
  absl::StatusOr<DaemonConfig> defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->s3_endpoint, "");
  EXPECT_EQ(defaults->s3_region, "us-east-1");
  EXPECT_EQ(defaults->s3_max_connections, 32);
  EXPECT_EQ(defaults->cache_bytes, 0u);
  const std::string file = File("s3.textproto",
                                "s3_endpoint: \"http://minio:9000\"\ns3_region: \"auto\"\n"
                                "s3_max_connections: 8\ncache_dir: \"/var/cache/g\"\n"
                                "cache_bytes: 1000000\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file, "--cache_bytes=2000000"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->s3_endpoint, "http://minio:9000");
  EXPECT_EQ(c->s3_region, "auto");
  EXPECT_EQ(c->s3_max_connections, 8);
  EXPECT_EQ(c->cache_dir, "/var/cache/g");
  EXPECT_EQ(c->cache_bytes, 2000000u);
  EXPECT_EQ(Load({"--cache_bytes=1"}).status(),
            absl::InvalidArgumentError(
                "cache_bytes: the object cache is for s3:// datasets: set s3_endpoint too"));
  EXPECT_EQ(Load({"--s3_endpoint=aws", "--cache_dir=rel"}).status(),
            absl::InvalidArgumentError("cache_dir: must be absolute, got 'rel'"));
  EXPECT_EQ(Load({"--s3_endpoint=aws", "--s3_max_connections=0"}).status(),
            absl::InvalidArgumentError("s3_max_connections: must be 1 to 1024"));
}

// docs/SECURITY.md's connection caps (37-40), with their defaults, from the file and flags.
TEST_F(ConfigTest, ConnectionCapsFromTheFileAndFlags) {
  v1::DaemonConfig numbered;
  const google::protobuf::Descriptor* d = numbered.GetDescriptor();
  EXPECT_EQ(d->FindFieldByName("max_connections_per_uid")->number(), 37);
  EXPECT_EQ(d->FindFieldByName("max_connections")->number(), 38);
  EXPECT_EQ(d->FindFieldByName("stream_open_timeout_ms")->number(), 39);
  EXPECT_EQ(d->FindFieldByName("connection_idle_timeout_ms")->number(), 40);
  absl::StatusOr<DaemonConfig> defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->max_connections_per_uid, 64);
  EXPECT_EQ(defaults->max_connections, 1024);
  EXPECT_EQ(defaults->stream_open_timeout, absl::Seconds(10));
  EXPECT_EQ(defaults->connection_idle_timeout, absl::Seconds(300));
  const std::string file =
      File("conn.textproto",
           "max_connections_per_uid: 8\nmax_connections: 100\nstream_open_timeout_ms: 1500\n"
           "connection_idle_timeout_ms: 0\n");
  absl::StatusOr<DaemonConfig> c = Load({"--config=" + file});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_connections_per_uid, 8);
  EXPECT_EQ(c->max_connections, 100);
  EXPECT_EQ(c->stream_open_timeout, absl::Milliseconds(1500));
  EXPECT_EQ(c->connection_idle_timeout, absl::ZeroDuration());
  c = Load({"--config=" + file, "--max_connections_per_uid=2", "--stream_open_timeout=3s",
            "--connection_idle_timeout=1m"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_connections_per_uid, 2);
  EXPECT_EQ(c->max_connections, 100);  // still the file's
  EXPECT_EQ(c->stream_open_timeout, absl::Seconds(3));
  EXPECT_EQ(c->connection_idle_timeout, absl::Minutes(1));
  for (const auto& [body, want] : std::vector<std::pair<std::string, std::string>>{
           {"max_connections_per_uid: 0", "max_connections_per_uid: >= 1, got 0"},
           {"max_connections: 10", "max_connections: >= max_connections_per_uid (64), got 10"},
           {"stream_open_timeout_ms: 0", "stream_open_timeout_ms: must be > 0"},
           {"connection_idle_timeout_ms: -1",
            "connection_idle_timeout_ms: must be >= 0 (0 = off)"}}) {
    const std::string bad = File("bad.textproto", body);
    absl::StatusOr<DaemonConfig> refused = Load({"--config=" + bad});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << body;
    EXPECT_EQ(refused.status().message(), "config " + bad + ": " + want);
  }
}

}  // namespace
}  // namespace gpufeed::server
