// gpufeedd: the node-local data-feeding daemon.
#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/flags/flag.h"
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

  gpufeed::server::DaemonConfig config;
  config.listen = absl::GetFlag(FLAGS_listen);
  config.mem_socket = absl::GetFlag(FLAGS_mem_socket);
  config.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  config.default_ring_slots = absl::GetFlag(FLAGS_ring_slots);
  config.attach_timeout = absl::GetFlag(FLAGS_attach_timeout);
  config.log_level = absl::GetFlag(FLAGS_log_level);
  config.read_mode = absl::GetFlag(FLAGS_read_mode);
  config.device_bytes = absl::GetFlag(FLAGS_device_bytes);

  absl::StatusOr<std::unique_ptr<gpufeed::server::Daemon>> daemon =
      gpufeed::server::Daemon::Start(config);
  if (!daemon.ok()) {
    spdlog::critical("gpufeedd cannot start: {}", daemon.status().ToString());
    return 1;
  }
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down", signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  (*daemon)->Shutdown();
  daemon->reset();
  spdlog::shutdown();
  return 0;
}
