// The configuration's file, its validation and its enums' names; the flags, and LoadConfig
// which applies them over the file, are config_flags.cc.
#include "server/config.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "gpufeed/v1/config.pb.h"
#include "server/config_internal.h"

namespace gpufeed::server {
using config_internal::Sources;
namespace {


// INVALID_ARGUMENT "field: message", or "config FILE: file_field: message" when the value
// came from a file.
absl::Status Invalid(const Sources& sources, const std::string& field, absl::string_view message) {
  const auto source = sources.find(field);
  return absl::InvalidArgumentError(
      absl::StrCat(source == sources.end() ? field : source->second, ": ", message));
}

// Collects protobuf's text-format errors with their line and column.
class ParseErrors final : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (first.empty()) {
      first = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
    }
  }
  std::string first;
};

absl::StatusOr<std::string> SocketPath(const std::string& listen) {
  std::string path;
  if (absl::StartsWith(listen, "unix://")) {
    path = listen.substr(7);
  } else if (absl::StartsWith(listen, "unix:")) {
    path = listen.substr(5);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", listen, "' is not a unix socket address (want unix:///path/to.sock)"));
  }
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("'", listen, "' must name an absolute socket path"));
  }
  return path;
}

// An optional TCP address: "" (off) or HOST:PORT.
absl::Status CheckHostPort(const Sources& sources, const std::string& field,
                           const std::string& value) {
  const size_t colon = value.rfind(':');
  int port = 0;
  if (value.empty() ||
      (colon != std::string::npos && colon != 0 &&
       absl::SimpleAtoi(value.substr(colon + 1), &port) && port >= 0 && port <= 65535)) {
    return absl::OkStatus();
  }
  return Invalid(sources, field,
                 absl::StrCat("want HOST:PORT (e.g. 0.0.0.0:9090), got '", value, "'"));
}

}  // namespace

namespace config_internal {

absl::Status ApplyFile(const std::string& path, DaemonConfig* c, Sources* sources) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("config: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  const std::string body = text.str();
  v1::DaemonConfig file;
  const size_t first = body.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && body[first] == '{') {
    const auto parsed = google::protobuf::util::JsonStringToMessage(body, &file);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": ", std::string(parsed.message())));
    }
  } else {
    google::protobuf::TextFormat::Parser parser;
    ParseErrors errors;
    parser.RecordErrorsTo(&errors);
    if (!parser.ParseFromString(body, &file)) {
      return absl::InvalidArgumentError(absl::StrCat("config ", path, ": ", errors.first));
    }
  }
  // Records that `field` came from the file's `file_field`.
  auto from_file = [&](const std::string& field, absl::string_view file_field) {
    (*sources)[field] = absl::StrCat("config ", path, ": ", file_field);
  };
  // An enum's name: parsed here, so that a bad one names the file.
  auto parse = [&](auto parsed, auto* field) {
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config ", path, ": ", parsed.status().message()));
    }
    *field = *parsed;
    return absl::OkStatus();
  };
#define GPUFEED_FROM_FILE(proto_field, field, value) \
  if (file.has_##proto_field()) {                    \
    c->field = (value);                              \
    from_file(#field, #proto_field);                 \
  }
  GPUFEED_FROM_FILE(listen, listen, file.listen());
  GPUFEED_FROM_FILE(mem_socket, mem_socket, file.mem_socket());
  GPUFEED_FROM_FILE(runtime_dir, runtime_dir, file.runtime_dir());
  GPUFEED_FROM_FILE(staging_bytes, staging_bytes, file.staging_bytes());
  GPUFEED_FROM_FILE(staging_slab_bytes, staging_slab_bytes, file.staging_slab_bytes());
  GPUFEED_FROM_FILE(device_bytes, device_bytes, file.device_bytes());
  GPUFEED_FROM_FILE(threads, threads, file.threads());
  GPUFEED_FROM_FILE(attach_threads, attach_threads, file.attach_threads());
  GPUFEED_FROM_FILE(max_sessions, max_sessions, file.max_sessions());
  GPUFEED_FROM_FILE(ring_slots, ring_slots, file.ring_slots());
  GPUFEED_FROM_FILE(attach_timeout_ms, attach_timeout,
                    absl::Milliseconds(file.attach_timeout_ms()));
  GPUFEED_FROM_FILE(stall_timeout_ms, stall_timeout, absl::Milliseconds(file.stall_timeout_ms()));
  GPUFEED_FROM_FILE(shutdown_grace_ms, shutdown_grace,
                    absl::Milliseconds(file.shutdown_grace_ms()));
  GPUFEED_FROM_FILE(nvjpeg_library, nvjpeg_library, file.nvjpeg_library());
  GPUFEED_FROM_FILE(nvjpeg_interpolation, nvjpeg_interpolation, file.nvjpeg_interpolation());
  GPUFEED_FROM_FILE(adaptive_decode, adaptive_decode, file.adaptive_decode());
  GPUFEED_FROM_FILE(region_decode, region_decode, file.region_decode());
  GPUFEED_FROM_FILE(cheapest_cpu_rows, cheapest_cpu_rows, file.cheapest_cpu_rows());
  GPUFEED_FROM_FILE(share_cache_bytes, share_cache_bytes, file.share_cache_bytes());
  GPUFEED_FROM_FILE(s3_endpoint, s3_endpoint, file.s3_endpoint());
  GPUFEED_FROM_FILE(s3_region, s3_region, file.s3_region());
  GPUFEED_FROM_FILE(s3_max_connections, s3_max_connections, file.s3_max_connections());
  GPUFEED_FROM_FILE(cache_dir, cache_dir, file.cache_dir());
  GPUFEED_FROM_FILE(cache_bytes, cache_bytes, file.cache_bytes());
  GPUFEED_FROM_FILE(metrics_listen, metrics_listen, file.metrics_listen());
  GPUFEED_FROM_FILE(metrics_job_labels, metrics_job_labels, file.metrics_job_labels());
  GPUFEED_FROM_FILE(root_is_admin, root_is_admin, file.root_is_admin());
  GPUFEED_FROM_FILE(daemon_uid_is_admin, daemon_uid_is_admin, file.daemon_uid_is_admin());
  GPUFEED_FROM_FILE(health_listen, health_listen, file.health_listen());
  GPUFEED_FROM_FILE(max_samples_per_feed, max_samples_per_feed, file.max_samples_per_feed());
  GPUFEED_FROM_FILE(max_image_bytes, max_image_bytes, file.max_image_bytes());
  GPUFEED_FROM_FILE(max_ids_bytes, max_ids_bytes, file.max_ids_bytes());
  GPUFEED_FROM_FILE(max_ids_bytes_per_uid, max_ids_bytes_per_uid, file.max_ids_bytes_per_uid());
  GPUFEED_FROM_FILE(max_index_bytes, max_index_bytes, file.max_index_bytes());
  GPUFEED_FROM_FILE(max_index_bytes_per_uid, max_index_bytes_per_uid,
                    file.max_index_bytes_per_uid());
  GPUFEED_FROM_FILE(mem_request_timeout_ms, mem_request_timeout,
                    absl::Milliseconds(file.mem_request_timeout_ms()));
  GPUFEED_FROM_FILE(max_folder_entries, max_folder_entries, file.max_folder_entries());
  GPUFEED_FROM_FILE(folder_walk_timeout_ms, folder_walk_timeout,
                    absl::Milliseconds(file.folder_walk_timeout_ms()));
  GPUFEED_FROM_FILE(max_sessions_per_uid, max_sessions_per_uid, file.max_sessions_per_uid());
  GPUFEED_FROM_FILE(max_staging_bytes_per_uid, max_staging_bytes_per_uid,
                    file.max_staging_bytes_per_uid());
  GPUFEED_FROM_FILE(idle_lease_timeout_ms, idle_lease_timeout,
                    absl::Milliseconds(file.idle_lease_timeout_ms()));
  GPUFEED_FROM_FILE(max_connections_per_uid, max_connections_per_uid,
                    file.max_connections_per_uid());
  GPUFEED_FROM_FILE(max_connections, max_connections, file.max_connections());
  GPUFEED_FROM_FILE(stream_open_timeout_ms, stream_open_timeout,
                    absl::Milliseconds(file.stream_open_timeout_ms()));
  GPUFEED_FROM_FILE(connection_idle_timeout_ms, connection_idle_timeout,
                    absl::Milliseconds(file.connection_idle_timeout_ms()));
  GPUFEED_FROM_FILE(max_batch_time_ms, max_batch_time,
                    absl::Milliseconds(file.max_batch_time_ms()));
  GPUFEED_FROM_FILE(max_image_pixels, max_image_pixels, file.max_image_pixels());
#undef GPUFEED_FROM_FILE
  // Lists: a file that names one replaces the default (empty) list.
#define GPUFEED_LIST_FROM_FILE(field)                                   \
  if (file.field##_size() > 0) {                                        \
    c->field.assign(file.field().begin(), file.field().end());          \
    from_file(#field, #field);                                          \
  }
  GPUFEED_LIST_FROM_FILE(allow_uids);
  GPUFEED_LIST_FROM_FILE(allow_gids);
  GPUFEED_LIST_FROM_FILE(admin_uids);
  GPUFEED_LIST_FROM_FILE(admin_gids);
  GPUFEED_LIST_FROM_FILE(dataset_roots);
  GPUFEED_LIST_FROM_FILE(share_groups_across_uids);
#undef GPUFEED_LIST_FROM_FILE
  if (file.has_read_mode()) {
    GPUFEED_RETURN_IF_ERROR(parse(ParseReadMode(file.read_mode()), &c->read_mode));
  }
  if (file.has_log_level()) {
    GPUFEED_RETURN_IF_ERROR(parse(ParseLogLevel(file.log_level()), &c->log_level));
  }
  if (file.has_log_format()) {
    GPUFEED_RETURN_IF_ERROR(parse(ParseLogFormat(file.log_format()), &c->log_format));
  }
  return absl::OkStatus();
}

absl::Status Validate(DaemonConfig& c, const Sources& sources) {
  if (c.runtime_dir.empty() || c.runtime_dir[0] != '/') {
    return Invalid(sources, "runtime_dir",
                   absl::StrCat("must be an absolute path, got '", c.runtime_dir, "'"));
  }
  if (c.listen.empty()) {  // both sockets in the runtime directory, made by Daemon::Start
    if (!c.mem_socket.empty() && c.mem_socket[0] != '/') {
      return Invalid(sources, "mem_socket",
                     absl::StrCat("must be an absolute path, got '", c.mem_socket, "'"));
    }
    if (c.mem_socket == absl::StrCat(c.runtime_dir, "/", kSocketName)) {
      return Invalid(sources, "mem_socket", "must differ from the listen socket");
    }
  } else {
    const absl::StatusOr<std::string> path = SocketPath(c.listen);
    if (!path.ok()) return Invalid(sources, "listen", path.status().message());
    if (c.mem_socket.empty()) {
      std::string base = *path;
      if (absl::EndsWith(base, ".sock")) base.resize(base.size() - 5);
      c.mem_socket = base + ".mem.sock";
    }
    if (c.mem_socket[0] != '/') {
      return Invalid(sources, "mem_socket",
                     absl::StrCat("must be an absolute path, got '", c.mem_socket, "'"));
    }
    if (c.mem_socket == *path) {
      return Invalid(sources, "mem_socket", "must differ from the listen socket");
    }
  }
  if (c.staging_bytes < (uint64_t{1} << 20) || c.staging_bytes > (uint64_t{1} << 48)) {
    return Invalid(sources, "staging_bytes",
                   absl::StrCat("1 MiB to 256 TiB, got ", c.staging_bytes));
  }
  if (c.staging_slab_bytes < (uint64_t{1} << 20)) {
    return Invalid(sources, "staging_slab_bytes",
                   absl::StrCat("at least 1 MiB, got ", c.staging_slab_bytes));
  }
  if (c.threads < 0 || c.threads > 1024) {
    return Invalid(sources, "threads", absl::StrCat("0 to 1024, got ", c.threads));
  }
  if (c.threads == 0)
    c.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (c.attach_threads < 1 || c.attach_threads > 64) {
    return Invalid(sources, "attach_threads", absl::StrCat("1 to 64, got ", c.attach_threads));
  }
  if (c.max_sessions < 1) {
    return Invalid(sources, "max_sessions", absl::StrCat(">= 1, got ", c.max_sessions));
  }
  if (c.ring_slots < 0 || c.ring_slots > 64) {
    return Invalid(sources, "ring_slots", absl::StrCat("0 (auto) to 64, got ", c.ring_slots));
  }
  if (c.device_bytes == 0) return Invalid(sources, "device_bytes", "must be > 0");
  if (c.stall_timeout < absl::ZeroDuration()) {
    return Invalid(sources, "stall_timeout", "must be >= 0 (0 = off)");
  }
  if (c.shutdown_grace < absl::ZeroDuration()) {
    return Invalid(sources, "shutdown_grace", "must be >= 0");
  }
  if (c.attach_timeout <= absl::ZeroDuration()) {
    return Invalid(sources, "attach_timeout", "must be > 0");
  }
  // Bounded cost: each at least 1. The sample cap stays below 2^62 so that sample arithmetic
  // (ids as int64, positions plus a global batch) cannot wrap.
  if (c.max_samples_per_feed < 1 || c.max_samples_per_feed > (uint64_t{1} << 62)) {
    return Invalid(sources, "max_samples_per_feed",
                   absl::StrCat("1 to 2^62, got ", c.max_samples_per_feed));
  }
  if (c.max_image_bytes < 1) return Invalid(sources, "max_image_bytes", "must be > 0");
  if (c.max_ids_bytes < 1) return Invalid(sources, "max_ids_bytes", "must be > 0");
  if (c.max_ids_bytes_per_uid > c.max_ids_bytes) {
    return Invalid(sources, "max_ids_bytes_per_uid",
                   absl::StrCat("at most max_ids_bytes (", c.max_ids_bytes, "), got ",
                                c.max_ids_bytes_per_uid));
  }
  if (c.max_index_bytes < 1) return Invalid(sources, "max_index_bytes", "must be > 0");
  if (c.max_index_bytes_per_uid > c.max_index_bytes) {
    return Invalid(sources, "max_index_bytes_per_uid",
                   absl::StrCat("at most max_index_bytes (", c.max_index_bytes, "), got ",
                                c.max_index_bytes_per_uid));
  }
  for (const std::string& root : c.dataset_roots) {
    if (root.empty() || root[0] != '/') {
      return Invalid(sources, "dataset_roots",
                     absl::StrCat("must be absolute paths, got '", root, "'"));
    }
  }
  for (const std::string& group : c.share_groups_across_uids) {
    // As an Attach's share_group (session/attach_spec.h): a name no attach can give is a typo.
    if (group.empty() || group.size() > 128 ||
        group.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                "0123456789._:@+=/-") != std::string::npos) {
      return Invalid(sources, "share_groups_across_uids",
                     absl::StrCat("a group name is 1 to 128 bytes of [A-Za-z0-9._:@+=/-], got '",
                                  group, "'"));
    }
  }
  if (c.s3_max_connections < 1 || c.s3_max_connections > 1024) {
    return Invalid(sources, "s3_max_connections", "must be 1 to 1024");
  }
  if (!c.cache_dir.empty() && c.cache_dir[0] != '/') {
    return Invalid(sources, "cache_dir", absl::StrCat("must be absolute, got '", c.cache_dir, "'"));
  }
  if (c.s3_endpoint.empty() && (c.cache_bytes != 0 || !c.cache_dir.empty())) {
    return Invalid(sources, "cache_bytes",
                   "the object cache is for s3:// datasets: set s3_endpoint too");
  }
  if (c.mem_request_timeout <= absl::ZeroDuration()) {
    return Invalid(sources, "mem_request_timeout", "must be > 0");
  }
  if (c.max_folder_entries < 1) {
    return Invalid(sources, "max_folder_entries",
                   absl::StrCat(">= 1, got ", c.max_folder_entries));
  }
  if (c.folder_walk_timeout <= absl::ZeroDuration()) {
    return Invalid(sources, "folder_walk_timeout", "must be > 0");
  }
  if (c.max_sessions_per_uid < 1) {
    return Invalid(sources, "max_sessions_per_uid",
                   absl::StrCat(">= 1, got ", c.max_sessions_per_uid));
  }
  if (c.idle_lease_timeout < absl::ZeroDuration()) {
    return Invalid(sources, "idle_lease_timeout", "must be >= 0 (0 = off)");
  }
  if (c.max_connections_per_uid < 1) {
    return Invalid(sources, "max_connections_per_uid",
                   absl::StrCat(">= 1, got ", c.max_connections_per_uid));
  }
  if (c.max_connections < c.max_connections_per_uid) {
    return Invalid(sources, "max_connections",
                   absl::StrCat(">= max_connections_per_uid (", c.max_connections_per_uid,
                                "), got ", c.max_connections));
  }
  if (c.stream_open_timeout <= absl::ZeroDuration()) {
    return Invalid(sources, "stream_open_timeout", "must be > 0");
  }
  if (c.connection_idle_timeout < absl::ZeroDuration()) {
    return Invalid(sources, "connection_idle_timeout", "must be >= 0 (0 = off)");
  }
  if (c.max_batch_time < absl::ZeroDuration()) {
    return Invalid(sources, "max_batch_time", "must be >= 0 (0 = none)");
  }
  // At least one pixel; at most 2^31, past which a decoded RGB image's bytes (x3) and the
  // augment's float arithmetic are no longer safe to assume small.
  if (c.max_image_pixels < 1 || c.max_image_pixels > (uint64_t{1} << 31)) {
    return Invalid(sources, "max_image_pixels",
                   absl::StrCat("1 to 2^31, got ", c.max_image_pixels));
  }
  GPUFEED_RETURN_IF_ERROR(CheckHostPort(sources, "metrics_listen", c.metrics_listen));
  return CheckHostPort(sources, "health_listen", c.health_listen);
}

}  // namespace config_internal

uint64_t StagingBytesPerUid(const DaemonConfig& config) {
  return config.max_staging_bytes_per_uid != 0 ? config.max_staging_bytes_per_uid
                                               : config.staging_bytes / 2;
}

const char* ReadModeName(ReadMode mode) { return mode == ReadMode::kPread ? "pread" : "mmap"; }

absl::StatusOr<ReadMode> ParseReadMode(absl::string_view name) {
  if (name == "mmap") return ReadMode::kMmap;
  if (name == "pread") return ReadMode::kPread;
  return absl::InvalidArgumentError(
      absl::StrCat("read_mode: want mmap or pread, got '", name, "'"));
}

absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name) {
  if (name == "text") return LogFormat::kText;
  if (name == "json") return LogFormat::kJson;
  return absl::InvalidArgumentError(
      absl::StrCat("log_format: want text or json, got '", name, "'"));
}

absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name) {
  const spdlog::level::level_enum level = spdlog::level::from_str(std::string(name));
  // from_str maps unknown names to `off`; only "off" itself may mean off.
  if (level == spdlog::level::off && name != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level: want trace, debug, info, warn, error or off, got '", name, "'"));
  }
  return level;
}

DaemonConfig DefaultConfig() {
  DaemonConfig c;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr) c.xdg_runtime_dir = xdg;
  if (const char* library = std::getenv("GPUFEED_NVJPEG_LIBRARY"); library != nullptr) {
    c.nvjpeg_library = library;
  }
  if (const char* on = std::getenv("GPUFEED_NVJPEG_INTERPOLATION"); on != nullptr) {
    c.nvjpeg_interpolation = absl::string_view(on) != "0";
  }
  return c;
}

absl::Status ValidateConfig(DaemonConfig& config) {
  return config_internal::Validate(config, Sources());
}

absl::StatusOr<std::string> UnixPathOf(const std::string& listen) {
  absl::StatusOr<std::string> path = SocketPath(listen);
  if (!path.ok()) return Annotate(path.status(), "listen");
  return path;
}

}  // namespace gpufeed::server
