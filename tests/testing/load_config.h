// gpufeedd's command line through LoadConfig, as main parses it, for tests: absl parses `args`
// into the flags, LoadConfig reads those given; the flags are back at their defaults after.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/status/statusor.h"
#include "server/config.h"

namespace gpufeed::testing {

inline absl::StatusOr<server::DaemonConfig> LoadConfigFromArgs(std::vector<std::string> args) {
  absl::FlagSaver saver;
  args.insert(args.begin(), "gpufeedd");
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  absl::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  return server::LoadConfig(server::GivenFlags(static_cast<int>(argv.size()), argv.data()));
}

}  // namespace gpufeed::testing
