// gpufeedctl: inspect gpufeedd and consume from it.
//
//   gpufeedctl [--socket PATH] [-o table|json] status|feeds|sessions|stats|version
//   gpufeedctl [--socket PATH] drain [--timeout 60s]
//   gpufeedctl [--socket PATH] [-o table|json] consume --dataset PATH --batch-size B ...
//
// Flags are parsed by hand rather than with absl flags: the CLI's flags are dashed
// (--world-size, --no-shuffle) and scoped to a subcommand, which absl flags do not model.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gpufeed/client.h"

#ifdef GPUFEED_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using gpufeed::client::AdminClient;
using gpufeed::client::AttachOptions;
using gpufeed::client::Batch;
using gpufeed::client::Session;

constexpr char kUsage[] = R"(usage: gpufeedctl [--socket PATH] [-o table|json] COMMAND [flags]

commands:
  status     health, version, uptime and staging memory of the daemon
  feeds      the feeds the daemon runs
  sessions   the consumers attached to it
  stats      a live table per feed and per consumer (batches/s, bytes/s, producer blocked %,
             consumer wait %), refreshed every --interval (default 1s); -o json prints one
             measurement over one interval and exits; --count N stops after N tables
  drain      readiness NOT_SERVING, new sessions refused, current ones run to their end; the
             daemon exits after the last one or at --timeout (default 60s; 0 = none). Waits
             for the daemon to exit and says so
  version    gpufeedctl's version, and the daemon's when it answers
  consume    attach as one consumer and read batches

consume flags:
  --job NAME            job name (default "default")
  --rank R              this consumer's rank (default 0)
  --world-size W        ranks in the job (default 1)
  --kind KIND           tokens (default), records or image_folder
  --dataset PATH        dataset file, absolute path as the daemon sees it
  --token-dtype T       uint16 or uint32 (tokens; default: a .npy file's header, else uint16)
  --seq-len L           tokens per sample (tokens)
  --vocab-size V        tokens: refuse the file if a sample of it holds a token >= V
  --batch-size B        samples per rank per step
  --seed S              shuffle seed (default 0)
  --no-shuffle          visit samples in order
  --no-drop-last        pad the last batch of each epoch instead of dropping it
  --epochs E            epochs to read from the start epoch (default 1; 0 = no end)
  --max-batches N       stop after N batches (default: no limit)
  --start-epoch E0      resume at epoch E0 (default 0)
  --start-step S0       resume at step S0 of E0 (default 0)
  --start-fingerprint F the fingerprint printed by the run that reached (E0, S0): refuses,
                        naming each difference, a dataset or settings other than that run's
  --ring-slots K        ring depth (default: the daemon's)
  --step-ms MS          hold each batch MS milliseconds, as a training step would
  --timeout-ms MS       give up when no batch comes for MS milliseconds (default 60000)
  --ids FILE            write one JSON line per batch: rank, epoch, step, ids, valid
  --checksum            print "checksum <u64>": sum over valid samples of sum_j (j+1)*t_j
  --device GPU          device delivery to cuda:N or a GPU-... UUID: batches land in that
                        GPU's memory; --checksum copies each batch back to compute the sum
  --ipc KIND            device delivery: auto (default), vmm or legacy
  --pipeline FILE       image datasets: the pipeline as JSON (deploy/pipelines/*.json)
  --bad-sample POLICY   image datasets: skip (default: replace, count, log) or fail
  --decode WHO          image datasets, device delivery: auto (default: nvJPEG where the
                        daemon has it), cpu or nvjpeg
  --augment WHERE       image datasets, device delivery: auto (default: the GPU), cpu or gpu
  --dump PREFIX         write the first batch's tensors as PREFIX.<tensor>.npy (and its ids
                        as PREFIX.ids.npy)

The socket defaults to $GPUFEED_SOCKET, then /run/gpufeed/gpufeed.sock.
)";

struct Args {
  std::string socket;
  std::string output = "table";
  std::string command;
  std::map<std::string, std::string> values;  // flag -> value ("" for switches)
};

// Flags that take a value; the rest are switches.
const std::vector<std::string> kValueFlags = {
    "--job",        "--rank",        "--world-size",  "--kind",       "--dataset",
    "--token-dtype", "--seq-len",    "--batch-size",  "--seed",       "--epochs",
    "--max-batches", "--vocab-size", "--start-epoch", "--start-step", "--ring-slots", "--step-ms",
    "--timeout-ms",  "--ids",        "--device",      "--ipc",        "--pipeline",   "--bad-sample",
    "--decode",     "--augment",     "--dump",        "--interval",   "--count",
    "--timeout",    "--start-fingerprint"};
const std::vector<std::string> kSwitches = {"--no-shuffle", "--no-drop-last", "--checksum"};

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

absl::StatusOr<Args> Parse(int argc, char** argv) {
  Args args;
  if (const char* env = std::getenv("GPUFEED_SOCKET"); env != nullptr && *env != '\0') {
    args.socket = env;
  } else {
    args.socket = gpufeed::client::kDefaultSocket;
  }
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string value;
    bool has_inline = false;
    if (const size_t eq = a.find('='); a.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_inline = true;
    }
    auto take = [&]() -> absl::StatusOr<std::string> {
      if (has_inline) return value;
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(a, " needs a value"));
      return std::string(argv[++i]);
    };
    if (a == "-h" || a == "--help") {
      return absl::CancelledError("help");
    } else if (a == "--socket") {
      auto v = take();
      if (!v.ok()) return v.status();
      args.socket = *v;
    } else if (a == "-o" || a == "--output") {
      auto v = take();
      if (!v.ok()) return v.status();
      if (*v != "table" && *v != "json") {
        return absl::InvalidArgumentError(absl::StrCat("-o: want table or json, got '", *v, "'"));
      }
      args.output = *v;
    } else if (Contains(kValueFlags, a)) {
      auto v = take();
      if (!v.ok()) return v.status();
      args.values[a] = *v;
    } else if (Contains(kSwitches, a)) {
      args.values[a] = "";
    } else if (a.rfind("-", 0) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", a));
    } else if (args.command.empty()) {
      args.command = a;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
  }
  if (args.command.empty()) return absl::InvalidArgumentError("no command given");
  return args;
}

absl::Status IntFlag(const Args& args, const std::string& flag, int64_t* out) {
  auto it = args.values.find(flag);
  if (it == args.values.end()) return absl::OkStatus();
  if (!absl::SimpleAtoi(it->second, out)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", it->second, "' is not an integer"));
  }
  return absl::OkStatus();
}

std::string StringFlag(const Args& args, const std::string& flag, const std::string& fallback) {
  auto it = args.values.find(flag);
  return it == args.values.end() ? fallback : it->second;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  auto line = [&](const std::vector<std::string>& row) {
    std::string out;
    for (size_t c = 0; c < row.size(); ++c) {
      out += row[c];
      if (c + 1 < row.size()) out += std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::printf("%s\n", out.c_str());
  };
  line(header);
  for (const auto& row : rows) line(row);
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

int Status(const Args& args) {
  auto admin = AdminClient::Connect(args.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto s = (*admin)->GetStatus();
  if (!s.ok()) return Fail(s.status());
  if (args.output == "json") {
    std::printf(
        "{\"health\":%s,\"version\":%s,\"uptime_ms\":%ld,\"sessions\":%d,\"feeds\":%d,"
        "\"staging_total_bytes\":%lu,\"staging_free_bytes\":%lu}\n",
        JsonString(s->health).c_str(), JsonString(s->version).c_str(), s->uptime_ms, s->sessions,
        s->feeds, s->staging_total_bytes, s->staging_free_bytes);
  } else {
    std::printf("health    %s\nversion   %s\nuptime    %.1f s\nsessions  %d\nfeeds     %d\n"
                "staging   %lu of %lu bytes free\n",
                s->health.c_str(), s->version.c_str(), s->uptime_ms / 1000.0, s->sessions,
                s->feeds, s->staging_free_bytes, s->staging_total_bytes);
  }
  return 0;
}

constexpr char kCtlVersion[] = "0.1.0";

// "60s", "500ms", "2m" (absl durations) or plain seconds.
absl::StatusOr<absl::Duration> DurationFlag(const Args& args, const std::string& flag,
                                            absl::Duration fallback) {
  auto it = args.values.find(flag);
  if (it == args.values.end()) return fallback;
  absl::Duration d;
  double seconds = 0;
  if (absl::ParseDuration(it->second, &d) && d >= absl::ZeroDuration()) return d;
  if (absl::SimpleAtod(it->second, &seconds) && seconds >= 0) return absl::Seconds(seconds);
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": want a duration such as 60s or 500ms, got '", it->second, "'"));
}

int Version(const Args& args) {
  std::string daemon = "not answering";
  if (auto admin = AdminClient::Connect(args.socket, absl::Seconds(2)); admin.ok()) {
    if (auto s = (*admin)->GetStatus(); s.ok()) daemon = s->version;
  }
  if (args.output == "json") {
    std::printf("{\"gpufeedctl\":%s,\"gpufeedd\":%s}\n", JsonString(kCtlVersion).c_str(),
                JsonString(daemon).c_str());
  } else {
    std::printf("gpufeedctl %s\ngpufeedd   %s (%s)\n", kCtlVersion, daemon.c_str(),
                args.socket.c_str());
  }
  return 0;
}

int Drain(const Args& args) {
  absl::StatusOr<absl::Duration> timeout = DurationFlag(args, "--timeout", absl::Seconds(60));
  if (!timeout.ok()) return Fail(timeout.status());
  auto admin = AdminClient::Connect(args.socket);
  if (!admin.ok()) return Fail(admin.status());
  absl::StatusOr<int32_t> sessions = (*admin)->Drain(*timeout);
  if (!sessions.ok()) return Fail(sessions.status());
  std::fprintf(stderr, "draining %s: %d sessions attached, new ones refused\n",
               args.socket.c_str(), *sessions);
  // The daemon exits after its last session or at the timeout; wait a little beyond that.
  const absl::Time give_up = *timeout > absl::ZeroDuration()
                                 ? absl::Now() + *timeout + absl::Seconds(10)
                                 : absl::InfiniteFuture();
  absl::Time last = absl::Now();
  while (absl::Now() < give_up) {
    auto status = (*admin)->GetStatus();
    if (!status.ok()) {
      std::fprintf(stderr, "gpufeedd has exited\n");
      return 0;
    }
    if (absl::Now() - last >= absl::Seconds(1)) {
      last = absl::Now();
      std::fprintf(stderr, "draining: %d sessions left\n", status->sessions);
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  std::fprintf(stderr, "gpufeedctl: gpufeedd is still up %s after the drain's timeout\n",
               absl::FormatDuration(absl::Seconds(10)).c_str());
  return 1;
}

int Stats(const Args& args) {
  absl::StatusOr<absl::Duration> interval = DurationFlag(args, "--interval", absl::Seconds(1));
  if (!interval.ok()) return Fail(interval.status());
  if (*interval < absl::Milliseconds(100)) {
    return Fail(absl::InvalidArgumentError("--interval: at least 100ms"));
  }
  int64_t count = args.output == "json" ? 1 : 0;
  if (absl::Status s = IntFlag(args, "--count", &count); !s.ok()) return Fail(s);
  auto admin = AdminClient::Connect(args.socket);
  if (!admin.ok()) return Fail(admin.status());
  struct Sample {
    absl::Time at;
    std::vector<gpufeed::client::FeedInfo> feeds;
    std::vector<gpufeed::client::SessionSummary> sessions;
  };
  auto take = [&]() -> absl::StatusOr<Sample> {
    Sample s;
    s.at = absl::Now();
    auto feeds = (*admin)->ListFeeds();
    if (!feeds.ok()) return feeds.status();
    auto sessions = (*admin)->ListSessions();
    if (!sessions.ok()) return sessions.status();
    s.feeds = std::move(*feeds);
    s.sessions = std::move(*sessions);
    return s;
  };
  absl::StatusOr<Sample> before = take();
  if (!before.ok()) return Fail(before.status());
  for (int64_t n = 0; count == 0 || n < count; ++n) {
    absl::SleepFor(*interval);
    absl::StatusOr<Sample> now = take();
    if (!now.ok()) return Fail(now.status());
    const double dt = absl::ToDoubleSeconds(now->at - before->at);
    std::vector<std::vector<std::string>> feed_rows, session_rows;
    std::vector<std::string> feed_json, session_json;
    for (const auto& f : now->feeds) {
      const auto* old = [&]() -> const gpufeed::client::FeedInfo* {
        for (const auto& o : before->feeds) if (o.key == f.key) return &o;
        return nullptr;
      }();
      // A feed recreated under the same key restarts its counters: no rate then.
      const bool same = old != nullptr && f.batches_produced >= old->batches_produced &&
                        f.bytes_produced >= old->bytes_produced;
      const double batches = same ? (f.batches_produced - old->batches_produced) / dt : 0;
      const double bytes = same ? static_cast<double>(f.bytes_produced - old->bytes_produced) / dt : 0;
      feed_rows.push_back({f.key, f.kind, absl::StrCat(f.sessions), absl::StrFormat("%.1f", batches),
                           absl::StrFormat("%.1f", bytes / 1e6)});
      feed_json.push_back(absl::StrFormat(
          "{\"key\":%s,\"kind\":%s,\"sessions\":%d,\"batches_per_s\":%.3f,\"bytes_per_s\":%.1f}",
          JsonString(f.key), JsonString(f.kind), f.sessions, batches, bytes));
    }
    for (const auto& s : now->sessions) {
      const auto* old = [&]() -> const gpufeed::client::SessionSummary* {
        for (const auto& o : before->sessions) if (o.session_id == s.session_id) return &o;
        return nullptr;
      }();
      const double batches = old ? (s.batches_delivered - old->batches_delivered) / dt : 0;
      const double bytes = old ? static_cast<double>(s.bytes_delivered - old->bytes_delivered) / dt : 0;
      const double blocked =
          old ? 100.0 * static_cast<double>(s.producer_blocked_ns - old->producer_blocked_ns) / (dt * 1e9) : 0;
      const int64_t wall = old ? s.streaming_ns - old->streaming_ns : 0;
      const double wait =
          wall > 0 ? 100.0 * static_cast<double>(s.consumer_wait_ns - old->consumer_wait_ns) / static_cast<double>(wall) : 0;
      session_rows.push_back({absl::StrCat(s.session_id), s.job, absl::StrCat(s.rank), s.delivery,
                              absl::StrFormat("%.1f", batches), absl::StrFormat("%.1f", bytes / 1e6),
                              absl::StrFormat("%.0f%%", blocked), absl::StrFormat("%.0f%%", wait)});
      session_json.push_back(absl::StrFormat(
          "{\"session_id\":%d,\"job\":%s,\"rank\":%d,\"delivery\":%s,\"batches_per_s\":%.3f,"
          "\"bytes_per_s\":%.1f,\"producer_blocked_pct\":%.2f,\"consumer_wait_pct\":%.2f}",
          s.session_id, JsonString(s.job), s.rank, JsonString(s.delivery), batches, bytes,
          blocked, wait));
    }
    if (args.output == "json") {
      std::printf("{\"interval_s\":%.3f,\"feeds\":[%s],\"sessions\":[%s]}\n", dt,
                  absl::StrJoin(feed_json, ",").c_str(), absl::StrJoin(session_json, ",").c_str());
    } else {
      if (isatty(STDOUT_FILENO)) std::fputs("\033[H\033[2J", stdout);  // redraw in place
      PrintTable({"FEED", "KIND", "SESSIONS", "BATCHES/S", "MB/S"}, feed_rows);
      std::puts("");
      PrintTable({"SESSION", "JOB", "RANK", "DELIVERY", "BATCHES/S", "MB/S", "PRODUCER_BLOCKED",
                  "CONSUMER_WAIT"},
                 session_rows);
      std::fflush(stdout);
    }
    before = std::move(now);
  }
  return 0;
}

int64_t BadTotal(const gpufeed::client::FeedInfo& f) {
  int64_t total = 0;
  for (const auto& [reason, count] : f.bad_samples) total += count;
  return total;
}

int Feeds(const Args& args) {
  auto admin = AdminClient::Connect(args.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto feeds = (*admin)->ListFeeds();
  if (!feeds.ok()) return Fail(feeds.status());
  if (args.output == "json") {
    std::vector<std::string> items;
    for (const auto& f : *feeds) {
      items.push_back(absl::StrFormat(
          "{\"key\":%s,\"kind\":%s,\"dataset\":%s,\"num_samples\":%d,\"batch_size\":%d,"
          "\"world_size\":%d,\"seed\":%u,\"shuffle\":%s,\"drop_last\":%s,\"sessions\":%d,"
          "\"batches_produced\":%d,\"bytes_produced\":%u,\"bad_samples\":{%s}}",
          JsonString(f.key), JsonString(f.kind), JsonString(f.dataset), f.num_samples,
          f.batch_size, f.world_size, f.seed, f.shuffle ? "true" : "false",
          f.drop_last ? "true" : "false", f.sessions, f.batches_produced, f.bytes_produced,
          absl::StrJoin(f.bad_samples, ",", [](std::string* out, const auto& kv) {
            absl::StrAppend(out, JsonString(kv.first), ":", kv.second);
          })));
    }
    std::printf("[%s]\n", absl::StrJoin(items, ",").c_str());
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& f : *feeds) {
    rows.push_back({f.key, f.kind, f.dataset, absl::StrCat(f.num_samples),
                    absl::StrCat(f.batch_size, "x", f.world_size), absl::StrCat(f.seed),
                    f.shuffle ? "yes" : "no", f.drop_last ? "yes" : "no", absl::StrCat(f.sessions),
                    absl::StrCat(f.batches_produced), absl::StrCat(BadTotal(f))});
  }
  PrintTable({"KEY", "KIND", "DATASET", "SAMPLES", "BATCHxWORLD", "SEED", "SHUFFLE", "DROP_LAST",
              "SESSIONS", "BATCHES", "BAD"},
             rows);
  return 0;
}

int Sessions(const Args& args) {
  auto admin = AdminClient::Connect(args.socket);
  if (!admin.ok()) return Fail(admin.status());
  auto sessions = (*admin)->ListSessions();
  if (!sessions.ok()) return Fail(sessions.status());
  if (args.output == "json") {
    std::vector<std::string> items;
    for (const auto& s : *sessions) {
      items.push_back(absl::StrFormat(
          "{\"session_id\":%u,\"job\":%s,\"rank\":%d,\"world_size\":%d,\"feed_key\":%s,"
          "\"delivery\":%s,\"gpu_uuid\":%s,\"epoch\":%d,\"step\":%d,\"ring_slots\":%d,\"slots_leased\":%d,"
          "\"ring_bytes\":%u,\"batches_delivered\":%d,\"streaming\":%s,\"age_ms\":%d}",
          s.session_id, JsonString(s.job), s.rank, s.world_size, JsonString(s.feed_key),
          JsonString(s.delivery), JsonString(s.gpu_uuid), s.delivered.epoch, s.delivered.step, s.ring_slots,
          s.slots_leased, s.ring_bytes, s.batches_delivered, s.streaming ? "true" : "false",
          s.age_ms));
    }
    std::printf("[%s]\n", absl::StrJoin(items, ",").c_str());
    return 0;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : *sessions) {
    rows.push_back({absl::StrCat(s.session_id), s.job, absl::StrCat(s.rank, "/", s.world_size),
                    s.feed_key, s.gpu_uuid.empty() ? s.delivery : s.gpu_uuid.substr(0, 12),
                    absl::StrCat("(", s.delivered.epoch, ", ", s.delivered.step, ")"),
                    absl::StrCat(s.slots_leased, "/", s.ring_slots), absl::StrCat(s.ring_bytes),
                    absl::StrCat(s.batches_delivered), s.streaming ? "yes" : "no"});
  }
  PrintTable({"ID", "JOB", "RANK", "FEED", "DELIVERY", "POSITION", "LEASED", "RING_BYTES",
              "BATCHES", "STREAMING"},
             rows);
  return 0;
}

// sum_j (j+1) * t_j over one sample's elements, each read as an unsigned integer of its width.
uint64_t SampleChecksum(const std::byte* row, uint64_t elements, uint32_t width) {
  uint64_t sum = 0;
  for (uint64_t j = 0; j < elements; ++j) {
    uint64_t t = 0;
    switch (width) {
      case 1: t = static_cast<uint8_t>(row[j]); break;
      case 2: { uint16_t v; std::memcpy(&v, row + 2 * j, 2); t = v; break; }
      case 4: { uint32_t v; std::memcpy(&v, row + 4 * j, 4); t = v; break; }
      default: { std::memcpy(&t, row + 8 * j, 8); break; }
    }
    sum += (j + 1) * t;
  }
  return sum;
}

// The bytes of tensor `t` in host memory (copied back from the GPU for device delivery).
absl::StatusOr<std::vector<std::byte>> HostBytes(const gpufeed::client::Tensor& t, void* stream) {
  std::vector<std::byte> out(t.byte_size);
  if (t.device < 0) {
    std::memcpy(out.data(), t.data, t.byte_size);
    return out;
  }
#ifdef GPUFEED_WITH_CUDA
  auto* cs = static_cast<cudaStream_t>(stream);
  if (cudaMemcpyAsync(out.data(), t.data, t.byte_size, cudaMemcpyDeviceToHost, cs) != cudaSuccess ||
      cudaStreamSynchronize(cs) != cudaSuccess) {
    return absl::InternalError("copying a batch back from the GPU failed");
  }
#endif
  return out;
}

// Writes a version 1.0 .npy file: magic, header length, a dict header padded to 64 bytes.
absl::Status WriteNpy(const std::string& path, const std::string& descr,
                      const std::vector<int64_t>& shape, const void* data, uint64_t bytes) {
  std::string header = absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (",
                                    absl::StrJoin(shape, ", "), shape.size() == 1 ? ",), }" : "), }");
  header.append(63 - (10 + header.size()) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("--dump: cannot write ", path));
  const uint16_t length = static_cast<uint16_t>(header.size());
  out.write("\x93NUMPY\x01\x00", 8);
  out.write(reinterpret_cast<const char*>(&length), 2);
  out << header;
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) return absl::DataLossError(absl::StrCat("--dump: short write to ", path));
  return absl::OkStatus();
}

absl::Status DumpBatch(const gpufeed::client::Batch& batch, const std::string& prefix, void* stream) {
  for (const auto& t : batch.tensors()) {
    const char* descr = nullptr;
    switch (t.dtype) {
      case gpufeed::DType::kUInt8: descr = "|u1"; break;
      case gpufeed::DType::kInt8: descr = "|i1"; break;
      case gpufeed::DType::kUInt16: descr = "<u2"; break;
      case gpufeed::DType::kInt16: descr = "<i2"; break;
      case gpufeed::DType::kUInt32: descr = "<u4"; break;
      case gpufeed::DType::kInt32: descr = "<i4"; break;
      case gpufeed::DType::kInt64: descr = "<i8"; break;
      case gpufeed::DType::kUInt64: descr = "<u8"; break;
      case gpufeed::DType::kFloat16: descr = "<f2"; break;
      case gpufeed::DType::kBFloat16: descr = "<u2"; break;  // numpy has no bfloat16: raw bits
      case gpufeed::DType::kFloat32: descr = "<f4"; break;
      case gpufeed::DType::kFloat64: descr = "<f8"; break;
      case gpufeed::DType::kBool: descr = "|b1"; break;
      default: descr = "|u1"; break;
    }
    absl::StatusOr<std::vector<std::byte>> bytes = HostBytes(t, stream);
    if (!bytes.ok()) return bytes.status();
    absl::Status s = WriteNpy(absl::StrCat(prefix, ".", t.name, ".npy"), descr, t.shape,
                              bytes->data(), bytes->size());
    if (!s.ok()) return s;
  }
  const std::vector<int64_t>& ids = batch.ids();
  return WriteNpy(absl::StrCat(prefix, ".ids.npy"), "<i8", {static_cast<int64_t>(ids.size())},
                  ids.data(), ids.size() * sizeof(int64_t));
}

int Consume(const Args& args) {
  AttachOptions o;
  o.socket = args.socket;
  o.job = StringFlag(args, "--job", "default");
  o.kind = StringFlag(args, "--kind", "tokens");
  o.dataset = StringFlag(args, "--dataset", "");
  o.token_dtype = StringFlag(args, "--token-dtype", "");
  o.bad_sample = StringFlag(args, "--bad-sample", "skip");
  o.decode = StringFlag(args, "--decode", "auto");
  o.augment = StringFlag(args, "--augment", "auto");
  const std::string dump = StringFlag(args, "--dump", "");
  o.shuffle = !args.values.contains("--no-shuffle");
  o.drop_last = !args.values.contains("--no-drop-last");
  int64_t rank = 0, world = 1, seed = 0, epochs = 1, max_batches = -1, ring = 0, step_ms = 0,
          timeout_ms = 60000;
  for (const auto& [flag, target] : std::vector<std::pair<std::string, int64_t*>>{
           {"--rank", &rank}, {"--world-size", &world}, {"--seq-len", &o.seq_len},
           {"--vocab-size", &o.vocab_size},
           {"--batch-size", &o.batch_size}, {"--seed", &seed}, {"--epochs", &epochs},
           {"--max-batches", &max_batches}, {"--start-epoch", &o.start.epoch},
           {"--start-step", &o.start.step}, {"--ring-slots", &ring}, {"--step-ms", &step_ms},
           {"--timeout-ms", &timeout_ms}}) {
    if (absl::Status s = IntFlag(args, flag, target); !s.ok()) return Fail(s);
  }
  if (o.dataset.empty()) return Fail(absl::InvalidArgumentError("--dataset: required"));
  if (epochs < 0) return Fail(absl::InvalidArgumentError("--epochs: must be >= 0"));
  o.rank = static_cast<int32_t>(rank);
  o.world_size = static_cast<int32_t>(world);
  o.seed = static_cast<uint64_t>(seed);
  o.ring_slots = static_cast<int32_t>(ring);
  o.stop_epoch = epochs == 0 ? 0 : o.start.epoch + epochs;
  if (epochs == 0 && max_batches < 0) {
    return Fail(absl::InvalidArgumentError("--epochs 0 (no end) needs --max-batches"));
  }
  std::ofstream ids_out;
  if (const std::string path = StringFlag(args, "--ids", ""); !path.empty()) {
    ids_out.open(path, std::ios::trunc);
    if (!ids_out) return Fail(absl::PermissionDeniedError(absl::StrCat("--ids: cannot write ", path)));
  }
  const bool checksum = args.values.contains("--checksum");
  o.start.fingerprint = StringFlag(args, "--start-fingerprint", "");
  if (const std::string path = StringFlag(args, "--pipeline", ""); !path.empty()) {
    std::ifstream in(path);
    if (!in) return Fail(absl::NotFoundError(absl::StrCat("--pipeline: cannot read ", path)));
    std::stringstream text;
    text << in.rdbuf();
    o.pipeline_json = text.str();
  }
  if (const std::string device = StringFlag(args, "--device", ""); !device.empty()) {
#ifndef GPUFEED_WITH_CUDA
    return Fail(absl::FailedPreconditionError("--device: gpufeedctl was built without CUDA"));
#endif
    o.delivery = "device";
    o.gpu = device;
    o.ipc = StringFlag(args, "--ipc", "auto");
  }
  const bool on_device = o.delivery == "device";
  // Device delivery: batches are waited for and released on one stream of ours, the way a
  // training step would; --checksum copies each batch back into this host buffer.
  void* stream = nullptr;

  const absl::Time start = absl::Now();
  auto session = Session::Attach(o);
  if (!session.ok()) return Fail(session.status());
#ifdef GPUFEED_WITH_CUDA
  if (on_device) {
    cudaSetDevice((*session)->info().gpu_ordinal);
    cudaStream_t s = nullptr;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
      return Fail(absl::InternalError("--device: cannot create a CUDA stream"));
    }
    stream = s;
  }
#endif
  if (!(*session)->info().decode.empty()) {
    std::fprintf(stderr, "images: decode on %s, augment on %s\n",
                 (*session)->info().decode.c_str(), (*session)->info().augment.c_str());
  }
  int64_t batches = 0, samples = 0;
  uint64_t bytes = 0, sum = 0;
  absl::Duration first_batch = absl::ZeroDuration();
  absl::Time last_report = absl::Now();
  absl::Status end;
  while (max_batches < 0 || batches < max_batches) {
    absl::StatusOr<Batch> batch = (*session)->Next(absl::Milliseconds(timeout_ms));
    if (!batch.ok()) {
      end = batch.status();
      break;
    }
    if (batches == 0) first_batch = absl::Now() - start;
    ++batches;
    samples += batch->valid_count();
    for (const auto& t : batch->tensors()) bytes += t.byte_size;
    if (ids_out.is_open()) {
      ids_out << "{\"rank\":" << o.rank << ",\"epoch\":" << batch->epoch()
              << ",\"step\":" << batch->step() << ",\"ids\":[" << absl::StrJoin(batch->ids(), ",")
              << "],\"valid\":" << batch->valid_count() << "}\n";
    }
    if (on_device) {
      if (absl::Status s = batch->WaitReady(stream); !s.ok()) return Fail(s);
    }
    if (!dump.empty() && batches == 1) {
      if (absl::Status s = DumpBatch(*batch, dump, stream); !s.ok()) return Fail(s);
    }
    if (checksum) {
      const auto& t = batch->tensors()[0];
      absl::StatusOr<std::vector<std::byte>> host = HostBytes(t, stream);
      if (!host.ok()) return Fail(host.status());
      const void* data = host->data();
      const uint32_t width = gpufeed::DTypeSize(t.dtype);
      uint64_t elements = 1;
      for (size_t d = 1; d < t.shape.size(); ++d) elements *= static_cast<uint64_t>(t.shape[d]);
      const uint64_t row_bytes = elements * width;
      const auto* base = static_cast<const std::byte*>(data);
      for (int64_t r = 0; r < batch->valid_count(); ++r) {
        sum += SampleChecksum(base + static_cast<uint64_t>(r) * row_bytes, elements, width);
      }
    }
    if (step_ms > 0) absl::SleepFor(absl::Milliseconds(step_ms));
    batch->Release(stream);
    if (absl::Now() - last_report >= absl::Seconds(1)) {
      last_report = absl::Now();
      const double secs = absl::ToDoubleSeconds(last_report - start);
      std::fprintf(stderr, "rank %d: %ld batches, %.1f batches/s, %.1f MB/s\n", o.rank, batches,
                   batches / secs, bytes / secs / 1e6);
    }
  }
#ifdef GPUFEED_WITH_CUDA
  if (stream != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
#endif
  const double secs = std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - start));
  const gpufeed::client::Position pos = (*session)->position();
  if (ids_out.is_open()) ids_out.flush();
  (void)(*session)->Detach();
  if (!end.ok() && !absl::IsOutOfRange(end)) {
    Fail(end);
    std::fprintf(stderr, "stopped after %ld batches at position (%ld, %ld)\n", batches, pos.epoch,
                 pos.step);
    return 1;
  }
  if (args.output == "json") {
    std::printf(
        "{\"rank\":%d,\"batches\":%ld,\"samples\":%ld,\"bytes\":%lu,\"seconds\":%.6f,"
        "\"batches_per_s\":%.3f,\"bytes_per_s\":%.1f,\"first_batch_ms\":%.3f,"
        "\"position\":{\"epoch\":%ld,\"step\":%ld,\"fingerprint\":\"%s\"}%s}\n",
        o.rank, batches, samples, bytes, secs, batches / secs, bytes / secs,
        absl::ToDoubleMilliseconds(first_batch), pos.epoch, pos.step,
        absl::CHexEscape(pos.fingerprint).c_str(),
        checksum ? absl::StrCat(",\"checksum\":", sum).c_str() : "");
  } else {
    std::printf("rank %d: %ld batches, %ld samples, %lu bytes in %.3f s: %.1f batches/s, "
                "%.1f MB/s; first batch after %.1f ms; next position (%ld, %ld)\n",
                o.rank, batches, samples, bytes, secs, batches / secs, bytes / secs / 1e6,
                absl::ToDoubleMilliseconds(first_batch), pos.epoch, pos.step);
    if (checksum) std::printf("checksum %lu\n", sum);
    // To resume: --start-epoch/--start-step from the line above, and this.
    std::printf("fingerprint %s\n", pos.fingerprint.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Args> args = Parse(argc, argv);
  if (!args.ok()) {
    if (absl::IsCancelled(args.status())) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    std::fprintf(stderr, "gpufeedctl: %s\n\n%s", std::string(args.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  const std::map<std::string, std::function<int(const Args&)>> commands = {
      {"status", Status}, {"feeds", Feeds},     {"sessions", Sessions}, {"consume", Consume},
      {"stats", Stats},   {"drain", Drain},     {"version", Version}};
  auto it = commands.find(args->command);
  if (it == commands.end()) {
    std::fprintf(stderr, "gpufeedctl: unknown command '%s'\n\n%s", args->command.c_str(), kUsage);
    return 2;
  }
  // The flags each command takes besides --socket and -o.
  const std::map<std::string, std::vector<std::string>> scoped = {
      {"stats", {"--interval", "--count"}}, {"drain", {"--timeout"}}};
  if (args->command != "consume") {
    const auto allowed = scoped.find(args->command);
    for (const auto& [flag, value] : args->values) {
      if (allowed == scoped.end() || !Contains(allowed->second, flag)) {
        std::fprintf(stderr, "gpufeedctl: %s does not take %s\n", args->command.c_str(),
                     flag.c_str());
        return 2;
      }
    }
  }
  return it->second(*args);
}
