// The shape of a gpufeedctl command. Each Add* function adds one CLI11 subcommand with its flags
// to the application and returns what runs it once the whole command line has parsed; main.cc
// picks the one that was given. Running a command throws nothing: it returns the exit status
// (0, or 1 after printing "error: CODE: message" with Fail).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace gpufeed::ctl {

// The flags every command takes, before or after its name.
struct GlobalFlags {
  std::string socket;            // --socket, else $GPUFEED_SOCKET, else the default path
  std::string output = "table";  // -o table|json
  bool json() const { return output == "json"; }
};

struct Command {
  CLI::App* cli = nullptr;  // owned by the application
  std::function<int(const GlobalFlags&)> run;
};

Command AddStatus(CLI::App& app);
Command AddFeeds(CLI::App& app);
Command AddSessions(CLI::App& app);
Command AddStats(CLI::App& app);
Command AddDrain(CLI::App& app);
Command AddVersion(CLI::App& app);
Command AddConsume(CLI::App& app);

// A flag whose value the command converts when it runs, rather than CLI11 at parse time:
// integers in base 10 with absl::SimpleAtoi (CLI11 reads them with strtoll in base 0, so "010"
// would be 8 and "0x10" 16), durations with absl::ParseDuration. A bad value is then an
// INVALID_ARGUMENT naming the flag, exit status 1, as it has always been; a usage error (unknown
// flag, missing value) is CLI11's and exits 2. Bound to CLI11 by address: neither copied nor moved.
class ValueFlag {
 public:
  ValueFlag() = default;
  ValueFlag(const ValueFlag&) = delete;
  ValueFlag& operator=(const ValueFlag&) = delete;

  // Adds `name` ("--rank") to `app`; `type` is the placeholder the help shows ("R").
  CLI::Option* AddTo(CLI::App& app, const std::string& name, const std::string& type,
                     const std::string& description);

  // The value as a base-10 integer; `*out` is left as it is when the flag was not given.
  absl::Status ReadInt(int64_t* out) const;
  // Whether the flag was given (a value whose absence means something: --eos-id).
  bool given() const { return text_.has_value(); }
  // "60s", "500ms", "2m" (absl durations) or plain seconds, not negative; `fallback` when the
  // flag was not given.
  absl::StatusOr<absl::Duration> ReadDuration(absl::Duration fallback) const;

 private:
  std::string name_;
  std::optional<std::string> text_;
};

}  // namespace gpufeed::ctl
