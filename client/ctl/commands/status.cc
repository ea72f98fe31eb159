// gpufeedctl status: health, version, uptime and staging memory of the daemon.
#include <cstdio>

#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

int RunStatus(const GlobalFlags& global) {
  auto admin = client::AdminClient::Connect(global.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto s = (*admin)->GetStatus();
  if (!s.ok()) return Fail(s.status());
  if (global.json()) {
    std::printf(
        "{\"health\":%s,\"version\":%s,\"uptime_ms\":%ld,\"sessions\":%d,\"feeds\":%d,"
        "\"staging_total_bytes\":%lu,\"staging_free_bytes\":%lu}\n",
        JsonString(s->health).c_str(), JsonString(s->version).c_str(), s->uptime_ms, s->sessions,
        s->feeds, s->staging_total_bytes, s->staging_free_bytes);
  } else {
    std::printf(
        "health    %s\nversion   %s\nuptime    %.1f s\nsessions  %d\nfeeds     %d\n"
        "staging   %lu of %lu bytes free\n",
        s->health.c_str(), s->version.c_str(), s->uptime_ms / 1000.0, s->sessions, s->feeds,
        s->staging_free_bytes, s->staging_total_bytes);
  }
  return 0;
}

}  // namespace

Command AddStatus(CLI::App& app) {
  CLI::App* cli =
      app.add_subcommand("status", "health, version, uptime and staging memory of the daemon");
  return {cli, RunStatus};
}

}  // namespace gpufeed::ctl
