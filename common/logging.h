// Logging goes through spdlog. The daemon configures the default logger once at start-up;
// libraries log through spdlog's default logger and never configure it.
#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "spdlog/common.h"

namespace gpufeed {

// A log line's format: spdlog's text, or JSON, one object a line,
// {"time":"2026-11-30T03:00:00.123456Z","level":"info","logger":"gpufeedd","msg":"..."},
// for log pipelines (Kubernetes).
enum class LogFormat { kText, kJson };

// Sets the default logger's level and line format.
void ConfigureLogging(spdlog::level::level_enum level, LogFormat format);

// A caller-supplied string (a job name, a dataset path) made safe for one log line: printable
// ASCII other than the backslash is kept, everything else is escaped ("\\", "\n", "\t",
// "\r", other bytes as "\xNN"), so a request can neither forge a line nor send terminal
// escapes. At most `max_bytes` of the input are shown, then "...".
std::string EscapeForLog(absl::string_view text, size_t max_bytes = 512);

}  // namespace gpufeed
