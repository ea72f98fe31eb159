// gpufeedd: the node-local data-feeding daemon.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "server/daemon.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "unix:///run/gpufeed/gpufeed.sock",
          "gRPC listen address: unix:///path/to/socket");
ABSL_FLAG(std::string, mem_socket, "",
          "Unix socket that hands over memory; default: beside --listen, NAME.mem.sock");
ABSL_FLAG(uint64_t, staging_bytes, uint64_t{1} << 30,
          "bytes of host staging memory (memfd slabs) shared by all sessions' rings");
ABSL_FLAG(int, threads, 0, "reader threads; 0 = one per core");
ABSL_FLAG(int, max_sessions, 256, "most sessions served at once");
ABSL_FLAG(int, ring_slots, 0,
          "ring depth (slots per session) when Attach gives none; 0 = auto: as many as fit "
          "in 64 MiB, 2 to 16");
ABSL_FLAG(absl::Duration, attach_timeout, absl::Seconds(10),
          "a session whose stream is not open this long after Attach is ended");
ABSL_FLAG(std::string, read_mode, "mmap",
          "how samples are copied from the page cache: mmap (memcpy from a mapping, guarded "
          "against a shrinking file) or pread");
ABSL_FLAG(uint64_t, device_bytes, uint64_t{4} << 30,
          "device memory all consumers' rings on one GPU may hold together (bytes)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, log_format, "text", "text, or json (one object a line, for log pipelines)");
ABSL_FLAG(std::string, metrics_listen, "",
          "TCP HOST:PORT serving Prometheus metrics at /metrics; empty: off");
ABSL_FLAG(std::string, health_listen, "",
          "TCP HOST:PORT serving grpc.health.v1 alone (Kubernetes gRPC probes); empty: off");
ABSL_FLAG(absl::Duration, stall_timeout, absl::Seconds(60),
          "liveness: the daemon reports itself stalled (health NOT_SERVING, no systemd watchdog "
          "pings) once one fill or GPU copy has run this long; 0 = never");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(2),
          "at shutdown, how long streams get to end; the process exits (status 1) if the whole "
          "teardown takes 5 s longer than this");
// Defaults from the environment variables older deployments set (read here, once).
ABSL_FLAG(std::string, nvjpeg_library,
          std::getenv("GPUFEED_NVJPEG_LIBRARY") != nullptr ? std::getenv("GPUFEED_NVJPEG_LIBRARY")
                                                          : "",
          "nvJPEG's library (default $GPUFEED_NVJPEG_LIBRARY, else libnvjpeg.so.13/.12 on the "
          "loader path or under /usr/local/cuda)");
ABSL_FLAG(bool, nvjpeg_interpolation,
          std::getenv("GPUFEED_NVJPEG_INTERPOLATION") == nullptr ||
              std::string(std::getenv("GPUFEED_NVJPEG_INTERPOLATION")) != "0",
          "nvJPEG chroma upsampling by interpolation, as libjpeg-turbo (default true unless "
          "$GPUFEED_NVJPEG_INTERPOLATION=0)");
ABSL_FLAG(std::string, config, "",
          "a gpufeed.v1.DaemonConfig file (text format or JSON; deploy/gpufeedd.textproto); "
          "flags given on the command line override it");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("gpufeedd: serves shuffled, sharded batches to training processes");
  absl::ParseCommandLine(argc, argv);
  // Logs go to stderr (the journal under systemd, the container log under Kubernetes).
  spdlog::set_default_logger(spdlog::stderr_color_mt("gpufeedd"));

  // Signals go to one sigwait thread; no code runs in a handler. Blocked before any thread
  // starts, so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  // Defaults, then the config file, then the flags given on the command line.
  gpufeed::server::DaemonConfig config;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    if (absl::Status s = gpufeed::server::ApplyConfigFile(path, &config); !s.ok()) {
      spdlog::critical("gpufeedd cannot start: {}", s.ToString());
      return 1;
    }
  }
  // The flags named on the command line (absl keeps its own record private here).
  std::set<std::string> named;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    named.insert(std::string(arg.substr(0, arg.find('='))));
  }
  auto given = [&named](const auto& flag) {
    return named.contains(std::string(absl::GetFlagReflectionHandle(flag).Name()));
  };
  const bool file = !absl::GetFlag(FLAGS_config).empty();
  auto apply = [&](const auto& flag, auto* field) {
    if (!file || given(flag)) *field = absl::GetFlag(flag);
  };
  apply(FLAGS_listen, &config.listen);
  apply(FLAGS_mem_socket, &config.mem_socket);
  apply(FLAGS_staging_bytes, &config.staging_bytes);
  apply(FLAGS_threads, &config.threads);
  apply(FLAGS_max_sessions, &config.max_sessions);
  apply(FLAGS_ring_slots, &config.default_ring_slots);
  apply(FLAGS_attach_timeout, &config.attach_timeout);
  apply(FLAGS_log_level, &config.log_level);
  apply(FLAGS_read_mode, &config.read_mode);
  apply(FLAGS_device_bytes, &config.device_bytes);
  apply(FLAGS_log_format, &config.log_format);
  apply(FLAGS_metrics_listen, &config.metrics_listen);
  apply(FLAGS_health_listen, &config.health_listen);
  apply(FLAGS_stall_timeout, &config.stall_timeout);
  apply(FLAGS_shutdown_grace, &config.shutdown_grace);
  apply(FLAGS_nvjpeg_library, &config.nvjpeg_library);
  apply(FLAGS_nvjpeg_interpolation, &config.nvjpeg_interpolation);

  absl::StatusOr<std::unique_ptr<gpufeed::server::Daemon>> daemon =
      gpufeed::server::Daemon::Start(config);
  if (!daemon.ok()) {
    spdlog::critical("gpufeedd cannot start: {}", daemon.status().ToString());
    return 1;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  // A pipeline stage that never returns (a wedged GPU, a stuck driver call) must not keep a
  // stopped daemon alive: past the grace period plus 5 s, exit regardless, with status 1 so
  // that the supervisor sees the failure.
  const absl::Duration limit = (*daemon)->config().shutdown_grace + absl::Seconds(5);
  std::thread([limit] {
    absl::SleepFor(limit);
    spdlog::critical("shutdown did not finish within {}: exiting now",
                     absl::FormatDuration(limit));
    spdlog::shutdown();
    std::_Exit(1);
  }).detach();
  (*daemon)->Shutdown();
  const int code = (*daemon)->exit_code();
  daemon->reset();
  spdlog::shutdown();
  return code;
}
