#include "server/config.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "gpufeed/v1/config.pb.h"

// gpufeedd's flags, one per DaemonConfig setting; their defaults are DefaultConfig()'s.
// LoadConfig applies those given on the command line over the --config file.
namespace {
using gpufeed::server::DaemonConfig;
using gpufeed::server::DefaultConfig;
}  // namespace

ABSL_FLAG(std::string, config, "",
          "a gpufeed.v1.DaemonConfig file (text format or JSON; deploy/gpufeedd.textproto); "
          "flags given on the command line override it");
ABSL_FLAG(std::string, listen, DaemonConfig().listen,
          "gRPC listen address: unix:///path/to/socket; default: gpufeed.sock in --runtime_dir");
ABSL_FLAG(std::string, runtime_dir, DaemonConfig().runtime_dir,
          "where the sockets go without --listen: made 0755 if missing, else (not root) "
          "$XDG_RUNTIME_DIR/gpufeed");
ABSL_FLAG(std::string, mem_socket, DaemonConfig().mem_socket,
          "Unix socket that hands over memory; default: beside --listen, NAME.mem.sock");
ABSL_FLAG(uint64_t, staging_bytes, DaemonConfig().staging_bytes,
          "bytes of host staging memory shared by all sessions' rings (host rings: a memfd "
          "each; device sessions: memfd slabs)");
ABSL_FLAG(uint64_t, staging_slab_bytes, DaemonConfig().staging_slab_bytes,
          "device sessions stage in memfd slabs of at most this many bytes; one device "
          "session's staging must fit in one slab");
ABSL_FLAG(int, threads, DaemonConfig().threads, "reader threads; 0 = one per core");
ABSL_FLAG(int, attach_threads, DaemonConfig().attach_threads,
          "threads that run Attach (open a dataset, allocate its rings), 1 to 64");
ABSL_FLAG(int, max_sessions, DaemonConfig().max_sessions, "most sessions served at once");
ABSL_FLAG(int, ring_slots, DaemonConfig().ring_slots,
          "ring depth (slots per session) when Attach gives none; 0 = auto: as many as fit "
          "in 64 MiB, 2 to 16 (a device ring of staged images: 4, else 3, where that many "
          "for every GPU fit in half the uid's staging quota, the pool for admins)");
ABSL_FLAG(absl::Duration, attach_timeout, DaemonConfig().attach_timeout,
          "a session whose stream is not open this long after Attach is ended");
ABSL_FLAG(std::string, read_mode, gpufeed::server::ReadModeName(DaemonConfig().read_mode),
          "how samples are copied from the page cache: mmap (memcpy from a mapping, guarded "
          "against a shrinking file) or pread");
ABSL_FLAG(uint64_t, device_bytes, DaemonConfig().device_bytes,
          "device memory all consumers' rings on one GPU may hold together (bytes)");
ABSL_FLAG(std::string, log_level,
          std::string(spdlog::level::to_string_view(DaemonConfig().log_level).data()),
          "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, log_format, "text", "text, or json (one object a line, for log pipelines)");
ABSL_FLAG(std::string, metrics_listen, DaemonConfig().metrics_listen,
          "TCP HOST:PORT serving Prometheus metrics at /metrics; empty: off");
ABSL_FLAG(std::string, health_listen, DaemonConfig().health_listen,
          "TCP HOST:PORT serving grpc.health.v1 alone (Kubernetes gRPC probes); empty: off");
ABSL_FLAG(absl::Duration, stall_timeout, DaemonConfig().stall_timeout,
          "liveness: the daemon reports itself stalled (health NOT_SERVING, no systemd watchdog "
          "pings) once a fill has gone this long without finishing a sample, or a GPU copy has "
          "run this long; 0 = never");
ABSL_FLAG(absl::Duration, shutdown_grace, DaemonConfig().shutdown_grace,
          "at shutdown, how long streams get to end; the process exits (status 1) if the whole "
          "teardown takes 5 s longer than this");
// The nvJPEG flags' registered defaults are DaemonConfig's, not the environment's: absl
// evaluates a flag's default expression again on every DefaultValue(), so an environment
// default would make a flag look given (current != default) once the environment changed
// after the flag was first read. DefaultConfig() applies the environment instead.
ABSL_FLAG(std::string, nvjpeg_library, DaemonConfig().nvjpeg_library,
          "nvJPEG's library (default $GPUFEED_NVJPEG_LIBRARY, else libnvjpeg.so.13/.12 on the "
          "loader path or under /usr/local/cuda)");
ABSL_FLAG(std::vector<std::string>, allow_uids, {},
          "uids that may consume (comma-separated numbers); with --allow_gids empty as well: "
          "any uid that can connect. Admins always may");
ABSL_FLAG(std::vector<std::string>, allow_gids, {},
          "gids whose members (primary or supplementary group) may consume");
ABSL_FLAG(std::vector<std::string>, admin_uids, {},
          "uids that are admins besides root and the daemon's own uid (--root_is_admin, "
          "--daemon_uid_is_admin): may drain, see every session and feed, detach any session");
ABSL_FLAG(std::vector<std::string>, admin_gids, {}, "gids whose members are admins");
ABSL_FLAG(bool, root_is_admin, DaemonConfig().root_is_admin,
          "uid 0 is an admin; off where a peer's uid 0 may be a container's root (a pod "
          "without a user namespace on a hostPath socket)");
ABSL_FLAG(bool, daemon_uid_is_admin, DaemonConfig().daemon_uid_is_admin,
          "the daemon's own effective uid is an admin (systemd's ExecStop drains as it); off: "
          "only --admin_uids, --admin_gids and, per --root_is_admin, root");
ABSL_FLAG(bool, metrics_job_labels, DaemonConfig().metrics_job_labels,
          "/metrics labels the per-consumer series with the job's name and its owner's uid, "
          "which anyone who can reach --metrics_listen then sees; off: an opaque label per job");
ABSL_FLAG(int, max_sessions_per_uid, DaemonConfig().max_sessions_per_uid,
          "sessions one uid may hold at once (admins are not capped)");
ABSL_FLAG(uint64_t, max_staging_bytes_per_uid, DaemonConfig().max_staging_bytes_per_uid,
          "bytes of host staging one uid's rings may hold together; 0 = half of "
          "--staging_bytes (admins are not capped)");
ABSL_FLAG(absl::Duration, idle_lease_timeout, DaemonConfig().idle_lease_timeout,
          "a host-delivery session whose consumer holds every slot and releases none this long "
          "is ended (DEADLINE_EXCEEDED); 0 = never. Device sessions are exempt");
ABSL_FLAG(int, max_connections_per_uid, DaemonConfig().max_connections_per_uid,
          "connections to the gRPC socket one uid may hold at once (admins are not capped); "
          "also the most Stream calls of one uid not yet opened");
ABSL_FLAG(int, max_connections, DaemonConfig().max_connections,
          "connections to the gRPC socket all uids may hold together; also the most Stream "
          "calls not yet opened");
ABSL_FLAG(absl::Duration, stream_open_timeout, DaemonConfig().stream_open_timeout,
          "a Stream call whose open message has not come this long is ended "
          "(DEADLINE_EXCEEDED)");
ABSL_FLAG(absl::Duration, connection_idle_timeout, DaemonConfig().connection_idle_timeout,
          "a gRPC connection with no call in progress this long is closed (clients reconnect "
          "on their next call); 0 = never");
ABSL_FLAG(bool, nvjpeg_interpolation, DaemonConfig().nvjpeg_interpolation,
          "nvJPEG chroma upsampling by interpolation, as libjpeg-turbo (default true unless "
          "$GPUFEED_NVJPEG_INTERPOLATION=0)");
ABSL_FLAG(bool, adaptive_decode, DaemonConfig().adaptive_decode,
          "decode auto: the CPU pool decodes as much of each batch as it keeps up with, nvJPEG "
          "the rest (nvJPEG's engines slow a training process on the same GPU, most without "
          "MPS); off: nvJPEG for every row it can decode");
ABSL_FLAG(bool, region_decode, DaemonConfig().region_decode,
          "a random resized crop decodes only the rows and columns of a JPEG its crop box "
          "reads, on the CPU (the same pixels as a whole decode, less work); off: every pixel");
ABSL_FLAG(bool, cheapest_cpu_rows, DaemonConfig().cheapest_cpu_rows,
          "adaptive_decode with region_decode: the CPU pool takes the rows whose crop boxes "
          "are estimated cheapest for it, nvJPEG the others; off: the CPU's rows are spread "
          "evenly over the batch");
ABSL_FLAG(uint64_t, max_samples_per_feed, DaemonConfig().max_samples_per_feed,
          "the most samples one feed's dataset may make; a larger one's Attach is refused "
          "(RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint64_t, max_image_bytes, DaemonConfig().max_image_bytes,
          "an image file larger than this many bytes is a bad sample (too_large), never read");
ABSL_FLAG(absl::Duration, max_batch_time, DaemonConfig().max_batch_time,
          "one batch's time budget: a fill running longer stops and its session ends "
          "(DEADLINE_EXCEEDED); 0 = none. Not liveness: see --stall_timeout");
ABSL_FLAG(uint64_t, max_image_pixels, DaemonConfig().max_image_pixels,
          "an image of more pixels (width x height, from its header) is a bad sample "
          "(too_large), never decoded");
ABSL_FLAG(uint64_t, max_ids_bytes, DaemonConfig().max_ids_bytes,
          "bytes all sessions' per-slot sample-id arrays (batch x slots x 8) may take together; "
          "an Attach beyond it is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint64_t, max_ids_bytes_per_uid, DaemonConfig().max_ids_bytes_per_uid,
          "of --max_ids_bytes, the most one uid's sessions may hold together; 0 = half "
          "(admins are not capped)");
ABSL_FLAG(uint64_t, max_index_bytes, DaemonConfig().max_index_bytes,
          "bytes all datasets' attach-time indexes (webdataset samples and member names, image "
          "folder paths) may hold together; an Attach beyond it is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(uint64_t, max_index_bytes_per_uid, DaemonConfig().max_index_bytes_per_uid,
          "of --max_index_bytes, the most the indexes one uid's attaches built may hold; 0 = "
          "half (admins are not capped)");

namespace gpufeed::server {
namespace {

// Where a setting's value came from, for the settings a config file set (and no flag
// replaced): the setting's name (its flag's) -> "config FILE: file_field".
using Sources = absl::flat_hash_map<std::string, std::string>;

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

// A flag's list of ids ("1000,1001") as numbers; INVALID_ARGUMENT naming the flag.
absl::StatusOr<std::vector<uint32_t>> ParseIds(absl::string_view flag,
                                               const std::vector<std::string>& values) {
  std::vector<uint32_t> out;
  for (const std::string& v : values) {
    uint32_t id = 0;
    if (!absl::SimpleAtoi(v, &id) || v.empty() || v[0] == '+' || v[0] == '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": want numeric ids separated by commas (e.g. 1000,1001), got '", v, "'"));
    }
    out.push_back(id);
  }
  return out;
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

// A flag's value replaces the setting when the flag was given (named on the command line, or
// set to other than its default through --flagfile).
absl::Status ApplyFlags(const absl::flat_hash_set<std::string>& named, DaemonConfig* c,
                        Sources* sources) {
  auto given = [&](const auto& flag) {
    const absl::CommandLineFlag& handle = absl::GetFlagReflectionHandle(flag);
    const std::string name(handle.Name());
    if (!named.contains(name) && handle.CurrentValue() == handle.DefaultValue()) return false;
    sources->erase(name);  // the flag's name is the field's in every message
    return true;
  };
  auto apply = [&](const auto& flag, auto* field) {
    if (given(flag)) *field = absl::GetFlag(flag);
  };
  apply(FLAGS_listen, &c->listen);
  apply(FLAGS_mem_socket, &c->mem_socket);
  apply(FLAGS_runtime_dir, &c->runtime_dir);
  apply(FLAGS_staging_bytes, &c->staging_bytes);
  apply(FLAGS_staging_slab_bytes, &c->staging_slab_bytes);
  apply(FLAGS_threads, &c->threads);
  apply(FLAGS_attach_threads, &c->attach_threads);
  apply(FLAGS_max_sessions, &c->max_sessions);
  apply(FLAGS_ring_slots, &c->ring_slots);
  apply(FLAGS_attach_timeout, &c->attach_timeout);
  apply(FLAGS_device_bytes, &c->device_bytes);
  apply(FLAGS_metrics_listen, &c->metrics_listen);
  apply(FLAGS_metrics_job_labels, &c->metrics_job_labels);
  apply(FLAGS_root_is_admin, &c->root_is_admin);
  apply(FLAGS_daemon_uid_is_admin, &c->daemon_uid_is_admin);
  apply(FLAGS_health_listen, &c->health_listen);
  apply(FLAGS_stall_timeout, &c->stall_timeout);
  apply(FLAGS_shutdown_grace, &c->shutdown_grace);
  apply(FLAGS_nvjpeg_library, &c->nvjpeg_library);
  apply(FLAGS_nvjpeg_interpolation, &c->nvjpeg_interpolation);
  apply(FLAGS_adaptive_decode, &c->adaptive_decode);
  apply(FLAGS_region_decode, &c->region_decode);
  apply(FLAGS_cheapest_cpu_rows, &c->cheapest_cpu_rows);
  apply(FLAGS_max_samples_per_feed, &c->max_samples_per_feed);
  apply(FLAGS_max_image_bytes, &c->max_image_bytes);
  apply(FLAGS_max_ids_bytes, &c->max_ids_bytes);
  apply(FLAGS_max_ids_bytes_per_uid, &c->max_ids_bytes_per_uid);
  apply(FLAGS_max_index_bytes, &c->max_index_bytes);
  apply(FLAGS_max_index_bytes_per_uid, &c->max_index_bytes_per_uid);
  apply(FLAGS_max_sessions_per_uid, &c->max_sessions_per_uid);
  apply(FLAGS_max_staging_bytes_per_uid, &c->max_staging_bytes_per_uid);
  apply(FLAGS_idle_lease_timeout, &c->idle_lease_timeout);
  apply(FLAGS_max_connections_per_uid, &c->max_connections_per_uid);
  apply(FLAGS_max_connections, &c->max_connections);
  apply(FLAGS_stream_open_timeout, &c->stream_open_timeout);
  apply(FLAGS_connection_idle_timeout, &c->connection_idle_timeout);
  apply(FLAGS_max_batch_time, &c->max_batch_time);
  apply(FLAGS_max_image_pixels, &c->max_image_pixels);
  auto ids = [&](const auto& flag, const char* name, std::vector<uint32_t>* field) {
    if (!given(flag)) return absl::OkStatus();
    GPUFEED_ASSIGN_OR_RETURN(*field, ParseIds(name, absl::GetFlag(flag)));
    return absl::OkStatus();
  };
  GPUFEED_RETURN_IF_ERROR(ids(FLAGS_allow_uids, "allow_uids", &c->allow_uids));
  GPUFEED_RETURN_IF_ERROR(ids(FLAGS_allow_gids, "allow_gids", &c->allow_gids));
  GPUFEED_RETURN_IF_ERROR(ids(FLAGS_admin_uids, "admin_uids", &c->admin_uids));
  GPUFEED_RETURN_IF_ERROR(ids(FLAGS_admin_gids, "admin_gids", &c->admin_gids));
  if (given(FLAGS_read_mode)) {
    GPUFEED_ASSIGN_OR_RETURN(c->read_mode, ParseReadMode(absl::GetFlag(FLAGS_read_mode)));
  }
  if (given(FLAGS_log_level)) {
    GPUFEED_ASSIGN_OR_RETURN(c->log_level, ParseLogLevel(absl::GetFlag(FLAGS_log_level)));
  }
  if (given(FLAGS_log_format)) {
    GPUFEED_ASSIGN_OR_RETURN(c->log_format, ParseLogFormat(absl::GetFlag(FLAGS_log_format)));
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

}  // namespace

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

absl::flat_hash_set<std::string> GivenFlags(int argc, const char* const* argv) {
  absl::flat_hash_set<std::string> given;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;  // a positional argument or a flag's value
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t equals = arg.find('=');
    std::string name(arg.substr(0, equals));
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && absl::StartsWith(name, "no")) {  // --nofoo: bool flag foo, false
      flag = absl::FindCommandLineFlag(name.substr(2));
      if (flag == nullptr || !flag->IsOfType<bool>()) continue;
      name.erase(0, 2);
    }
    if (flag == nullptr) continue;
    given.insert(name);
    // "--name value": the value is the next argument (a bool flag takes none that way).
    if (equals == absl::string_view::npos && !flag->IsOfType<bool>()) ++i;
  }
  return given;
}

absl::StatusOr<DaemonConfig> LoadConfig(const absl::flat_hash_set<std::string>& given) {
  DaemonConfig config = DefaultConfig();
  Sources sources;
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    GPUFEED_RETURN_IF_ERROR(ApplyFile(path, &config, &sources));
  }
  GPUFEED_RETURN_IF_ERROR(ApplyFlags(given, &config, &sources));
  GPUFEED_RETURN_IF_ERROR(Validate(config, sources));
  return config;
}

absl::Status ValidateConfig(DaemonConfig& config) { return Validate(config, Sources()); }

absl::StatusOr<std::string> UnixPathOf(const std::string& listen) {
  absl::StatusOr<std::string> path = SocketPath(listen);
  if (!path.ok()) return Annotate(path.status(), "listen");
  return path;
}

}  // namespace gpufeed::server
