// gpufeedctl version: gpufeedctl's version, and the daemon's when it answers.
#include "common/version.h"

#include <cstdio>
#include <string>

#include "absl/time/time.h"
#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

constexpr const char* kCtlVersion = kVersion;  // common/version.h

int RunVersion(const GlobalFlags& global) {
  std::string daemon = "not answering";
  if (auto admin = client::AdminClient::Connect(global.socket, absl::Seconds(2)); admin.ok()) {
    if (auto s = (*admin)->GetStatus(); s.ok()) daemon = s->version;
  }
  if (global.json()) {
    std::printf("{\"gpufeedctl\":%s,\"gpufeedd\":%s}\n", JsonString(kCtlVersion).c_str(),
                JsonString(daemon).c_str());
  } else {
    std::printf("gpufeedctl %s\ngpufeedd   %s (%s)\n", kCtlVersion, daemon.c_str(),
                global.socket.c_str());
  }
  return 0;
}

}  // namespace

Command AddVersion(CLI::App& app) {
  CLI::App* cli =
      app.add_subcommand("version", "gpufeedctl's version, and the daemon's when it answers");
  return {cli, RunVersion};
}

}  // namespace gpufeed::ctl
