#include "common/logging.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace gpufeed {

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

}  // namespace gpufeed
