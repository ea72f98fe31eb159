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

std::string EscapeForLog(absl::string_view text, size_t max_bytes) {
  std::string out;
  const bool cut = text.size() > max_bytes;
  if (cut) text = text.substr(0, max_bytes);
  out.reserve(text.size());
  for (const char c : text) {
    const unsigned char u = static_cast<unsigned char>(c);
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (u < 0x20 || u >= 0x7f) {
          out += absl::StrFormat("\\x%02x", u);
        } else {
          out += c;
        }
    }
  }
  if (cut) out += "...";
  return out;
}

void ConfigureLogging(spdlog::level::level_enum level, LogFormat format) {
  spdlog::set_level(level);
  if (format == LogFormat::kJson) {
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else {
    spdlog::set_pattern("%+");
  }
}

}  // namespace gpufeed
