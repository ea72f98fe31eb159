#include "server/notify.h"

#include <systemd/sd-daemon.h>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace gpufeed::server {

SystemdNotifier::~SystemdNotifier() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (watchdog_.joinable()) watchdog_.join();
}

void SystemdNotifier::Ready(const std::string& status, std::function<bool()> alive) {
  sd_notify(0, absl::StrCat("READY=1\nSTATUS=", status).c_str());
  StartWatchdog(std::move(alive));
}

void SystemdNotifier::Status(const std::string& status) {
  sd_notify(0, absl::StrCat("STATUS=", status).c_str());
}

void SystemdNotifier::Stopping(const std::string& status) {
  sd_notify(0, absl::StrCat("STOPPING=1\nSTATUS=", status).c_str());
  if (!stop_.HasBeenNotified()) stop_.Notify();
}

void SystemdNotifier::StartWatchdog(std::function<bool()> alive) {
  uint64_t usec = 0;
  if (watchdog_.joinable() || sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return;
  spdlog::info("systemd watchdog: pinging every {} ms", usec / 2000);
  watchdog_ = std::thread([this, period = absl::Microseconds(usec / 2), alive = std::move(alive)] {
    while (!stop_.WaitForNotificationWithTimeout(period)) {
      if (!alive || alive()) sd_notify(0, "WATCHDOG=1");
    }
  });
}

}  // namespace gpufeed::server
