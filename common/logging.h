// Logging goes through spdlog. The daemon configures the default logger once at start-up;
// libraries log through spdlog's default logger and never configure it.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace gpufeed {

// Sets the default logger's level from "trace|debug|info|warn|error|off".
absl::Status SetLogLevel(std::string_view level);

}  // namespace gpufeed
