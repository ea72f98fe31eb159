// gpufeedctl: inspect gpufeedd and consume from it.
//
//   gpufeedctl [--socket PATH] [-o table|json] status|feeds|sessions|stats|version
//   gpufeedctl [--socket PATH] drain [--timeout 60s]
//   gpufeedctl [--socket PATH] [-o table|json] consume --dataset PATH --batch-size B ...
//
// One file per command in commands/. The command line is parsed by CLI11, a well-kept,
// widely used library, instead of by hand: subcommands with flags of their own, `--flag value`
// and `--flag=value`, help for the tool and for each command, and the usage errors all come from
// one tested parser rather than a loop of our own. (absl flags do not fit: the flags are dashed,
// --world-size, and scoped to a subcommand.) CLI11 reports --help and usage errors by throwing;
// main() is where they are caught, and nothing past it throws: commands return exit statuses.
#include <cstdio>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "client/ctl/commands/command.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

// Exit statuses: 0 done, 1 the command failed (ctl::Fail), 2 a usage error.
constexpr int kUsageError = 2;

// A flag that belongs to a command other than the one given ("stats does not take --timeout"),
// or to that command but came before its name; CLI11 would only call it unexpected.
bool ReportMisplacedFlag(const CLI::App& app, const CLI::App& given,
                         const std::vector<std::string>& extras) {
  for (const std::string& extra : extras) {
    if (extra.rfind("--", 0) != 0) continue;
    const std::string flag = extra.substr(0, extra.find('='));
    if (given.get_option_no_throw(flag) != nullptr) {
      std::fprintf(stderr, "gpufeedctl: %s is a flag of %s: give it after the command\n",
                   flag.c_str(), given.get_name().c_str());
      return true;
    }
    for (const CLI::App* command : app.get_subcommands({})) {
      if (command->get_option_no_throw(flag) != nullptr) {
        std::fprintf(stderr, "gpufeedctl: %s does not take %s\n", given.get_name().c_str(),
                     flag.c_str());
        return true;
      }
    }
  }
  return false;
}

// Prints a usage error, in CLI11's words unless they would mislead, and returns kUsageError.
int UsageError(const CLI::App& app, const CLI::ParseError& error) {
  const std::vector<std::string> extras = app.remaining(true);
  const std::vector<CLI::App*> given = app.get_subcommands();
  if (given.empty() && !extras.empty() && extras[0].rfind('-', 0) != 0) {
    // CLI11 would say "A subcommand is required".
    std::fprintf(stderr, "gpufeedctl: unknown command '%s'\n", extras[0].c_str());
  } else if (given.empty() || !ReportMisplacedFlag(app, *given[0], extras)) {
    std::fprintf(stderr, "gpufeedctl: %s\n", error.what());
  }
  std::fprintf(stderr, "Run gpufeedctl --help, or gpufeedctl COMMAND --help.\n");
  return kUsageError;
}

int Main(int argc, char** argv) {
  CLI::App app("inspect gpufeedd and consume from it", "gpufeedctl");
  app.footer(
      "--socket and -o go before or after the command. The socket defaults to $GPUFEED_SOCKET,\n"
      "then /run/gpufeed/gpufeed.sock if it exists, then $XDG_RUNTIME_DIR/gpufeed/gpufeed.sock\n"
      "(where a gpufeedd run without root listens).");
  // Subcommands inherit these (and the footer): a flag given twice takes the last value, and
  // --socket and -o may come after the command too, as they always could.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.fallthrough();
  app.require_subcommand(1);
  app.get_formatter()->column_width(26);
  app.get_formatter()->label("SUBCOMMAND", "COMMAND");

  GlobalFlags global;
  global.socket = "";  // client::DefaultSocket(), by SocketPath below
  app.add_option("--socket", global.socket, "gpufeedd's Unix socket")
      ->type_name("PATH")
      ->envname("GPUFEED_SOCKET");
  app.add_option("-o,--output", global.output, "table (default) or json")
      ->type_name("table|json")
      ->check(CLI::IsMember({"table", "json"}).description(""));
  const std::vector<Command> commands = {AddStatus(app), AddFeeds(app), AddSessions(app),
                                         AddStats(app),  AddDrain(app), AddVersion(app),
                                         AddConsume(app)};
  for (const Command& command : commands) command.cli->group("Commands");
  try {
    app.parse(argc, argv);
    global.socket = client::SocketPath(global.socket);  // "unix:///..." as gpufeedd logs it
  } catch (const CLI::CallForHelp&) {
    // gpufeedctl --help: every command with its flags; gpufeedctl COMMAND --help: that one.
    const CLI::AppFormatMode mode =
        app.get_subcommands().empty() ? CLI::AppFormatMode::All : CLI::AppFormatMode::Normal;
    std::fputs(app.help("", mode).c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& error) {
    return UsageError(app, error);
  }
  for (const Command& command : commands) {
    if (command.cli->parsed()) return command.run(global);
  }
  return kUsageError;  // not reached: require_subcommand(1)
}

}  // namespace
}  // namespace gpufeed::ctl

int main(int argc, char** argv) {
  try {
    return gpufeed::ctl::Main(argc, argv);
  } catch (const CLI::ConstructionError& error) {  // a flag declared wrongly: our bug
    std::fprintf(stderr, "gpufeedctl: %s\n", error.what());
    return 1;
  }
}
