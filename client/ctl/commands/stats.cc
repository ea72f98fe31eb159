// gpufeedctl stats: a live table per feed and per consumer, rates over one interval.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

struct StatsFlags {
  ValueFlag interval;
  ValueFlag count;
};

// One reading of the daemon's counters.
struct Sample {
  absl::Time at;
  std::vector<client::FeedInfo> feeds;
  std::vector<client::SessionSummary> sessions;
};

absl::StatusOr<Sample> TakeSample(client::AdminClient& admin) {
  Sample s;
  s.at = absl::Now();
  auto feeds = admin.ListFeeds();
  if (!feeds.ok()) return feeds.status();
  auto sessions = admin.ListSessions();
  if (!sessions.ok()) return sessions.status();
  s.feeds = std::move(*feeds);
  s.sessions = std::move(*sessions);
  return s;
}

// The first element of `v` that `pick` accepts; nullptr when none does.
template <typename T, typename Pick>
const T* Find(const std::vector<T>& v, Pick pick) {
  const auto it = std::find_if(v.begin(), v.end(), pick);
  return it == v.end() ? nullptr : &*it;
}

// Prints the rates between two samples, as tables or as one JSON line.
void PrintRates(const Sample& before, const Sample& now, bool json) {
  const double dt = absl::ToDoubleSeconds(now.at - before.at);
  std::vector<std::vector<std::string>> feed_rows, session_rows;
  std::vector<std::string> feed_json, session_json;
  for (const auto& f : now.feeds) {
    const client::FeedInfo* old =
        Find(before.feeds, [&](const client::FeedInfo& o) { return o.key == f.key; });
    // A feed recreated under the same key restarts its counters: no rate then.
    const bool same = old != nullptr && f.batches_produced >= old->batches_produced &&
                      f.bytes_produced >= old->bytes_produced;
    const double batches = same ? (f.batches_produced - old->batches_produced) / dt : 0;
    const double bytes =
        same ? static_cast<double>(f.bytes_produced - old->bytes_produced) / dt : 0;
    feed_rows.push_back({f.key, f.kind, absl::StrCat(f.sessions), absl::StrFormat("%.1f", batches),
                         absl::StrFormat("%.1f", bytes / 1e6)});
    feed_json.push_back(absl::StrFormat(
        "{\"key\":%s,\"kind\":%s,\"sessions\":%d,\"batches_per_s\":%.3f,\"bytes_per_s\":%.1f}",
        JsonString(f.key), JsonString(f.kind), f.sessions, batches, bytes));
  }
  for (const auto& s : now.sessions) {
    const client::SessionSummary* old = Find(before.sessions, [&](const client::SessionSummary& o) {
      return o.session_id == s.session_id;
    });
    const double batches = old ? (s.batches_delivered - old->batches_delivered) / dt : 0;
    const double bytes =
        old ? static_cast<double>(s.bytes_delivered - old->bytes_delivered) / dt : 0;
    const double blocked =
        old ? 100.0 * static_cast<double>(s.producer_blocked_ns - old->producer_blocked_ns) /
                  (dt * 1e9)
            : 0;
    const int64_t wall = old ? s.streaming_ns - old->streaming_ns : 0;
    const double wait =
        wall > 0 ? 100.0 * static_cast<double>(s.consumer_wait_ns - old->consumer_wait_ns) /
                       static_cast<double>(wall)
                 : 0;
    session_rows.push_back({absl::StrCat(s.session_id), s.job, absl::StrCat(s.rank), s.delivery,
                            absl::StrFormat("%.1f", batches), absl::StrFormat("%.1f", bytes / 1e6),
                            absl::StrFormat("%.0f%%", blocked), absl::StrFormat("%.0f%%", wait),
                            absl::StrFormat("%.0f%%", 100 * s.cpu_decode_share)});
    session_json.push_back(absl::StrFormat(
        "{\"session_id\":%d,\"job\":%s,\"rank\":%d,\"delivery\":%s,\"batches_per_s\":%.3f,"
        "\"bytes_per_s\":%.1f,\"producer_blocked_pct\":%.2f,\"consumer_wait_pct\":%.2f,"
        "\"cpu_decode_pct\":%.1f}",
        s.session_id, JsonString(s.job), s.rank, JsonString(s.delivery), batches, bytes, blocked,
        wait, 100 * s.cpu_decode_share));
  }
  if (json) {
    std::printf("{\"interval_s\":%.3f,\"feeds\":[%s],\"sessions\":[%s]}\n", dt,
                absl::StrJoin(feed_json, ",").c_str(), absl::StrJoin(session_json, ",").c_str());
    return;
  }
  if (isatty(STDOUT_FILENO)) std::fputs("\033[H\033[2J", stdout);  // redraw in place
  PrintTable({"FEED", "KIND", "SESSIONS", "BATCHES/S", "MB/S"}, feed_rows);
  std::puts("");
  PrintTable({"SESSION", "JOB", "RANK", "DELIVERY", "BATCHES/S", "MB/S", "PRODUCER_BLOCKED",
              "CONSUMER_WAIT", "CPU_DECODE"},
             session_rows);
  std::fflush(stdout);
}

int RunStats(const StatsFlags& flags, const GlobalFlags& global) {
  absl::StatusOr<absl::Duration> interval = flags.interval.ReadDuration(absl::Seconds(1));
  if (!interval.ok()) return Fail(interval.status());
  if (*interval < absl::Milliseconds(100)) {
    return Fail(absl::InvalidArgumentError("--interval: at least 100ms"));
  }
  int64_t count = global.json() ? 1 : 0;
  if (absl::Status s = flags.count.ReadInt(&count); !s.ok()) return Fail(s);
  auto admin = client::AdminClient::Connect(global.socket);
  if (!admin.ok()) return Fail(admin.status());
  absl::StatusOr<Sample> before = TakeSample(**admin);
  if (!before.ok()) return Fail(before.status());
  for (int64_t n = 0; count == 0 || n < count; ++n) {
    absl::SleepFor(*interval);
    absl::StatusOr<Sample> now = TakeSample(**admin);
    if (!now.ok()) return Fail(now.status());
    PrintRates(*before, *now, global.json());
    before = std::move(now);
  }
  return 0;
}

}  // namespace

Command AddStats(CLI::App& app) {
  CLI::App* cli = app.add_subcommand(
      "stats",
      "a live table per feed and per consumer (batches/s, bytes/s, producer blocked %,\n"
      "consumer wait %), refreshed every --interval (default 1s); -o json prints one\n"
      "measurement over one interval and exits; --count N stops after N tables");
  auto flags = std::make_shared<StatsFlags>();
  flags->interval.AddTo(*cli, "--interval", "DURATION",
                        "time between tables: 1s (default), 500ms, ...; at least 100ms");
  flags->count.AddTo(*cli, "--count", "N", "stop after N tables (default: never; 1 with -o json)");
  return {cli, [flags](const GlobalFlags& global) { return RunStats(*flags, global); }};
}

}  // namespace gpufeed::ctl
