// gpufeedd: the node-local data-feeding daemon. Parses the flags, loads the configuration
// (server/config.h), starts the daemon, waits for a reason to stop (SIGTERM, SIGINT, or the
// daemon's own: a drain ended, a GPU failed) and shuts down in order.
#include <pthread.h>
#include <signal.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/config.h"
#include "server/daemon.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace {

// The first reason given to stop the process; main waits for one. Any thread may give one.
class StopRequest {
 public:
  void Request(std::string reason) {
    absl::MutexLock lock(&mu_);
    if (!reason_.has_value()) reason_ = std::move(reason);
  }
  std::string Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::optional<std::string>* reason) { return reason->has_value(); }, &reason_));
    return *reason_;
  }

 private:
  absl::Mutex mu_;
  std::optional<std::string> reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

int main(int argc, char** argv) {
  using gpufeed::server::Daemon;
  absl::SetProgramUsageMessage("serves shuffled, sharded batches to training processes");
  // --help lists gpufeedd's flags, defined in server/config_flags.cc.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/config_flags.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
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

  absl::StatusOr<gpufeed::server::DaemonConfig> config =
      gpufeed::server::LoadConfig(gpufeed::server::GivenFlags(argc, argv));
  if (!config.ok()) {
    spdlog::critical("gpufeedd cannot start: {}", config.status().ToString());
    return 1;
  }
  // Shared with the sigwait thread, which is never joined: it may outlive main's frame.
  auto stop = std::make_shared<StopRequest>();
  absl::StatusOr<std::unique_ptr<Daemon>> daemon =
      Daemon::Start(*std::move(config), [stop](Daemon::StopReason reason) {
        stop->Request(reason == Daemon::StopReason::kDrained ? "drain ended"
                                                             : "a GPU failed for good");
      });
  if (!daemon.ok()) {
    spdlog::critical("gpufeedd cannot start: {}", daemon.status().ToString());
    return 1;
  }
  std::thread([signals, stop] {
    pthread_setname_np(pthread_self(), "signals");
    int signal_number = 0;
    sigwait(&signals, &signal_number);
    stop->Request(signal_number == SIGTERM ? "received SIGTERM" : "received SIGINT");
  }).detach();
  spdlog::info("{}, shutting down", stop->Wait());

  // A pipeline stage that never returns (a wedged GPU, a stuck driver call) must not keep a
  // stopped daemon alive: past the grace period plus 5 s, exit regardless, with status 1 so
  // that the supervisor sees the failure.
  const absl::Duration limit = (*daemon)->config().shutdown_grace + absl::Seconds(5);
  std::thread([limit] {
    absl::SleepFor(limit);
    spdlog::critical("shutdown did not finish within {}: exiting now", absl::FormatDuration(limit));
    spdlog::shutdown();
    std::_Exit(1);
  }).detach();
  (*daemon)->Shutdown();
  const int code = (*daemon)->exit_code();
  daemon->reset();
  spdlog::shutdown();
  return code;
}
