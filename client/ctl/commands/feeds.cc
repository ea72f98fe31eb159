// gpufeedctl feeds: the feeds the daemon runs.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

int64_t BadTotal(const client::FeedInfo& f) {
  int64_t total = 0;
  for (const auto& [reason, count] : f.bad_samples) total += count;
  return total;
}

// The DATASET column: the path, or for a blend its sources and weights, NAME=WEIGHT joined
// by commas; a name holding a comma, '=', a quote or a space is JSON-quoted, so that the
// column reads back one way ("/data/a,b/"=0.5).
std::string DatasetText(const client::FeedInfo& f) {
  if (f.blend.empty()) return f.dataset;
  return absl::StrCat("blend ", absl::StrJoin(f.blend, ",", [](std::string* out, const auto& s) {
                        const bool plain = s.first.find_first_of(",=\" \t\n") == std::string::npos;
                        absl::StrAppend(out, plain ? s.first : JsonString(s.first), "=", s.second);
                      }));
}

int RunFeeds(const GlobalFlags& global) {
  auto admin = client::AdminClient::Connect(global.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto feeds = (*admin)->ListFeeds();
  if (!feeds.ok()) return Fail(feeds.status());
  if (global.json()) {
    std::vector<std::string> items;
    for (const auto& f : *feeds) {
      items.push_back(absl::StrFormat(
          "{\"key\":%s,\"kind\":%s,\"dataset\":%s,\"num_samples\":%d,\"batch_size\":%d,"
          "\"world_size\":%d,\"seed\":%u,\"shuffle\":%s,\"drop_last\":%s,"
          "\"share_group\":%s,\"sessions\":%d,"
          "\"batches_produced\":%d,\"bytes_produced\":%u,\"bad_samples\":{%s},"
          "\"blend\":[%s],\"pack\":%s}",
          JsonString(f.key), JsonString(f.kind), JsonString(f.dataset), f.num_samples, f.batch_size,
          f.world_size, f.seed, f.shuffle ? "true" : "false", f.drop_last ? "true" : "false",
          JsonString(f.share_group), f.sessions, f.batches_produced, f.bytes_produced,
          absl::StrJoin(f.bad_samples, ",",
                        [](std::string* out, const auto& kv) {
                          absl::StrAppend(out, JsonString(kv.first), ":", kv.second);
                        }),
          absl::StrJoin(f.blend, ",",
                        [](std::string* out, const auto& s) {
                          absl::StrAppend(out, "{\"source\":", JsonString(s.first),
                                          ",\"weight\":", s.second, "}");
                        }),
          JsonString(f.pack)));
    }
    std::printf("[%s]\n", absl::StrJoin(items, ",").c_str());
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& f : *feeds) {
    rows.push_back({f.key, f.kind, DatasetText(f), f.pack.empty() ? "-" : f.pack,
                    absl::StrCat(f.num_samples), absl::StrCat(f.batch_size, "x", f.world_size),
                    absl::StrCat(f.seed), f.shuffle ? "yes" : "no", f.drop_last ? "yes" : "no",
                    f.share_group.empty() ? "-" : f.share_group, absl::StrCat(f.sessions),
                    absl::StrCat(f.batches_produced), absl::StrCat(BadTotal(f))});
  }
  PrintTable({"KEY", "KIND", "DATASET", "PACK", "SAMPLES", "BATCHxWORLD", "SEED", "SHUFFLE",
              "DROP_LAST", "GROUP", "SESSIONS", "BATCHES", "BAD"},
             rows);
  return 0;
}

}  // namespace

Command AddFeeds(CLI::App& app) {
  return {app.add_subcommand("feeds", "the feeds the daemon runs"), RunFeeds};
}

}  // namespace gpufeed::ctl
