// systemd's service notification protocol (Type=notify), through libsystemd's sd_notify: a
// no-op where NOTIFY_SOCKET is unset (not under systemd). READY=1 once serving, STATUS= lines,
// STOPPING=1 at shutdown, and WATCHDOG=1 pings at half the unit's WatchdogSec.
#pragma once

#include <string>
#include <thread>

#include "absl/synchronization/notification.h"

namespace gpufeed::server {

class SystemdNotifier {
 public:
  SystemdNotifier() = default;
  ~SystemdNotifier();  // stops the watchdog pings

  void Ready(const std::string& status);
  void Status(const std::string& status);
  void Stopping(const std::string& status);

 private:
  void StartWatchdog();
  absl::Notification stop_;
  std::thread watchdog_;
};

}  // namespace gpufeed::server
