#include "client/ctl/commands/command.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gpufeed::ctl {

CLI::Option* ValueFlag::AddTo(CLI::App& app, const std::string& name, const std::string& type,
                              const std::string& description) {
  name_ = name;
  return app.add_option(name, text_, description)->type_name(type);
}

absl::Status ValueFlag::ReadInt(int64_t* out) const {
  if (!text_.has_value()) return absl::OkStatus();
  if (!absl::SimpleAtoi(*text_, out)) {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": '", *text_, "' is not an integer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<absl::Duration> ValueFlag::ReadDuration(absl::Duration fallback) const {
  if (!text_.has_value()) return fallback;
  absl::Duration d;
  double seconds = 0;
  if (absl::ParseDuration(*text_, &d) && d >= absl::ZeroDuration()) return d;
  if (absl::SimpleAtod(*text_, &seconds) && seconds >= 0) return absl::Seconds(seconds);
  return absl::InvalidArgumentError(
      absl::StrCat(name_, ": want a duration such as 60s or 500ms, got '", *text_, "'"));
}

}  // namespace gpufeed::ctl
