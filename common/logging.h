// Logging goes through spdlog. The daemon configures the default logger once at start-up;
// libraries log through spdlog's default logger and never configure it.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace gpufeed {

// Sets the default logger's level from "trace|debug|info|warn|error|off".
absl::Status SetLogLevel(std::string_view level);

// Sets the default logger's line format: "text" (spdlog's) or "json", one object a line,
// {"time":"2026-11-30T03:00:00.123456Z","level":"info","logger":"gpufeedd","msg":"..."},
// for log pipelines (Kubernetes). INVALID_ARGUMENT naming log_format otherwise.
absl::Status SetLogFormat(std::string_view format);

}  // namespace gpufeed
