// gpufeedctl status: health, version, uptime and staging memory of the daemon.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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
  auto json_list = [](const std::vector<std::string>& v) {
    std::vector<std::string> quoted;
    for (const std::string& x : v) quoted.push_back(JsonString(x));
    return absl::StrCat("[", absl::StrJoin(quoted, ","), "]");
  };
  if (global.json()) {
    std::printf(
        "{\"health\":%s,\"version\":%s,\"uptime_ms\":%ld,\"sessions\":%d,\"feeds\":%d,"
        "\"staging_total_bytes\":%lu,\"staging_free_bytes\":%lu,\"gpus\":%s,\"mps_gpus\":%s}\n",
        JsonString(s->health).c_str(), JsonString(s->version).c_str(), s->uptime_ms, s->sessions,
        s->feeds, s->staging_total_bytes, s->staging_free_bytes, json_list(s->gpus).c_str(),
        json_list(s->mps_gpus).c_str());
  } else {
    // MPS: the daemon's GPU work runs beside training's only if both are MPS clients.
    const std::string gpus =
        s->protocol < 3 ? std::string("(this gpufeedd does not say: older than protocol 3)")
        : s->gpus.empty()
            ? std::string("none (host delivery only)")
            : absl::StrCat(s->gpus.size(), ", ", s->mps_gpus.size(), " of them through MPS",
                           s->mps_gpus.empty()
                               ? ""
                               : absl::StrCat(" (", absl::StrJoin(s->mps_gpus, ", "), ")"));
    std::printf(
        "health    %s\nversion   %s\nuptime    %.1f s\nsessions  %d\nfeeds     %d\n"
        "staging   %lu of %lu bytes free\ngpus      %s\n",
        s->health.c_str(), s->version.c_str(), s->uptime_ms / 1000.0, s->sessions, s->feeds,
        s->staging_free_bytes, s->staging_total_bytes, gpus.c_str());
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
