// gpufeedctl drain: readiness NOT_SERVING, new sessions refused, current ones run to their end;
// waits until the daemon has exited.
#include <cstdint>
#include <cstdio>
#include <memory>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

struct DrainFlags {
  ValueFlag timeout;
};

int RunDrain(const DrainFlags& flags, const GlobalFlags& global) {
  absl::StatusOr<absl::Duration> timeout = flags.timeout.ReadDuration(absl::Seconds(60));
  if (!timeout.ok()) return Fail(timeout.status());
  auto admin = client::AdminClient::Connect(global.socket);
  if (!admin.ok()) return Fail(admin.status());
  absl::StatusOr<int32_t> sessions = (*admin)->Drain(*timeout);
  if (!sessions.ok()) return Fail(sessions.status());
  std::fprintf(stderr, "draining %s: %d sessions attached, new ones refused\n",
               global.socket.c_str(), *sessions);
  // The daemon exits after its last session or at the timeout; wait a little beyond that.
  const absl::Time give_up = *timeout > absl::ZeroDuration()
                                 ? absl::Now() + *timeout + absl::Seconds(10)
                                 : absl::InfiniteFuture();
  absl::Time last = absl::Now();
  while (absl::Now() < give_up) {
    auto status = (*admin)->GetStatus();
    if (!status.ok()) {
      std::fprintf(stderr, "gpufeedd has exited\n");
      return 0;
    }
    if (absl::Now() - last >= absl::Seconds(1)) {
      last = absl::Now();
      std::fprintf(stderr, "draining: %d sessions left\n", status->sessions);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  std::fprintf(stderr, "gpufeedctl: gpufeedd is still up %s after the drain's timeout\n",
               absl::FormatDuration(absl::Seconds(10)).c_str());
  return 1;
}

}  // namespace

Command AddDrain(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "drain",
      "readiness NOT_SERVING, new sessions refused, current ones run to their end; the\n"
      "daemon exits after the last one or at --timeout (default 60s; 0 = none). Waits\n"
      "for the daemon to exit and says so");
  auto flags = std::make_shared<DrainFlags>();
  flags->timeout.AddTo(*cli, "--timeout", "DURATION",
                       "how long the daemon lets sessions run on: 60s, 500ms, 2m or seconds\n"
                       "(default 60s; 0 = no limit)");
  return {cli, [flags](const GlobalFlags& global) { return RunDrain(*flags, global); }};
}

}  // namespace gpufeed::ctl
