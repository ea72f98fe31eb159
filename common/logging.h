// Logging goes through spdlog. The daemon configures the default logger once at start-up;
// libraries log through spdlog's default logger and never configure it.
#pragma once

#include "spdlog/common.h"

namespace gpufeed {

// A log line's format: spdlog's text, or JSON, one object a line,
// {"time":"2026-11-30T03:00:00.123456Z","level":"info","logger":"gpufeedd","msg":"..."},
// for log pipelines (Kubernetes).
enum class LogFormat { kText, kJson };

// Sets the default logger's level and line format.
void ConfigureLogging(spdlog::level::level_enum level, LogFormat format);

}  // namespace gpufeed
