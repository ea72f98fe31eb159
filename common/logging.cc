#include "common/logging.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "spdlog/formatter.h"
#include "spdlog/spdlog.h"

namespace gpufeed {
namespace {

// JSON lines with the message escaped (spdlog's pattern flags cannot escape it).
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const absl::Time t = absl::FromChrono(msg.time);
    std::string line = absl::StrCat(
        "{\"time\":\"", absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", t, absl::UTCTimeZone()),
        "\",\"level\":\"", spdlog::level::to_string_view(msg.level).data(), "\",\"logger\":\"",
        std::string(msg.logger_name.data(), msg.logger_name.size()), "\",\"msg\":\"");
    for (const char c : std::string_view(msg.payload.data(), msg.payload.size())) {
      switch (c) {
        case '"': line += "\\\""; break;
        case '\\': line += "\\\\"; break;
        case '\n': line += "\\n"; break;
        case '\t': line += "\\t"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            line += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
          } else {
            line += c;
          }
      }
    }
    line += "\"}\n";
    dest.append(line.data(), line.data() + line.size());
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

absl::Status SetLogLevel(std::string_view level) {
  const std::string name(level);
  const spdlog::level::level_enum parsed = spdlog::level::from_str(name);
  // from_str maps unknown names to `off`; only "off" itself may mean off.
  if (parsed == spdlog::level::off && name != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "log_level: unknown level '", name, "' (want trace, debug, info, warn, error or off)"));
  }
  spdlog::set_level(parsed);
  return absl::OkStatus();
}

absl::Status SetLogFormat(std::string_view format) {
  if (format == "json") {
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else if (format == "text") {
    spdlog::set_pattern("%+");
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("log_format: want text or json, got '", std::string(format), "'"));
  }
  return absl::OkStatus();
}

}  // namespace gpufeed
