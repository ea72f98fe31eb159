// systemd's service notification protocol (Type=notify), through libsystemd's sd_notify: a
// no-op where NOTIFY_SOCKET is unset (not under systemd). READY=1 once serving, STATUS= lines,
// STOPPING=1 at shutdown, and WATCHDOG=1 pings at half the unit's WatchdogSec.
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"

namespace gpufeed::server {

class SystemdNotifier {
 public:
  SystemdNotifier() = default;
  ~SystemdNotifier();  // stops the watchdog pings

  // Watchdog pings are sent only while `alive()` (a stalled daemon stops them, and systemd
  // restarts it after WatchdogSec).
  void Ready(const std::string& status, std::function<bool()> alive = nullptr);
  void Status(const std::string& status);
  void Stopping(const std::string& status);

 private:
  void StartWatchdog(std::function<bool()> alive);
  absl::Notification stop_;
  std::thread watchdog_;
};

}  // namespace gpufeed::server
