// gpufeedd's flags, and LoadConfig, which applies those given over the --config file
// (config.cc reads the file and validates).
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/config.h"
#include "server/config_internal.h"

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
ABSL_FLAG(uint64_t, share_cache_bytes, DaemonConfig().share_cache_bytes,
          "bytes of decoded images the sharing groups' cache may hold, every group of the node "
          "together (AttachRequest.share_group); 0: none kept, each job decodes what it reads");
ABSL_FLAG(std::vector<std::string>, share_groups_across_uids, {},
          "sharing group names whose members may be of several uids (comma-separated): one "
          "group of every uid's jobs of that name reading the same files, a decode made for "
          "one uid given to another only where that uid may read the file; others: per uid");
ABSL_FLAG(std::string, s3_endpoint, DaemonConfig().s3_endpoint,
          "serve s3:// datasets from this object store: aws (AWS S3) or the base URL of an "
          "S3-compatible one (http://minio:9000); a caller's AWS_ENDPOINT_URL_S3 must name it. "
          "Empty: s3:// datasets are refused");
ABSL_FLAG(std::string, s3_region, DaemonConfig().s3_region,
          "the region every request is signed for, and AWS's host (GCS: auto); a caller's "
          "AWS_REGION is not used");
ABSL_FLAG(int32_t, s3_max_connections, DaemonConfig().s3_max_connections,
          "requests to the object store in flight at once, each on a kept-alive connection");
ABSL_FLAG(std::string, cache_dir, DaemonConfig().cache_dir,
          "the node-local cache of object bytes: a directory (created 0700) or empty for memory");
ABSL_FLAG(uint64_t, cache_bytes, DaemonConfig().cache_bytes,
          "the object cache's size in bytes, every job and rank together; 0: no cache");
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
using config_internal::Sources;
namespace {

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
  apply(FLAGS_share_cache_bytes, &c->share_cache_bytes);
  apply(FLAGS_share_groups_across_uids, &c->share_groups_across_uids);
  apply(FLAGS_s3_endpoint, &c->s3_endpoint);
  apply(FLAGS_s3_region, &c->s3_region);
  apply(FLAGS_s3_max_connections, &c->s3_max_connections);
  apply(FLAGS_cache_dir, &c->cache_dir);
  apply(FLAGS_cache_bytes, &c->cache_bytes);
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

}  // namespace

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
    GPUFEED_RETURN_IF_ERROR(config_internal::ApplyFile(path, &config, &sources));
  }
  GPUFEED_RETURN_IF_ERROR(ApplyFlags(given, &config, &sources));
  GPUFEED_RETURN_IF_ERROR(config_internal::Validate(config, sources));
  return config;
}

}  // namespace gpufeed::server
