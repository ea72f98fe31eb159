// gpufeedctl sessions: the consumers attached to the daemon, with the uid that owns each (a
// non-admin sees only its own).
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

int RunSessions(const GlobalFlags& global) {
  auto admin = client::AdminClient::Connect(global.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto sessions = (*admin)->ListSessions();
  if (!sessions.ok()) return Fail(sessions.status());
  if (global.json()) {
    std::vector<std::string> items;
    for (const auto& s : *sessions) {
      items.push_back(absl::StrFormat(
          "{\"session_id\":%u,\"owner_uid\":%u,\"job\":%s,\"rank\":%d,\"world_size\":%d,\"feed_key\":%s,"
          "\"delivery\":%s,\"gpu_uuid\":%s,\"epoch\":%d,\"step\":%d,\"ring_slots\":%d,"
          "\"slots_leased\":%d,\"ring_bytes\":%u,\"batches_delivered\":%d,\"streaming\":%s,"
          "\"age_ms\":%d}",
          s.session_id, s.owner_uid, JsonString(s.job), s.rank, s.world_size, JsonString(s.feed_key),
          JsonString(s.delivery), JsonString(s.gpu_uuid), s.delivered.epoch, s.delivered.step,
          s.ring_slots, s.slots_leased, s.ring_bytes, s.batches_delivered,
          s.streaming ? "true" : "false", s.age_ms));
    }
    std::printf("[%s]\n", absl::StrJoin(items, ",").c_str());
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : *sessions) {
    rows.push_back({absl::StrCat(s.session_id), absl::StrCat(s.owner_uid), s.job, absl::StrCat(s.rank, "/", s.world_size),
                    s.feed_key, s.gpu_uuid.empty() ? s.delivery : s.gpu_uuid.substr(0, 12),
                    absl::StrCat("(", s.delivered.epoch, ", ", s.delivered.step, ")"),
                    absl::StrCat(s.slots_leased, "/", s.ring_slots), absl::StrCat(s.ring_bytes),
                    absl::StrCat(s.batches_delivered), s.streaming ? "yes" : "no"});
  }
  PrintTable({"ID", "UID", "JOB", "RANK", "FEED", "DELIVERY", "POSITION", "LEASED", "RING_BYTES",
              "BATCHES", "STREAMING"},
             rows);
  return 0;
}

}  // namespace

Command AddSessions(CLI::App& app) {
  return {app.add_subcommand("sessions", "the consumers attached to the daemon"), RunSessions};
}

}  // namespace gpufeed::ctl
